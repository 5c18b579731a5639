"""A suspend or resume cut short (its worker SIGKILLed, its node lost) while libvirt carried on
without its client: `suspend.recover` finishes or undoes it from what storage and libvirt show.
Before it, a save finished by libvirt after its worker died left the VM shut off for good with
a complete image nothing would resume. Fake hosts and guests answer as libvirt does."""

import json
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace

import libvirt
import pytest

from vmmgr import suspend
from vmmgr.errors import Conflict, HostUnreachable, NotFound
from vmmgr.fleet import Fleet

PART, DONE = b"LibvirtQemudPart", b"LibvirtQemudSave"


class FakeGuest:
    def __init__(self, name, host_name, state="running", job=False, persistent=True):
        self.name, self.host_name, self._state = name, host_name, state
        self.job, self.persistent, self.calls = job, persistent, []

    def state(self):
        return self._state

    def is_active(self):
        return self._state != "shutoff"

    def has_job(self):
        return self.job

    def is_persistent(self):
        return self.persistent

    def console_path(self):
        return Path(f"/consoles/{self.name}.3.{self.host_name}.log")

    def undefine(self):
        self.calls.append("undefine")

    def start(self):
        self.calls.append("start")
        self._state = "running"

    def resume(self):
        self.calls.append("resume")
        self._state = "running"


class FakeHost:
    connected = True  # no connection to open ahead (Fleet.find_all's connect_all)

    def __init__(self, name, guest=None, answers=True, state="active"):
        self.name, self.guest, self.answers = name, guest, answers
        self.record = SimpleNamespace(state=state)
        self.defined = []

    def find_guest(self, vm):
        if not self.answers:
            raise HostUnreachable(f"host {self.name} does not answer")
        return self.guest

    @contextmanager
    def connection_apart(self):  # a save's own connection (none needed here)
        yield None

    def define(self, xml):
        self.defined.append(xml)
        self.guest = self.guest or FakeGuest("vm1", self.name, state="shutoff")
        self.guest.persistent = True
        return self.guest


class FakeStore:
    """The store's copy of the saves (FleetState's put_save, forget_save, save_of, saves)."""

    def __init__(self):
        self.copies = {}

    def put_save(self, vm, save):
        self.copies[vm] = save

    def forget_save(self, vm):
        self.copies.pop(vm, None)

    def save_of(self, vm):
        return self.copies.get(vm)

    def saves(self):
        return dict(self.copies)


class FakeFleet:
    def __init__(self, tmp_path, *hosts):
        self.paths = SimpleNamespace(saves=tmp_path / "saves")
        self.state = FakeStore()
        self._hosts = {h.name: h for h in hosts}
        self.routes = []

    def host(self, name):
        return self._hosts[name]

    def hosts(self):
        return list(self._hosts.values())

    find_all, find, locate = Fleet.find_all, Fleet.find, Fleet.locate  # the real ones
    own_site, save_site, sees_save = Fleet.own_site, Fleet.save_site, Fleet.sees_save
    require_own_site = Fleet.require_own_site

    def sites(self):
        return {}  # a fleet that names no site

    def route_address(self, address, host):
        self.routes.append((address, host))

    def swap_disk_path(self, vm):
        return self.paths.saves.parent / "disks" / f"{vm}-swap.img"


DOMAIN = ("<domain><name>vm1</name><metadata><vmmgr:vm xmlns:vmmgr='https://vmmgr.dev/xmlns/vm/1'>"
          "<vmmgr:address>10.78.0.5</vmmgr:address></vmmgr:vm></metadata><devices><serial "
          "type='file'><source path='/consoles/vm1.2.h1.log'/></serial></devices></domain>")


def cut_short_save(fleet, mode="save", image: bytes | None = None, record=False) -> Path:
    d = fleet.paths.saves / "vm1"
    d.mkdir(parents=True)
    (d / "domain.xml").write_text(DOMAIN)
    (d / "intent.json").write_text(json.dumps({
        "vm": "vm1", "from_host": "h1", "memory_mib": 512, "vcpus": 1, "parked": True,
        "mode": mode, "device_model": "", "device_count": 0, "started_at": time.time() - 5}))
    if image is not None:
        (d / "image.partial").write_bytes(image + b"\0" * 4096)
    if record:
        (d / "record.json").write_text(json.dumps({
            "vm": "vm1", "from_host": "h1", "memory_mib": 512, "vcpus": 1,
            "suspended_at": time.time(), "save_ms": 900, "image_bytes": 4112, "parked": True}))
    return d


def test_a_save_libvirt_finished_after_its_worker_died_is_finished(tmp_path):
    guest = FakeGuest("vm1", "h1", state="shutoff")  # libvirt stopped it when the save ended
    fleet = FakeFleet(tmp_path, FakeHost("h1", guest))
    d = cut_short_save(fleet, image=DONE)
    words = suspend.recover(fleet, "vm1")
    assert "completed on h1: suspended" in words
    record = suspend.find_suspended(fleet, "vm1")
    assert record.from_host == "h1" and record.parked and record.image_bytes == 4112
    assert record.memory_mib == 512 and 0 < record.save_ms < 60_000
    assert (d / "image").read_bytes().startswith(DONE) and not (d / "image.partial").exists()
    assert not (d / "intent.json").exists() and guest.calls == ["undefine"]
    assert suspend.cut_short(fleet) == []
    assert fleet.state.save_of("vm1")["state"] == "saved"  # the store's copy says so too
    assert suspend.suspended(fleet) == [record]


def test_a_save_that_never_completed_leaves_the_vm_running_and_no_half_image(tmp_path):
    guest = FakeGuest("vm1", "h1")  # the save failed: libvirt left the guest running
    fleet = FakeFleet(tmp_path, FakeHost("h1", guest))
    d = cut_short_save(fleet, image=PART)
    assert "never completed: it runs on h1 as before" in suspend.recover(fleet, "vm1")
    assert not d.exists() and guest.calls == [] and suspend.find_suspended(fleet, "vm1") is None


@pytest.mark.parametrize("mode", ["save", "guest", "stopped"])
def test_an_intent_whose_vm_has_moved_since_is_dropped_never_run_twice(tmp_path, mode):
    """A suspend failed with its intent left behind (its answer lost), and the VM, running on,
    was moved to h2 before any recovery. Before, the recovery found nothing on h1 and booted
    (or parked) it there a second time from the half image."""
    moved = FakeGuest("vm1", "h2")
    h1 = FakeHost("h1")
    fleet = FakeFleet(tmp_path, h1, FakeHost("h2", moved))
    d = cut_short_save(fleet, mode=mode, image=PART)
    assert "has moved to h2 since" in suspend.recover(fleet, "vm1")
    assert not d.exists() and h1.defined == [] and moved.calls == []
    assert suspend.find_suspended(fleet, "vm1") is None


def test_an_intent_whose_vm_may_be_on_a_silent_host_is_not_decided(tmp_path):
    fleet = FakeFleet(tmp_path, FakeHost("h1"), FakeHost("h2", answers=False))
    d = cut_short_save(fleet, image=PART)
    with pytest.raises(HostUnreachable):
        suspend.recover(fleet, "vm1")
    assert (d / "intent.json").exists() and fleet.host("h1").defined == []


def test_a_save_still_running_in_libvirt_is_waited_for_not_decided(tmp_path):
    guest = FakeGuest("vm1", "h1", job=True)
    fleet = FakeFleet(tmp_path, FakeHost("h1", guest))
    d = cut_short_save(fleet, image=PART)
    with pytest.raises(Conflict, match="save is still under way on h1"):
        suspend.recover(fleet, "vm1", wait=0)
    assert (d / "intent.json").exists() and (d / "image.partial").exists() and guest.calls == []


def test_a_vm_shut_off_with_no_complete_image_boots_again(tmp_path):
    guest = FakeGuest("vm1", "h1", state="shutoff")  # its QEMU died mid-save
    fleet = FakeFleet(tmp_path, FakeHost("h1", guest))
    d = cut_short_save(fleet, image=PART)
    assert "booted again on h1" in suspend.recover(fleet, "vm1")
    assert guest.calls == ["start"] and not d.exists()


def test_a_hibernation_cut_short_after_the_guest_powered_off_is_finished(tmp_path):
    guest = FakeGuest("vm1", "h1", state="shutoff")
    fleet = FakeFleet(tmp_path, FakeHost("h1", guest))
    cut_short_save(fleet, mode="guest")
    assert "hibernation cut short had completed" in suspend.recover(fleet, "vm1")
    record = suspend.find_suspended(fleet, "vm1")
    assert record.mode == "guest" and guest.calls == ["undefine"]


def test_a_suspend_cut_short_after_its_record_only_drops_the_hosts_copy(tmp_path):
    guest = FakeGuest("vm1", "h1", state="shutoff")
    fleet = FakeFleet(tmp_path, FakeHost("h1", guest))
    d = cut_short_save(fleet, image=DONE, record=True)
    assert "had finished" in suspend.recover(fleet, "vm1")
    assert guest.calls == ["undefine"] and not (d / "intent.json").exists()
    assert suspend.find_suspended(fleet, "vm1") is not None


def test_a_stopped_vms_parking_cut_short_is_finished_and_never_boots_it(tmp_path):
    guest = FakeGuest("vm1", "h1", state="shutoff")  # killed after the intent, before the record
    fleet = FakeFleet(tmp_path, FakeHost("h1", guest))
    d = cut_short_save(fleet, mode="stopped")
    assert "parking of its definition cut short was finished" in suspend.recover(fleet, "vm1")
    record = suspend.find_suspended(fleet, "vm1")
    assert record.mode == "stopped" and record.parked and record.image_bytes == 0
    assert guest.calls == ["undefine"] and (d / "domain.xml").exists()
    assert suspend.cut_short(fleet) == []


def test_a_stopped_vms_return_cut_short_is_finished_without_booting_it(tmp_path):
    defined = FakeGuest("vm1", "h2", state="shutoff")  # defined on h2, the claim still there
    h2 = FakeHost("h2", defined)
    fleet = FakeFleet(tmp_path, FakeHost("h1"), h2)
    d = claimed(fleet)
    record = json.loads((d / "claim.json").read_text()) | {"mode": "stopped", "parked": True}
    (d / "claim.json").write_text(json.dumps(record))
    assert "on h2: finished" in suspend.recover(fleet, "vm1")
    assert defined.calls == [] and defined.state() == "shutoff"  # a stopped VM stays stopped
    assert not d.exists()


def test_a_host_that_does_not_answer_postpones_the_decision(tmp_path):
    fleet = FakeFleet(tmp_path, FakeHost("h1", answers=False))
    d = cut_short_save(fleet, image=DONE)
    with pytest.raises(HostUnreachable):
        suspend.recover(fleet, "vm1")
    assert (d / "intent.json").exists() and (d / "image.partial").exists()


def claimed(fleet) -> Path:
    d = fleet.paths.saves / "vm1"
    d.mkdir(parents=True)
    (d / "domain.xml").write_text(DOMAIN)
    (d / "image").write_bytes(DONE)
    (d / "record.json").write_text(json.dumps({
        "vm": "vm1", "from_host": "h1", "memory_mib": 512, "vcpus": 1,
        "suspended_at": time.time(), "save_ms": 900, "image_bytes": 16}))
    suspend._claim(d, "vm1")
    return d


def test_only_one_of_two_resumes_claims_the_image(tmp_path):
    fleet = FakeFleet(tmp_path)
    d = claimed(fleet)
    with pytest.raises(Conflict, match="being resumed by another request"):
        suspend._claim(d, "vm1")
    assert (d / "claim.json").exists() and not (d / "record.json").exists()


def test_a_resume_cut_short_before_the_restore_is_suspended_again(tmp_path):
    fleet = FakeFleet(tmp_path, FakeHost("h1"), FakeHost("h2"))
    d = claimed(fleet)
    assert "had not restored it: suspended again" in suspend.recover(fleet, "vm1")
    assert (d / "record.json").exists() and (d / "image").exists()
    assert suspend.find_suspended(fleet, "vm1") is not None
    assert fleet.state.save_of("vm1")["state"] == "saved"


def test_a_resume_cut_short_after_the_restore_is_finished_where_the_vm_runs(tmp_path):
    running = FakeGuest("vm1", "h2", persistent=False)  # restored, not yet defined
    h2 = FakeHost("h2", running)
    fleet = FakeFleet(tmp_path, FakeHost("h1"), h2)
    d = claimed(fleet)
    assert "restored it on h2: finished" in suspend.recover(fleet, "vm1")
    assert not d.exists() and fleet.routes == [("10.78.0.5", "h2")]
    fleet.state.put_save("vm1", {"state": "claimed"})  # a copy left behind: forgotten too
    suspend.recover(fleet, "vm1")
    assert fleet.state.save_of("vm1") is None
    [xml] = h2.defined  # defined for good, its console where the restored VM writes it
    assert "vm1.3.h2.log" in xml


def test_a_resume_cut_short_is_not_decided_while_a_host_does_not_answer(tmp_path):
    fleet = FakeFleet(tmp_path, FakeHost("h1"), FakeHost("h2", answers=False),
                      FakeHost("h3", answers=False, state="reclaimed"))
    d = claimed(fleet)
    with pytest.raises(HostUnreachable, match="it may hold vm1"):
        suspend.recover(fleet, "vm1")
    assert (d / "claim.json").exists()  # h2 may be running it: the image is not handed out


def test_a_reclaimed_host_that_does_not_answer_holds_nothing(tmp_path):
    fleet = FakeFleet(tmp_path, FakeHost("h1"), FakeHost("h3", answers=False, state="reclaimed"))
    assert fleet.find_all("vm1", strict=True) == []


def test_only_the_hosts_named_are_asked_and_a_silent_one_outside_them_decides_nothing(tmp_path):
    held = FakeHost("h1", FakeGuest("vm1", "h1"))
    fleet = FakeFleet(tmp_path, held, FakeHost("h2", answers=False))
    assert fleet.find_all("vm1", strict=True, among=["h1"]) == [held.guest]
    assert fleet.find_all("vm1", strict=True, among=[]) == []
    with pytest.raises(HostUnreachable, match="h2 does not answer"):
        fleet.find_all("vm1", strict=True, among=["h1", "h2"])


def test_a_vm_is_unknown_only_when_every_host_answered(tmp_path):
    """CI: a migrate that could not reach host1 called the VM there 'unknown'."""
    held = FakeHost("h1", FakeGuest("vm1", "h1"))
    assert FakeFleet(tmp_path, held, FakeHost("h2", answers=False)).locate("vm1") is held.guest
    with pytest.raises(HostUnreachable, match="h2 does not answer; it may hold vm1"):
        FakeFleet(tmp_path, FakeHost("h1"), FakeHost("h2", answers=False)).locate("vm1")
    with pytest.raises(NotFound, match="unknown VM 'vm1'"):
        FakeFleet(tmp_path, FakeHost("h1"), FakeHost("h2")).locate("vm1")


def _failing_move(tmp_path, mocker, error: Exception):
    """A migration from h1 to h2 whose libvirt call raises `error` while the VM runs on h1:
    the guest, the fleet, the target's console segment and the mocked drop of it."""
    from vmmgr.migration import _Migration
    from vmmgr.policy import get_policy

    guest = mocker.Mock(host_name="h1")
    guest.name = "vm1"
    guest.xml.return_value = DOMAIN
    guest.migrate_to.side_effect = error
    guest.is_active.return_value = True
    guest.state.return_value = "running"
    guest.job_stats.return_value = {"type": 0}
    fleet = mocker.Mock()
    fleet.host.return_value.connection_apart.side_effect = nullcontext
    fleet.state.cancel_asked.return_value = False
    segment = tmp_path / "vm1@000002-h2.log"
    mocker.patch("vmmgr.site_consoles.new_segment", return_value=segment)
    dropped = mocker.patch("vmmgr.site_consoles.drop_if_empty")
    fleet.host.return_value.record.tls = True
    fleet.host.return_value.uri = "qemu+tls://10.0.0.2/system"

    def migration():
        return _Migration(fleet, guest, "h2", get_policy(None), None, 0.01,
                          mocker.Mock(lost=False))
    return guest, fleet, segment, dropped, migration


def test_any_exception_in_libvirts_migration_call_is_a_failure_not_a_success(tmp_path, mocker):
    """Before: an OverflowError from the migration thread (bandwidth 2**70) was taken for a
    success, and the VM's address was routed to the target while the VM stayed on the source."""
    from vmmgr.errors import MigrationFailed

    _, fleet, segment, dropped, migration = _failing_move(
        tmp_path, mocker, OverflowError("Python int too large to convert to C long"))
    fleet.host.return_value.find_guest.return_value = None  # the target holds no copy
    migration = migration()
    with pytest.raises(MigrationFailed, match="OverflowError.*still running on h1"):
        migration.run()
    fleet.route_address.assert_not_called()
    dropped.assert_called_once_with(fleet, "vm1", segment)  # the failure's path, to its end
    fleet.host.return_value.find_guest.assert_called_once()  # only to know it is not there


def test_a_failed_moves_segment_stays_while_the_target_may_run_the_vm(tmp_path, mocker):
    """The source's call failed, but the target runs the VM (the failure came after its
    switch-over, or the target cannot say): the segment there is its console from now on."""
    from vmmgr.errors import HostUnreachable, MigrationFailed

    guest, fleet, segment, dropped, migration = _failing_move(tmp_path, mocker,
                                                              OverflowError("late"))
    running = mocker.Mock(**{"is_active.return_value": True, "console_path.return_value": segment})
    # libvirt keeps the definition it persisted on the target before a late failure: stopped,
    # it would write the segment once started
    kept = mocker.Mock(**{"is_active.return_value": False, "console_path.return_value": segment})
    for there in (running, kept, HostUnreachable("h2 does not answer")):
        fleet.host.return_value.find_guest.side_effect = [there] if isinstance(
            there, Exception) else None
        fleet.host.return_value.find_guest.return_value = there
        with pytest.raises(MigrationFailed):
            migration().run()
    # the source still migrating (our connection broke, not the peer-to-peer migration)
    fleet.host.return_value.find_guest.side_effect = None
    fleet.host.return_value.find_guest.return_value = None
    guest.job_stats.return_value = {"type": libvirt.VIR_DOMAIN_JOB_UNBOUNDED}
    moving = migration()
    mocker.patch.object(moving, "_in_postcopy", return_value=False)
    with pytest.raises(MigrationFailed):
        moving._fail(OverflowError("late"), segment)
    dropped.assert_not_called()


def test_a_bandwidth_libvirt_cannot_take_is_refused_before_anything_starts():
    from vmmgr.errors import InvalidRequest
    from vmmgr.policy import MAX_BANDWIDTH_MIBPS, get_policy

    assert get_policy(None, MAX_BANDWIDTH_MIBPS).bandwidth_mibps == MAX_BANDWIDTH_MIBPS
    with pytest.raises(InvalidRequest, match="bandwidth must be at most"):
        get_policy(None, 2 ** 70)


def test_a_migration_left_running_by_a_killed_run_is_steered_by_its_policy(tmp_path, mocker):
    """Before: a rerun that found its predecessor's migration still running in libvirt waited
    up to 600 s for it, whatever the policy's timeouts. Now it steers the job: "safe" gives up
    at 300 s counted from when the job began, so a job 310 s old is aborted at once."""
    from vmmgr.migration import _Migration
    from vmmgr.policy import get_policy

    job = {"type": 2, "time_elapsed": 310_000, "data_total": 200 * 2 ** 20,
           "data_remaining": 150 * 2 ** 20, "memory_iteration": 3}
    guest = mocker.Mock(host_name="h1")
    guest.name = "vm1"
    guest.job_stats.side_effect = lambda completed=False: (
        {"type": 0} if guest.abort_job.called else job)
    guest.xml.return_value = DOMAIN
    lease = mocker.Mock(lost=False)
    migration = _Migration(mocker.Mock(), guest, "h2", get_policy("safe"), None, 0.01, lease)
    assert migration.adopt() == "completion timeout (300 s)"
    guest.abort_job.assert_called_once()
    assert any("earlier run left running (310 s in)" in e for e in migration.events)


def test_a_migration_left_running_within_its_limits_is_left_to_finish(tmp_path, mocker):
    from vmmgr.migration import _Migration
    from vmmgr.policy import get_policy

    polls = iter([{"type": 2, "time_elapsed": 5_000, "data_total": 2 ** 27,
                   "data_remaining": 2 ** 26, "memory_iteration": 1}] * 3 + [{"type": 0}] * 9)
    guest = mocker.Mock(host_name="h1")
    guest.name = "vm1"
    guest.job_stats.side_effect = lambda completed=False: next(polls)
    guest.xml.return_value = DOMAIN
    seen = []
    migration = _Migration(mocker.Mock(), guest, "h2", get_policy("safe"), seen.append, 0.01,
                           mocker.Mock(lost=False))
    assert migration.adopt() is None
    guest.abort_job.assert_not_called()
    assert seen and seen[0].remaining_bytes == 2 ** 26  # its progress reported as it went


def test_a_save_whose_answer_was_lost_keeps_its_intent_for_recovery(tmp_path, mocker):
    """The save call failing is not the save failing: with the connection gone, libvirt may be
    finishing it. Only a guest seen running with no job is a save that failed."""
    from vmmgr.errors import HostUnreachable

    guest = FakeGuest("vm1", "h1")
    guest.xml = lambda **kw: DOMAIN
    guest.live_migratable = lambda: (True, "")
    guest.memory_mib, guest.vcpus = lambda: 256, lambda: 1
    guest.device_needs = lambda: ("", 0)

    def lost(path, via=None):
        guest.job = True  # libvirt goes on saving
        raise HostUnreachable("connection to h1 lost")

    guest.save = lost
    fleet = FakeFleet(tmp_path, FakeHost("h1", guest))
    fleet.locate = lambda vm: guest
    fleet.lock_vm = mocker.MagicMock()
    with pytest.raises(HostUnreachable):
        suspend._suspend(fleet, "vm1", parked=False, mode="save")
    assert suspend.cut_short(fleet) == ["vm1"]  # the intent stays for `recover`

    guest.job = False
    guest.save = mocker.Mock(side_effect=HostUnreachable("refused"))
    fleet.paths.saves = tmp_path / "saves2"
    with pytest.raises(HostUnreachable):
        suspend._suspend(fleet, "vm1", parked=False, mode="save")
    assert suspend.cut_short(fleet) == [] and not (tmp_path / "saves2" / "vm1").exists()


def test_a_scan_opens_the_hosts_connections_side_by_side():
    """find_all opens the connections not yet open at once, each in its own thread: the scan
    waits for the slowest handshake, not their sum; one that fails is left to the scan."""
    import threading

    from vmmgr.fleet import connect_all

    together, barrier = [], threading.Barrier(3, timeout=5)

    class Closed:
        connected = False

        def __init__(self, fails=False):
            self.fails = fails

        @property
        def conn(self):
            barrier.wait()  # returns only once all three are opening at the same time
            together.append(self)
            if self.fails:
                raise HostUnreachable("no answer")
            return object()

    class Open:
        connected = True

        @property
        def conn(self):
            raise AssertionError("an open connection is not opened again")

    hosts = [Closed(), Closed(fails=True), Closed()]
    connect_all([*hosts, Open()])  # the failure is not raised here
    assert sorted(map(id, together)) == sorted(map(id, hosts))


def _switching_migration(tmp_path, mocker, domain_xml):
    """A _Migration of vm1 from h1 to h2 over mocks, and the lifecycle callbacks it registers,
    by host name: a test calls them in place of libvirt's events."""
    from vmmgr.migration import _Migration
    from vmmgr.policy import get_policy

    guest = mocker.Mock(host_name="h1")
    guest.name = "vm1"
    guest.xml.return_value = domain_xml
    guest.is_active.return_value = True
    guest.state.return_value = "running"
    guest.job_stats.return_value = {"type": 0}
    hosts, callbacks = {}, {}

    def host(name):
        if name not in hosts:
            h = mocker.Mock(record=SimpleNamespace(tls=True, lab=False),
                            uri=f"qemu+tls://{name}/system")
            h.watch_lifecycle.side_effect = lambda vm, cb, name=name: callbacks.setdefault(
                name, cb) and 1
            h.connection_apart.side_effect = nullcontext
            hosts[name] = h
        return hosts[name]

    fleet = mocker.Mock()
    mocker.patch("vmmgr.site_consoles.new_segment", return_value=tmp_path / "vm1@000002-h2.log")
    fleet.host.side_effect = host
    fleet.state.cancel_asked.return_value = False
    migration = _Migration(fleet, guest, "h2", get_policy(None), None, 0.01,
                           mocker.Mock(lost=False))
    return migration, guest, fleet, callbacks


def test_an_address_moved_at_the_pause_goes_back_when_the_switch_over_fails(tmp_path, mocker):
    """The address moves to the target as the source pauses for the switch-over; a switch-over
    that then fails leaves the VM running on its source, and the address goes back there."""
    import libvirt

    from vmmgr.errors import MigrationFailed

    migration, guest, fleet, callbacks = _switching_migration(tmp_path, mocker, DOMAIN)

    def paused_then_failed(*args, **kwargs):
        callbacks["h1"](libvirt.VIR_DOMAIN_EVENT_SUSPENDED,
                        libvirt.VIR_DOMAIN_EVENT_SUSPENDED_MIGRATED)
        raise libvirt.libvirtError("operation failed: job 'migration out' failed in post-copy "
                                   "phase")

    guest.migrate_to.side_effect = paused_then_failed
    with pytest.raises(MigrationFailed, match="still running on h1"):
        migration.run()
    assert fleet.route_address.call_args_list == [
        mocker.call("10.78.0.5", "h2"), mocker.call("10.78.0.5", "h1")]
    assert any("as the source paused for the switch-over" in e for e in migration.events)


def test_a_switch_over_event_after_the_call_ended_routes_nothing(tmp_path, mocker):
    """An event still in flight when libvirt's call has failed must not take the address to a
    target the VM never reached."""
    import libvirt

    from vmmgr.errors import MigrationFailed

    migration, guest, fleet, callbacks = _switching_migration(tmp_path, mocker, DOMAIN)
    guest.migrate_to.side_effect = libvirt.libvirtError("unable to connect")
    with pytest.raises(MigrationFailed, match="still running on h1"):
        migration.run()
    callbacks["h2"](libvirt.VIR_DOMAIN_EVENT_RESUMED, 0)  # late
    callbacks["h1"](libvirt.VIR_DOMAIN_EVENT_SUSPENDED, libvirt.VIR_DOMAIN_EVENT_SUSPENDED_MIGRATED)
    fleet.route_address.assert_not_called()


LOCAL = ("<domain><name>vm1</name><devices><disk type='file' device='disk'><source file='"
         "/var/lib/libvirt/vmmgr-disks/vm1.qcow2'/><target dev='vda'/></disk></devices></domain>")


def test_a_save_whose_local_disk_cannot_be_kept_stays_whole_for_recover(tmp_path, mocker):
    """Found in review: the image took its name before the disk was kept, so a keep that failed
    (storage full, the worker killed) left `recover` no image.partial: it booted the VM afresh
    and deleted the complete save. Now the image keeps its partial name until the disk is kept,
    and recover finishes the suspend from it (keeping the disk then)."""
    from vmmgr import local_disks
    guest = FakeGuest("vm1", "h1", state="shutoff")  # libvirt's save completed
    guest.connection = lambda: "conn"
    fleet = FakeFleet(tmp_path, FakeHost("h1", guest))
    d = cut_short_save(fleet, image=DONE)
    (d / "domain.xml").write_text(LOCAL.replace("</devices>", (  # its seed in the pool
        "<disk type='file' device='disk'><source file='/var/lib/libvirt/vmmgr-disks/"
        "vm1-seed.iso'/><target dev='vdb'/><readonly/></disk></devices>")))
    keep = mocker.patch.object(local_disks, "save_to", side_effect=OSError(28, "No space left"))
    with pytest.raises(OSError):
        suspend._saved(d, guest, 900)
    assert (d / "image.partial").is_file() and not (d / "image").exists()
    keep.side_effect = lambda conn, vm, file, name="": file.name + name
    removed = mocker.patch.object(local_disks, "remove", return_value=True)
    words = suspend.recover(fleet, "vm1")
    assert "had completed" in words and "start" not in guest.calls
    assert (d / "image").is_file() and (d / "record.json").is_file()
    # the disk and its seed kept beside the save, each with its sum
    assert json.loads((d / "disk.json").read_text()) == {
        "sha256": "disk.qcow2", "seed_sha256": "seed.isovm1-seed.iso"}
    assert guest.calls == ["undefine"] and removed.call_args.args == ("conn", "vm1")


def test_a_renamed_complete_image_is_a_finished_save_to_recover(tmp_path):
    guest = FakeGuest("vm1", "h1", state="shutoff")
    fleet = FakeFleet(tmp_path, FakeHost("h1", guest))
    d = cut_short_save(fleet, image=DONE)
    (d / "image.partial").rename(d / "image")
    assert "had completed" in suspend.recover(fleet, "vm1")
    assert "start" not in guest.calls and (d / "record.json").is_file()


def test_a_local_disk_is_never_removed_where_its_vm_is_defined(mocker):
    from vmmgr import local_disks
    from vmmgr.errors import VmmgrError
    conn = mocker.Mock()
    with pytest.raises(VmmgrError, match="defined on this host"):
        local_disks.remove(conn, "vm1")
    conn.storagePoolLookupByName.assert_not_called()  # not even looked for


def test_a_restore_that_cannot_open_its_own_connection_says_it_never_started(mocker):
    """HostUnreachable from a restore means "it may have restored" (the claim stays for
    `recover`); a connection that never opened asked nothing of libvirt, so the resume may
    undo at once."""
    from pathlib import Path

    from vmmgr.errors import HostUnreachable, VmmgrError
    from vmmgr.host import Host

    host = Host.__new__(Host)
    host.record = SimpleNamespace(name="h1")
    mocker.patch.object(Host, "_connect", side_effect=HostUnreachable("h1 does not answer"))
    with pytest.raises(VmmgrError) as raised:
        host.restore(Path("/storage/saves/vm1/image"), "<domain/>")
    assert not isinstance(raised.value, HostUnreachable)
    assert "not started" in str(raised.value) and "h1 does not answer" in str(raised.value)


def test_a_restore_runs_on_its_own_connection_and_closes_it(mocker):
    from pathlib import Path

    from vmmgr.host import Host

    host = Host.__new__(Host)
    host.record = SimpleNamespace(name="h1")
    own = mocker.Mock()
    mocker.patch.object(Host, "_connect", return_value=own)
    host.restore(Path("/storage/saves/vm1/image"), "<domain/>")
    own.restoreFlags.assert_called_once()
    assert own.restoreFlags.call_args.args[:2] == ("/storage/saves/vm1/image", "<domain/>")
    own.close.assert_called_once()


def test_a_resume_that_has_happened_waits_for_the_store_to_route_its_address(tmp_path, mocker):
    """Found on the lab (Redis SIGKILLed mid-resume): the VM ran on its target, but routing its
    address met the store down and the task answered FAILURE. What has happened is recorded
    once the store is back (`stored`), and the resume ends well."""
    import redis
    d = tmp_path / "vm1"
    d.mkdir()
    (d / "domain.xml").write_text("<domain><name>vm1</name></domain>")
    fleet, host = mocker.Mock(), mocker.Mock()
    host.name = "h2"
    fleet.route_address.side_effect = [redis.ConnectionError("refused"), None]
    slept = mocker.patch("vmmgr.state.time.sleep")
    lease = mocker.Mock(lost=False)
    suspend._resumed_on(fleet, host, d, None, lease)
    assert fleet.route_address.call_count == 2 and slept.called
    assert not d.exists()  # its save is gone: it runs there
    lease.confirm.assert_called_once()


def test_a_resume_whose_lock_lapsed_while_the_store_was_away_leaves_its_save_to_recover(
        tmp_path, mocker):
    """The review's finding: a store away longer than the lease lets another take the VM (the
    reconcile's `recover`, a redelivered rerun) once it is back; this run must then not remove
    a save folder that is no longer its own to remove."""
    from vmmgr.locks import Lease, LockLost
    d = tmp_path / "vm1"
    d.mkdir()
    (d / "domain.xml").write_text("<domain><name>vm1</name></domain>")
    state = mocker.Mock()
    state.refresh.return_value = False  # expired meanwhile, or another's now
    lease = Lease(state, "vm", "vm1", "worker-a/task", "resume of vm1")
    host = mocker.Mock()
    host.name = "h2"
    with pytest.raises(LockLost):
        suspend._resumed_on(mocker.Mock(), host, d, None, lease)
    assert (d / "domain.xml").is_file()  # left for the lock's holder to finish
    state.refresh.assert_called_once_with("vm", "vm1", "worker-a/task", lease.ttl)
