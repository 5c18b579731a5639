"""One lock per VM in the fleet's store: shared by every node, renewed, nested for its owner,
and lost (and said to be lost) when the store takes it away."""

import threading
import time

import pytest

from vmmgr.errors import Conflict
from vmmgr.inventory import HostRecord, Inventory
from vmmgr import locks
from vmmgr.locks import HOUSEKEEPING, Lease, LockLost
from vmmgr.state import FleetState


@pytest.fixture
def store(redis_url):
    return FleetState(redis_url)


def test_a_second_owner_is_refused_with_the_holder_whatever_node_it_runs_on(store):
    # Two "nodes": two connections to the store, nothing local in common (the old flock lived
    # in each node's home and let both through).
    other_node = FleetState(store.url)
    with Lease(store, "vm", "vm1", "node-a:1", "migration of vm1 to host2"):
        with pytest.raises(Conflict, match="vm1.*busy.*migration of vm1 to host2"):
            with Lease(other_node, "vm", "vm1", "node-b:7", "resume of vm1"):
                pass
        with Lease(other_node, "vm", "vm2", "node-b:7", "destroy of vm2"):  # others are free
            pass
    with Lease(other_node, "vm", "vm1", "node-b:7", "destroy of vm1"):  # released afterwards
        pass


def test_the_lock_is_given_back_when_the_operation_fails(store):
    with pytest.raises(RuntimeError):
        with Lease(store, "vm", "vm1", "a", "x"):
            raise RuntimeError
    assert store.holder("vm", "vm1") is None


def test_the_owner_nests_and_only_the_outer_holder_gives_it_back(store):
    with Lease(store, "vm", "vm1", "task-1", "migration of vm1 to host2"):  # the task's run
        with Lease(store, "vm", "vm1", "task-1", "migration of vm1 to host2") as inner:
            assert inner.nested  # the operation's body
        assert store.holder("vm", "vm1") == "task-1 migration of vm1 to host2"
    assert store.holder("vm", "vm1") is None


def test_a_task_takes_over_the_lock_taken_in_its_name_and_gives_it_back(store):
    # Its submitter took it in the task's name (another process), or a dead earlier run of the
    # same task left it: this run holds it now, and nothing of it is left afterwards.
    store.acquire("vm", "vm1", "task-1", "migration of vm1", ttl=600)
    with Lease(store, "vm", "vm1", "task-1", "migration of vm1") as run:
        assert not run.nested
    assert store.holder("vm", "vm1") is None


def test_a_lease_is_renewed_while_it_is_held(store):
    with Lease(store, "vm", "vm1", "a", "slow work", ttl=1):
        time.sleep(2.5)  # more than twice its life
        assert store.holder("vm", "vm1") == "a slow work"
    assert store.holder("vm", "vm1") is None


def test_a_lease_taken_over_is_lost_and_stops_the_work(store):
    with Lease(store, "vm", "vm1", "a", "migration", ttl=1) as lease:
        store.r.set("vmmgr:lock:vm:vm1", "b resume")  # expired while a was cut off; b took it
        deadline = time.monotonic() + 3
        while not lease.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(LockLost, match="lock of migration was lost"):
            lease.check()
    assert store.holder("vm", "vm1") == "b resume"  # b's lock is not given back by a


def test_a_waiting_lease_gets_the_lock_when_it_frees(store):
    first = Lease(store, "edge", "routes", "a", "route change").__enter__()
    threading.Timer(0.3, first.__exit__, (None, None, None)).start()
    with Lease(store, "edge", "routes", "b", "route change", wait=5):
        assert store.holder("edge", "routes") == "b route change"


def test_a_request_waits_out_the_reconciles_brief_check_but_not_an_operation(store, monkeypatch):
    """A user's request that meets one of the reconcile's checks of the VM (a fraction of a
    second) gets the lock once it ends, instead of a "busy" it could not foresee; an operation
    still refuses at once, a check that lasts too long refuses in the end, and the reconcile
    itself never waits (it skips a held VM and comes back)."""
    check = Lease(store, "vm", "vm1", "reconcile-1", f"{HOUSEKEEPING}check of vm1's record")
    check.__enter__()
    threading.Timer(0.3, check.__exit__, (None, None, None)).start()
    t0 = time.monotonic()
    locks.acquire(store, "vm", "vm1", "task-1", "migration of vm1 to host2", 30)
    assert 0.2 < time.monotonic() - t0 < 5
    assert store.holder("vm", "vm1") == "task-1 migration of vm1 to host2"
    t0 = time.monotonic()
    with pytest.raises(Conflict, match="busy: migration of vm1"):  # an operation: at once
        with Lease(store, "vm", "vm1", "task-2", "resume of vm1"):
            pass
    assert time.monotonic() - t0 < 1
    store.release("vm", "vm1", "task-1")
    with Lease(store, "vm", "vm1", "reconcile-1", f"{HOUSEKEEPING}check of vm1's record"):
        t0 = time.monotonic()  # the reconcile meets a check (`host enable`'s): it skips the VM
        with pytest.raises(Conflict, match="busy: the reconcile's check"):
            with Lease(store, "vm", "vm1", "reconcile-2", f"{HOUSEKEEPING}sweep of vm1"):
                pass
        with pytest.raises(Conflict, match="busy: the reconcile's check"):  # told so
            with Lease(store, "vm", "vm1", "reconcile-2", "sweep of vm1's address",
                       patient=False):
                pass
        assert time.monotonic() - t0 < 1
    monkeypatch.setattr(locks, "HOUSEKEEPING_WAIT", 0.5)
    with Lease(store, "vm", "vm1", "reconcile-1", f"{HOUSEKEEPING}sweep of vm1's address"):
        t0 = time.monotonic()
        with pytest.raises(Conflict, match="busy: the reconcile's sweep of vm1's address"):
            locks.acquire(store, "vm", "vm1", "task-3", "destroy of vm1", 30)
        assert 0.4 < time.monotonic() - t0 < 3  # waited, then said what holds it


def test_a_holder_that_lets_go_between_the_two_reads_is_taken_over_not_a_crash(store, mocker):
    """The lock freed between the failed SET NX and the read of its holder (the moment a
    waiting request polls at): taken then, not an IndexError on an empty holder."""
    real_set = store.r.set
    calls = []

    def set_once_refused(*args, **kwargs):
        calls.append(args)
        return None if len(calls) == 1 else real_set(*args, **kwargs)
    mocker.patch.object(store.r, "set", side_effect=set_once_refused)
    store.acquire("vm", "vm1", "task-1", "migration of vm1", 30)  # GET finds none: SET again
    assert len(calls) == 2 and store.holder("vm", "vm1") == "task-1 migration of vm1"


def test_concurrent_state_changes_of_two_hosts_lose_nothing(store):
    inv = Inventory(store.r)
    inv.add(HostRecord("h1", "qemu+tls://h1/system"))
    inv.add(HostRecord("h2", "qemu+tls://h2/system"))
    errors = []

    def flip(name, states):
        try:
            for s in states:
                Inventory(FleetState(store.url).r).set_state(name, s)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    for _ in range(20):
        a = threading.Thread(target=flip, args=("h1", ["draining", "reclaimed"]))
        b = threading.Thread(target=flip, args=("h2", ["draining", "active", "draining"]))
        a.start(), b.start(), a.join(), b.join()
        assert (inv.get("h1").state, inv.get("h2").state) == ("reclaimed", "draining")
        inv.set_state("h1", "active")
    assert not errors


def test_inventory_is_shared_by_every_node(store):
    Inventory(store.r).add(HostRecord("host4", "qemu+tls://10.0.0.4/system", "kvm", 2048, 8))
    seen = Inventory(FleetState(store.url).r).get("host4")  # another node's view
    assert (seen.uri, seen.memory_mib, seen.state) == ("qemu+tls://10.0.0.4/system", 2048, "active")


def test_the_end_of_a_task_gives_back_what_a_dead_earlier_run_of_it_held(store):
    store.acquire("vm", "kd1", "task-7", "migration of kd1 to host2", ttl=30)  # run 1, killed
    store.acquire("vm", "other", "task-8", "suspend of other", ttl=30)
    assert store.release_owned("task-7") == 1
    assert store.holder("vm", "kd1") is None and store.holder("vm", "other")
