"""A move's hold at the edge (`_Migration._hold`, `_release`, `_switch_over`): every hold is
let go exactly once, a failed release is tried again, a failed hold hands the moment back to
QEMU. The edge and the guest are stand-ins; the lab test (test_network) runs the real ones."""

import threading

import libvirt
import pytest

from vmmgr.errors import Conflict, VmmgrError
from vmmgr.migration import _Migration


class FakeEdge:
    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    def hold(self, ip):
        self.calls.append(("hold", ip))
        if "hold" in self.fail:
            raise VmmgrError("edge: no answer")

    def release(self, ip):
        self.calls.append(("release", ip))
        if "release" in self.fail:
            raise VmmgrError("edge: no answer")


class FakeGuest:
    def __init__(self, pause_error=None):
        self.pause_error, self.paused = pause_error, False

    def pause(self):
        if self.pause_error:
            raise self.pause_error
        self.paused = True


def move(edge, guest=None):
    m = _Migration.__new__(_Migration)
    m.hold_edge, m.guest, m.address = edge, guest or FakeGuest(), "10.78.0.2"
    m.source, m.target, m.events = "host1", "host2", []
    m.held = m.source_paused = m.routing_over = m.routed = m.paused = m.hold_failed = False
    m.paused_at = m.query = None
    m.routing, m.hold_lock = threading.Lock(), threading.Lock()
    m._route_to_target = lambda address, why: setattr(m, "routed", True)
    return m


def test_a_hold_is_released_once_whoever_asks():
    edge = FakeEdge()
    m = move(edge)
    m._hold("pass 1 ends in about 15 ms")
    m._release("to the target at resume")
    m._release("as the move ended")  # the run's end: nothing left to let go
    assert edge.calls == [("hold", "10.78.0.2"), ("release", "10.78.0.2")] and not m.held
    assert "packets held for 10.78.0.2 released to the target at resume" in m.events


def test_no_hold_once_the_source_paused_or_the_move_ended():
    edge = FakeEdge()
    m = move(edge)
    m.source_paused = True  # QEMU paused it first: a hold now would only delay
    assert m._hold("late") is None
    m.source_paused, m.routing_over = False, True
    assert m._hold("later") is None and edge.calls == []


def test_a_failed_release_keeps_the_hold_for_the_next_try():
    edge = FakeEdge(fail={"release"})
    m = move(edge)
    m._hold("soon")
    m._release("to the target at resume")
    assert m.held and any(e.startswith("could not release 10.78.0.2 at the edge") for e in m.events)
    edge.fail.clear()
    m._release("as the move ended")
    assert not m.held and edge.calls[-1] == ("release", "10.78.0.2")


def test_a_failed_hold_hands_the_moment_to_qemu_and_undoes_what_it_may_have_made():
    edge = FakeEdge(fail={"hold"})
    m = move(edge)
    assert "could not hold 10.78.0.2" in m._hold("soon")
    assert m.hold_failed and not m.held
    assert edge.calls == [("hold", "10.78.0.2"), ("release", "10.78.0.2")]


def test_vmmgrs_own_pause_routes_to_the_target_and_a_failed_one_changes_nothing():
    m = move(FakeEdge())
    assert m._switch_over("about 41 ms") is None  # nothing held: QEMU chooses
    m._hold("soon")
    assert "VM paused on host1 for the switch-over" in m._switch_over("about 41 ms")
    assert m.paused and m.source_paused and m.routed and m.paused_at is not None
    m = move(FakeEdge(), FakeGuest(pause_error=VmmgrError("domain is not running")))
    m._hold("soon")
    with pytest.raises(VmmgrError):
        m._switch_over("about 41 ms")
    assert not m.paused and m.paused_at is None and not m.routed and m.held


# ---- the reconcile lets go of holds no move will release ---------------------------------

class HeldEdge:
    can_hold = True

    def __init__(self, held, fail=()):
        self.holding, self.fail, self.released = list(held), set(fail), []

    def held(self):
        if "held" in self.fail:
            raise VmmgrError("edge: vmhold: no such device")
        return list(self.holding)

    def release(self, ip):
        if ip in self.fail:
            raise VmmgrError("edge: no answer")
        self.released.append(ip)
        self.holding.remove(ip)


class Events:
    def __init__(self):
        self.seen = []

    def event(self, message, vm="", host="", kind="info"):
        self.seen.append((message, vm))


def reconcile_with(mocker, redis_url, edge, owners):
    from vmmgr import reconcile
    from vmmgr.state import FleetState

    from vmmgr.locks import Lease

    fleet = mocker.Mock(state=FleetState(redis_url))
    fleet.lock_vm = lambda vm, what: Lease(fleet.state, "vm", vm, "reconcile:1", what)
    mocker.patch.object(reconcile.Edge, "load", return_value=edge)
    mocker.patch.object(reconcile, "pool_for", return_value=mocker.Mock(
        in_use=lambda: owners))
    report = Events()
    return reconcile.release_stale_holds, fleet, report


def test_the_reconcile_releases_holds_whose_vm_no_one_locks_and_leaves_a_moving_one(
        mocker, redis_url):
    from vmmgr.locks import Lease

    edge = HeldEdge(["10.78.0.2", "10.78.0.3", "10.78.0.9"], fail={"10.78.0.9"})
    release, fleet, report = reconcile_with(
        mocker, redis_url, edge, {"10.78.0.2": "vm2", "10.78.0.3": "vm3", "10.78.0.9": "vm9"})
    with Lease(fleet.state, "vm", "vm3", "node-a:1", "migration of vm3 to host2"):
        assert release(fleet, report) == ["10.78.0.2"]  # vm3 moves; 10.78.0.9 failed: next pass
    assert edge.holding == ["10.78.0.3", "10.78.0.9"]
    assert report.seen == [("packets held at the edge for 10.78.0.2 released (no move under "
                            "way)", "vm2")]
    edge.fail.clear()
    assert release(fleet, report) == ["10.78.0.3", "10.78.0.9"] and edge.holding == []


def test_the_reconcile_releases_under_the_vms_lock_so_a_move_cannot_start_meanwhile(
        mocker, redis_url):
    from vmmgr.locks import Lease

    edge = HeldEdge(["10.78.0.2", "10.78.0.7"])
    release, fleet, report = reconcile_with(mocker, redis_url, edge, {"10.78.0.2": "vm2"})
    holders = []
    real_release = edge.release

    def release_and_look(ip):
        holders.append((ip, fleet.state.holder("vm", "vm2")))
        if ip == "10.78.0.2":
            with pytest.raises(Conflict):  # a move that starts now is refused until we are done
                with Lease(fleet.state, "vm", "vm2", "node-a:1", "migration of vm2 to host2"):
                    pass
        real_release(ip)

    edge.release = release_and_look
    assert release(fleet, report) == ["10.78.0.2", "10.78.0.7"]
    assert holders[0][0] == "10.78.0.2" and holders[0][1].startswith("reconcile:1 ")
    assert holders[1] == ("10.78.0.7", None)  # an address no VM owns: nothing to lock
    assert fleet.state.holder("vm", "vm2") is None  # given back


def test_an_edge_that_cannot_say_what_it_holds_does_not_stop_the_pass(mocker, redis_url):
    edge = HeldEdge(["10.78.0.2"], fail={"held"})
    release, fleet, report = reconcile_with(mocker, redis_url, edge, {"10.78.0.2": "vm2"})
    assert release(fleet, report) == [] and edge.released == []
    assert report.seen[0][0].startswith("could not ask the edge what it holds")


# ---- the reconcile records again an address the store lost -------------------------------

def test_the_reconcile_records_again_the_address_a_vm_carries_and_names_a_clash(
        mocker, redis_url, tmp_path, monkeypatch):
    import redis

    from vmmgr import reconcile
    from vmmgr.addresses import KEY, NetworkConfig
    from vmmgr.locks import Lease
    from vmmgr.paths import Paths
    from vmmgr.render import XMLNS
    from vmmgr.state import FleetState

    def definition(ip):
        return (f"<domain><metadata><v:vm xmlns:v='{XMLNS}'><v:address>{ip}</v:address></v:vm>"
                "</metadata></domain>")

    monkeypatch.setenv("VMMGR_REDIS_URL", redis_url)
    paths = Paths(tmp_path)
    NetworkConfig("10.78.0.0/24", "10.78.0.1").save(paths)
    (paths.saves / "parked").mkdir(parents=True)
    (paths.saves / "parked" / "domain.xml").write_text(definition("10.78.0.4"))
    (paths.saves / "cutshort").mkdir()
    (paths.saves / "cutshort" / "domain.xml").write_text("<domain><meta")  # a save cut short
    fleet = mocker.Mock(state=FleetState(redis_url), paths=paths)
    fleet.lock_vm = lambda vm, what: Lease(fleet.state, "vm", vm, "reconcile:1", what)
    defined = {"run1": "10.78.0.2", "run2": "10.78.0.3", "busy": "10.78.0.6",
               "clash": "10.78.0.9", "recreated": "10.78.0.12", "two": "10.78.0.20"}
    fleet.find = lambda vm: (mocker.Mock(xml=lambda inactive: definition(defined[vm]))
                             if vm in defined else None)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    r.hset(KEY, mapping={"10.78.0.2": "run1", "10.78.0.9": "other", "10.78.0.21": "two"})
    rows = [{"name": "run1", "address": "10.78.0.2"},   # recorded: nothing to do
            {"name": "run2", "address": "10.78.0.3"},   # lost: recorded again
            {"name": "parked", "address": "10.78.0.4"},  # a saved VM's too
            {"name": "gone", "address": "10.78.0.5"},   # destroyed since the rows were read
            {"name": "busy", "address": "10.78.0.6"},   # an operation holds it: next pass
            {"name": "clash", "address": "10.78.0.9"},  # another VM has it in the store
            {"name": "recreated", "address": "10.78.0.11"},  # its definition says .12 now
            {"name": "two", "address": "10.78.0.20"},   # holds .21 in the store: that stands
            {"name": "cutshort", "address": "10.78.0.30"},
            {"name": "outside", "address": "10.99.0.1"},  # not of the pool
            {"name": "plain", "address": ""}]
    report = Events()
    with Lease(fleet.state, "vm", "busy", "node-a:1", "migration of busy to host2"):
        assert reconcile.repair_addresses(fleet, report, rows) == ["run2", "parked"]
        assert reconcile.repair_addresses(fleet, report, rows) == []  # the clash: said once
    assert r.hgetall(KEY) == {"10.78.0.2": "run1", "10.78.0.3": "run2", "10.78.0.4": "parked",
                              "10.78.0.9": "other", "10.78.0.21": "two"}
    assert [m for m, _ in report.seen] == [
        "run2: its address 10.78.0.3 recorded again (the store had lost it)",
        "parked: its address 10.78.0.4 recorded again (the store had lost it)",
        "clash runs with 10.78.0.9, which the store gives to other: one of them must get "
        "another address (vm destroy and create it)"]
    assert fleet.state.holder("vm", "run2") is None  # every lock given back


def test_an_upgrades_clashing_address_file_is_reported_hourly_until_removed(
        mocker, redis_url, tmp_path, monkeypatch):
    import redis

    from vmmgr import reconcile
    from vmmgr.addresses import KEY, NetworkConfig
    from vmmgr.paths import Paths
    from vmmgr.state import FleetState

    monkeypatch.setenv("VMMGR_REDIS_URL", redis_url)
    paths = Paths(tmp_path)
    NetworkConfig("10.78.0.0/24", "10.78.0.1").save(paths)
    legacy = paths.storage / "addresses"
    legacy.mkdir(parents=True)
    (legacy / "10.78.0.7").write_text("old-vm\n")
    redis.Redis.from_url(redis_url, decode_responses=True).hset(KEY, "10.78.0.7", "new-vm")
    fleet = mocker.Mock(state=FleetState(redis_url), paths=paths)
    report = Events()
    assert reconcile.repair_addresses(fleet, report, []) == []  # the pool's import renames it
    assert reconcile.repair_addresses(fleet, report, []) == []  # within the hour: said once
    assert report.seen == [("storage/addresses/10.78.0.7.conflict: an older vmmgr gave "
                            "10.78.0.7 to old-vm, the store gives it to new-vm; one of them must "
                            "get another address, then remove the file", "old-vm")]
    (legacy / "10.78.0.7.conflict").unlink()
    fleet.state.r.delete("vmmgr:address-conflict:10.78.0.7")
    assert reconcile.repair_addresses(fleet, report, []) == [] and len(report.seen) == 1


# ---- a stalled switch-over given up: the target's copy goes only if it never ran ----------

class Copy:
    name = "vm2"

    def __init__(self, state="paused", active=True, job=libvirt.VIR_DOMAIN_JOB_UNBOUNDED,
                 postcopy=None):
        self.state_now, self.active, self.destroyed = state, active, False
        self.job, self.postcopy = job, postcopy

    def state(self):
        return self.state_now

    def job_stats(self):
        return {"type": self.job}

    def postcopy_phase(self):
        return self.postcopy

    def is_active(self):
        return self.active

    def destroy(self):
        self.destroyed = True


@pytest.mark.parametrize("source, there, destroyed", [
    (Copy("running"), Copy("paused"), True),  # libvirt resumed the source at the abort
    (Copy("paused"), Copy("paused"), False),  # sent whole: its target may yet start it
    # libvirt waits for the target's Finish, the move cancelled or failed: it will not start it
    (Copy("paused", job=libvirt.VIR_DOMAIN_JOB_CANCELLED), Copy("paused"), True),
    (Copy("paused", job=libvirt.VIR_DOMAIN_JOB_FAILED), Copy("paused"), True),
    (Copy("paused", job=libvirt.VIR_DOMAIN_JOB_COMPLETED), Copy("paused"), False),
    (Copy("running"), Copy("paused", postcopy="failed"), False),  # holds part of the VM
    (Copy("paused", postcopy="running", job=libvirt.VIR_DOMAIN_JOB_FAILED), Copy("paused"),
     False),  # the source in post-copy: the VM's memory split between the hosts
    (Copy("running"), Copy("running"), False),  # it ran on the target: never touched
    (Copy(active=False), Copy("paused"), False),  # the source holds nothing: kept
    (Copy("running"), None, False),
], ids=["source resumed", "source still paused", "source's job cancelled", "source's job failed",
        "source's job completed", "target in post-copy", "source in post-copy", "target runs", "source gone",
        "no target copy"])
def test_the_targets_copy_is_dropped_only_while_the_source_holds_the_vm(source, there,
                                                                        destroyed):
    m = move(FakeEdge(), source)
    m.dest = type("Dest", (), {"find_guest": lambda self, name: there})()
    event = m._drop_target("libvirt's call had not returned 10 s after the abort")
    assert (there is not None and there.destroyed) == destroyed
    assert ("never run, destroyed" in event) == destroyed and event in m.events


@pytest.mark.parametrize("routed_here", [True, False], ids=["by this run", "by an earlier run"])
def test_a_given_up_switch_over_sends_the_address_back_once_the_source_runs_again(routed_here):
    source = Copy("paused")
    m = move(FakeEdge(), source)
    routes = []
    m.fleet = type("Fleet", (), {"route_address": lambda self, ip, host: routes.append(host)})()
    m._hold("soon")
    m.routed = routed_here  # to host2, at the pause (an adopting run does not know)
    assert m._back_to_source() is None and m.held and routes == []  # still paused: not yet
    source.state_now = "running"  # libvirt resumed it at the abort
    assert "runs on host1 again" in m._back_to_source()
    assert routes == ["host1"] and not m.routed and not m.held and m.routing_over
    assert m._back_to_source() is None and routes == ["host1"]  # once


@pytest.mark.parametrize("source, destroyed", [
    (Copy("paused"), True),  # stuck sending the rest: its target cannot have the VM whole
    (Copy("running"), True),
    (Copy(active=False), False),
    (Copy("paused", postcopy="running"), False),
], ids=["source paused", "source running", "source gone", "source in post-copy"])
def test_a_source_stuck_sending_has_its_target_dropped_even_paused(source, destroyed):
    import threading
    m = move(FakeEdge(), source)
    unstuck = threading.Event()
    m.query = threading.Thread(target=unstuck.wait, daemon=True)  # the query still waits
    m.query.start()
    there = Copy("paused")
    m.dest = type("Dest", (), {"find_guest": lambda self, name: there})()
    m._drop_target("no answer for 10 s", stuck=True)
    assert there.destroyed == destroyed
    running = Copy("running")
    m.dest = type("Dest", (), {"find_guest": lambda self, name: running})()
    m._drop_target("no answer for 10 s", stuck=True)
    assert not running.destroyed  # a copy that runs: never
    unstuck.set()
    m.query.join()
    again = Copy("paused")
    m.dest = type("Dest", (), {"find_guest": lambda self, name: again})()
    m._drop_target("no answer for 10 s", stuck=True)
    assert again.destroyed == (destroyed and source.state_now == "running")  # it answers


def test_a_source_that_cannot_be_read_sends_nothing_back_yet():
    class Gone(Copy):
        def state(self):
            raise VmmgrError("domain not found")
    m = move(FakeEdge(), Gone("running"))
    assert m._back_to_source() is None and not m.routing_over


def test_a_query_that_does_not_answer_is_waited_for_once():
    import time as clock

    from vmmgr import migration
    m = move(FakeEdge())
    m.query = None
    asked = []

    class Slow:
        name = "vm2"

        def job_stats(self):
            asked.append(1)
            clock.sleep(0.5)
            return {"type": 2, "data_processed": 7}
    m.guest = Slow()
    assert m._query_within(0.05) is migration.NO_ANSWER
    assert m._query_within(0.05) is migration.NO_ANSWER and len(asked) == 1  # not asked twice
    assert m._query_within(1.0) == {"type": 2, "data_processed": 7}
    assert m.query is None
