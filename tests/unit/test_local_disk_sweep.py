"""The reconcile's sweep of stray local disks: a move whose target could not be reached when it
ended (the link cut, the target's libvirtd killed, while the disk was copied) leaves an overlay
there that nothing else removes. The sweep removes such a disk, under its VM's lock, only when
the VM's disk is whole elsewhere: on the one host that defines it, or kept beside its save.
Fake hosts answer as libvirt does; the locks are real (Redis)."""

import json
from types import SimpleNamespace

import pytest

from vmmgr import local_disks, reconcile
from vmmgr.errors import HostUnreachable, VmmgrError
from vmmgr.fleet import Fleet
from vmmgr.state import FleetState

DOMAIN = ("<domain><name>vm1</name><devices><disk type='file' device='disk'>"
          f"<source file='{local_disks.disk_path('vm1')}'/><target dev='vda'/></disk>"
          "</devices></domain>")


class Guest:
    def __init__(self, host_name):
        self.name, self.host_name = "vm1", host_name

    def xml(self, inactive=False):
        return DOMAIN


class Host:
    connected = True

    def __init__(self, name, defines=False, disk=False, answers=True):
        self.name, self.answers = name, answers
        self.conn = self  # what local_disks is handed: the fakes below read the host from it
        self.guest = Guest(name) if defines else None
        self.disks = {"vm1"} if disk else set()
        self.record = SimpleNamespace(state="active")

    def find_guest(self, vm):
        if not self.answers:
            raise HostUnreachable(f"host {self.name} does not answer")
        return self.guest if vm == "vm1" else None

    def guests(self):
        return [g for g in [self.find_guest("vm1")] if g]


class FakeFleet:
    find_all, lock_vm, tidy_local_disks = Fleet.find_all, Fleet.lock_vm, Fleet.tidy_local_disks
    _tidy_suspended_disks, _remove_local_disks = (Fleet._tidy_suspended_disks,
                                                  Fleet._remove_local_disks)
    disk_kept_with_save, is_saved_whole = Fleet.disk_kept_with_save, Fleet.is_saved_whole
    own_site, save_site, sees_save = Fleet.own_site, Fleet.save_site, Fleet.sees_save

    def sites(self):
        return {}  # a fleet that names no site

    def __init__(self, tmp_path, redis_url, *hosts):
        self.paths = SimpleNamespace(saves=tmp_path / "saves")
        self.state, self.owner = FleetState(redis_url), "reconcile-test"
        self._hosts = {h.name: h for h in hosts}

    def host(self, name):
        return self._hosts[name]

    def hosts(self):
        return list(self._hosts.values())


class Report:
    def __init__(self):
        self.events = []

    def event(self, message, **kw):
        self.events.append(message)


@pytest.fixture(autouse=True)
def host_disks(mocker):
    """local_disks over the fake hosts: a disk is a name in its host's set; removal refused
    where the host defines the VM, as libvirt's is."""
    def answer(host):
        if not host.answers:
            raise HostUnreachable(f"host {host.name} does not answer")

    def held(host):
        answer(host)
        return set(host.disks)

    def find(host, vm):
        answer(host)
        return vm if vm in host.disks else None

    def remove(host, vm):
        answer(host)
        if host.guest is not None:
            raise VmmgrError(f"{vm} is defined on this host: its local disk stays")
        had = vm in host.disks
        host.disks.discard(vm)
        return had

    mocker.patch.object(local_disks, "held", held)
    mocker.patch.object(local_disks, "find", find)
    mocker.patch.object(local_disks, "remove", remove)


def suspended_with_disk(fleet, *extra: str):
    d = fleet.paths.saves / "vm1"
    d.mkdir(parents=True)
    (d / "record.json").write_text(json.dumps({"vm": "vm1"}))
    (d / "disk.json").write_text(json.dumps({"sha256": "ab" * 32}))
    for name in extra:
        (d / name).write_text("{}")


def test_a_disk_left_on_a_target_the_move_could_not_reach_is_removed(tmp_path, redis_url):
    source, target = Host("h1", defines=True, disk=True), Host("h3", disk=True)
    fleet, report = FakeFleet(tmp_path, redis_url, source, target, Host("h2")), Report()
    assert reconcile.sweep_local_disks(fleet, report) == ["vm1@h3"]
    assert source.disks == {"vm1"} and target.disks == set()
    assert report.events == ["vm1: stray local disk removed from h3"]
    assert not fleet.state.holder("vm", "vm1")  # its lock given back
    assert reconcile.sweep_local_disks(fleet, report) == []  # nothing more on the next pass


def test_nothing_is_removed_while_an_operation_holds_the_vm(tmp_path, redis_url):
    target = Host("h3", disk=True)  # laid by the migration now under way
    fleet = FakeFleet(tmp_path, redis_url, Host("h1", defines=True, disk=True), target)
    fleet.state.acquire("vm", "vm1", "task-7", "migration of vm1 to h3", ttl=30)
    assert reconcile.sweep_local_disks(fleet, Report()) == []
    assert target.disks == {"vm1"}


@pytest.mark.parametrize("left", [("intent.json",), ("intent.json", "record.json"),
                                  ("intent.json", "record.json", "disk.json")])
def test_a_suspend_cut_short_keeps_the_disk_recover_needs(tmp_path, redis_url, left):
    # saved, and its disk maybe kept beside the save, but recover has yet to finish it
    host_copy = Host("h1", disk=True)
    fleet = FakeFleet(tmp_path, redis_url, host_copy, Host("h2"))
    d = fleet.paths.saves / "vm1"
    d.mkdir(parents=True)
    for name in left:
        (d / name).write_text("{}")
    assert reconcile.sweep_local_disks(fleet, Report()) == []
    assert host_copy.disks == {"vm1"}


def test_a_disk_being_loaded_by_a_resume_that_claimed_the_save_stays(tmp_path, redis_url):
    loading = Host("h2", disk=True)  # the claim took the record's place
    fleet = FakeFleet(tmp_path, redis_url, Host("h1"), loading)
    d = fleet.paths.saves / "vm1"
    d.mkdir(parents=True)
    (d / "claim.json").write_text("{}")
    (d / "disk.json").write_text("{}")
    assert reconcile.sweep_local_disks(fleet, Report()) == [] and loading.disks == {"vm1"}


def test_a_suspended_vm_without_its_disk_kept_keeps_its_host_copy(tmp_path, redis_url):
    only = Host("h2", disk=True)  # a save without disk.json: this copy is all there is
    fleet = FakeFleet(tmp_path, redis_url, Host("h1"), only)
    d = fleet.paths.saves / "vm1"
    d.mkdir(parents=True)
    (d / "record.json").write_text("{}")
    assert reconcile.sweep_local_disks(fleet, Report()) == [] and only.disks == {"vm1"}


def test_a_disk_is_never_removed_when_the_host_defining_the_vm_has_none(tmp_path, redis_url):
    other = Host("h3", disk=True)  # it may be the only copy there is
    fleet = FakeFleet(tmp_path, redis_url, Host("h1", defines=True), other)
    assert reconcile.sweep_local_disks(fleet, Report()) == [] and other.disks == {"vm1"}


def test_a_vm_defined_on_a_host_that_does_not_answer_keeps_every_disk(tmp_path, redis_url):
    # h1 defines it and answers; h2, silent, may define it too (a migration's other end)
    one, stray = Host("h1", defines=True, disk=True), Host("h3", disk=True)
    fleet = FakeFleet(tmp_path, redis_url, one, Host("h2", defines=True, answers=False), stray)
    assert reconcile.sweep_local_disks(fleet, Report()) == [] and stray.disks == {"vm1"}


def test_a_copy_a_resume_cut_short_loaded_goes_once_the_save_keeps_the_disk(tmp_path, redis_url):
    loaded = Host("h2", disk=True)
    fleet = FakeFleet(tmp_path, redis_url, Host("h1"), loaded)
    suspended_with_disk(fleet, "claim.json")  # the resume is still to be settled: kept
    assert reconcile.sweep_local_disks(fleet, Report()) == [] and loaded.disks == {"vm1"}
    (fleet.paths.saves / "vm1" / "claim.json").unlink()  # recover put the VM back to suspended
    assert reconcile.sweep_local_disks(fleet, Report()) == ["vm1@h2"]
    assert loaded.disks == set()


def test_a_suspended_vms_host_copy_stays_while_a_host_does_not_answer(tmp_path, redis_url):
    loaded = Host("h2", disk=True)
    fleet = FakeFleet(tmp_path, redis_url, Host("h1", answers=False), loaded)
    suspended_with_disk(fleet)
    assert reconcile.sweep_local_disks(fleet, Report()) == []  # h1 may run it
    assert loaded.disks == {"vm1"}


def test_a_disk_whose_vm_is_defined_nowhere_and_not_saved_is_left_alone(tmp_path, redis_url):
    # Neither a save nor a definition says the disk is a copy: it may be all there is of it.
    orphan = Host("h2", disk=True)
    fleet = FakeFleet(tmp_path, redis_url, Host("h1"), orphan)
    assert reconcile.sweep_local_disks(fleet, Report()) == [] and orphan.disks == {"vm1"}


def test_a_vm_defined_on_two_hosts_keeps_both_disks(tmp_path, redis_url):
    # a migration's two ends (its lock lapsed, libvirt still at it): not the sweep's to decide
    one, two = Host("h1", defines=True, disk=True), Host("h2", defines=True, disk=True)
    spare = Host("h3", disk=True)
    fleet = FakeFleet(tmp_path, redis_url, one, two, spare)
    assert reconcile.sweep_local_disks(fleet, Report()) == []
    assert one.disks == two.disks == spare.disks == {"vm1"}


def test_a_host_that_does_not_answer_holds_the_sweep_until_it_does(tmp_path, redis_url):
    away, stray = Host("h2", disk=True, answers=False), Host("h3", disk=True)
    fleet = FakeFleet(tmp_path, redis_url, Host("h1", defines=True, disk=True), away, stray)
    assert reconcile.sweep_local_disks(fleet, Report()) == []  # h2 may define it
    assert stray.disks == {"vm1"}
    away.answers = True
    assert sorted(reconcile.sweep_local_disks(fleet, Report())) == ["vm1@h2", "vm1@h3"]
    assert away.disks == stray.disks == set()


def test_a_reclaimed_host_that_does_not_answer_holds_nothing(tmp_path, redis_url):
    gone, stray = Host("h2", answers=False), Host("h3", disk=True)
    gone.record.state = "reclaimed"
    fleet = FakeFleet(tmp_path, redis_url, Host("h1", defines=True, disk=True), gone, stray)
    assert reconcile.sweep_local_disks(fleet, Report()) == ["vm1@h3"]


def test_a_lock_lost_mid_sweep_stops_it_before_the_next_removal(tmp_path, redis_url, mocker):
    from vmmgr.locks import Lease, LockLost
    a, b = Host("h2", disk=True), Host("h3", disk=True)
    fleet = FakeFleet(tmp_path, redis_url, Host("h1", defines=True, disk=True), a, b)
    mocker.patch.object(Lease, "check", side_effect=LockLost("lost"))
    assert reconcile.sweep_local_disks(fleet, Report()) == []
    assert a.disks == b.disks == {"vm1"}


def test_an_unexpected_error_is_said_and_the_pass_goes_on(tmp_path, redis_url, mocker):
    fleet = FakeFleet(tmp_path, redis_url, Host("h1", defines=True, disk=True),
                      Host("h3", disk=True))
    mocker.patch.object(FakeFleet, "tidy_local_disks", side_effect=OSError(116, "Stale handle"))
    report = Report()
    assert reconcile.sweep_local_disks(fleet, report) == []
    assert report.events == ["vm1: stray local disks not swept: [Errno 116] Stale handle"]

