"""A stop or start redelivered after its worker died mid-way finishes the steps the first run
did not reach (before: the rerun returned at once, leaving the record "stopping", or a started
VM with its address routed to nowhere)."""

import pytest

from vmmgr import operations
from vmmgr.errors import Conflict
from vmmgr.render import XMLNS


class Report:
    def __init__(self, rerun: bool):
        self.rerun, self.events = rerun, []

    def event(self, message, **kw):
        self.events.append(message)


@pytest.fixture
def fleet(mocker):
    fleet = mocker.MagicMock()
    guest = fleet.locate.return_value
    guest.host_name = "host2"
    guest.xml.return_value = (f"<domain><metadata><vm xmlns='{XMLNS}'><address>10.78.0.7"
                              "</address></vm></metadata></domain>")
    fleet.host.return_value.record.state = "active"
    fleet.host.return_value.name = "host2"
    return fleet


def test_a_rerun_stop_that_finds_the_guest_off_records_it_stopped(fleet):
    fleet.locate.return_value.is_active.return_value = False
    done = operations.stop(fleet, Report(rerun=True), "vm1")
    assert done == {"vm": "vm1", "host": "host2", "state": "shutoff"}
    fleet.state.set_vm.assert_called_with("vm1", state="shutoff", host="host2", target="")
    fleet.publish.assert_called_with("vm1")
    fleet.locate.return_value.shutdown.assert_not_called()


def test_a_first_stop_of_a_stopped_vm_is_refused_and_changes_nothing(fleet):
    fleet.locate.return_value.is_active.return_value = False
    fleet.locate.return_value.state.return_value = "shutoff"
    with pytest.raises(Conflict, match="not running"):
        operations.stop(fleet, Report(rerun=False), "vm1")
    fleet.state.set_vm.assert_not_called()


def test_a_rerun_start_that_finds_it_running_routes_and_records_it(fleet):
    guest = fleet.locate.return_value
    guest.is_active.return_value = True
    done = operations.start(fleet, Report(rerun=True), "vm1")
    assert done == {"vm": "vm1", "host": "host2", "state": "running"}
    guest.start.assert_not_called()
    fleet.route_address.assert_called_with("10.78.0.7", "host2")
    fleet.state.set_vm.assert_called_with("vm1", state="running", host="host2", target="")


def test_a_first_start_of_a_running_vm_is_refused_and_changes_nothing(fleet):
    fleet.locate.return_value.is_active.return_value = True
    with pytest.raises(Conflict, match="already running on host2"):
        operations.start(fleet, Report(rerun=False), "vm1")
    fleet.route_address.assert_not_called()
    fleet.state.set_vm.assert_not_called()
