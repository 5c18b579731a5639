"""A resume redelivered after its worker died with the VM already booted on its target: the
rerun finishes the record the first run did not write, and for a hibernated guest waits again
for the sign it came back, so the answer still says whether its memory was restored (before:
it returned "already done" with no word of it)."""

from pathlib import Path

import pytest

from vmmgr import operations, suspend


class Report:
    rerun = True

    def __init__(self):
        self.events = []

    def event(self, message, **kw):
        self.events.append((message, kw.get("kind", "info")))


@pytest.fixture
def fleet(mocker):
    mocker.patch.object(suspend, "recover", return_value=None)  # nothing cut short on storage
    fleet = mocker.MagicMock()
    fleet.is_suspended.return_value = False
    guest = fleet.locate.return_value
    guest.host_name = "host2"
    guest.workload.return_value = "counter"
    guest.console_path.return_value = Path("/storage/consoles/gpu1@000003-h2.log")
    guest.is_active.return_value = True
    return fleet


@pytest.mark.parametrize("restored", [True, False])
def test_a_rerun_after_the_boot_says_whether_the_hibernated_guest_came_back(
        fleet, mocker, restored):
    fleet.state.vm.return_value = {"state": "resuming", "saved_as": "hibernated"}
    waited = mocker.patch.object(suspend, "came_back", return_value=restored)
    done = operations.resume(fleet, Report(), "gpu1", "host2")
    assert done["already_done"] and done["host"] == "host2" and done["restored"] is restored
    waited.assert_called_once()
    assert waited.call_args.args[1] == Path("/storage/consoles/gpu1@000003-h2.log")
    recorded = fleet.state.record.call_args
    assert recorded.args[:2] == ("resumed", "gpu1") and recorded.args[2]["host"] == "host2"


def test_a_rerun_after_the_record_was_written_changes_nothing(fleet, mocker):
    fleet.state.vm.return_value = {"state": "running", "host": "host2", "saved_as": ""}
    waited = mocker.patch.object(suspend, "came_back")
    done = operations.resume(fleet, Report(), "vm1", None)
    assert done == {"vm": "vm1", "host": "host2", "already_done": True}
    waited.assert_not_called()
    fleet.state.record.assert_not_called()


def test_a_rerun_of_a_saved_vm_records_it_resumed_without_a_restore_question(fleet, mocker):
    fleet.state.vm.return_value = {"state": "resuming", "saved_as": "suspended"}
    waited = mocker.patch.object(suspend, "came_back")
    done = operations.resume(fleet, Report(), "vm1", None)
    assert done["already_done"] and done["restored"] is None and done["state"] == "running"
    waited.assert_not_called()
    assert fleet.state.record.call_args.args[:2] == ("resumed", "vm1")
