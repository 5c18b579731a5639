"""Fleet state, locks and the event log against a real (private, throwaway) Redis server."""

import time

import pytest

from tasks.client import _pass_on
from vmmgr import state as state_mod
from vmmgr.errors import Conflict
from vmmgr.state import FleetState


@pytest.fixture
def fleet_state(redis_url):
    return FleetState(redis_url)


def test_a_lock_refuses_others_and_says_what_holds_it(fleet_state):
    fleet_state.acquire("vm", "a", "task-1", "migration of a to host2", ttl=30)
    with pytest.raises(Conflict, match="VM 'a' is busy: migration of a to host2 is in progress"):
        fleet_state.acquire("vm", "a", "task-2", "suspend of a", ttl=30)
    fleet_state.acquire("vm", "a", "task-1", "migration of a to host2", ttl=30)  # redelivered
    fleet_state.acquire("vm", "b", "task-2", "suspend of b", ttl=30)  # other VMs are free


def test_only_the_owner_refreshes_or_releases_a_lock(fleet_state):
    fleet_state.acquire("host", "h1", "task-1", "drain of h1", ttl=30)
    assert not fleet_state.refresh("host", "h1", "task-10", ttl=30)  # prefix of no use
    fleet_state.release("host", "h1", "task-10")
    assert fleet_state.holder("host", "h1") == "task-1 drain of h1"
    assert fleet_state.refresh("host", "h1", "task-1", ttl=60)
    assert 30 < fleet_state.r.ttl("vmmgr:lock:host:h1") <= 60
    fleet_state.release("host", "h1", "task-1")
    assert fleet_state.holder("host", "h1") is None


def test_a_dead_owners_lock_expires(fleet_state):
    fleet_state.acquire("vm", "a", "task-1", "suspend of a", ttl=1)
    time.sleep(1.2)
    fleet_state.acquire("vm", "a", "task-2", "resume of a", ttl=30)
    assert fleet_state.holder("vm", "a").startswith("task-2 ")


def test_records_follow_a_migration_and_keep_every_attempt(fleet_state):
    fleet_state.set_vm("a", state="running", host="host1")
    fleet_state.record("migrating", "a", {"target": "host2"})
    assert fleet_state.vm("a")["state"] == "migrating"
    fleet_state.record("migration_failed", "a", {"source": "host1", "target": "host2",
                                                  "error": "cancelled"})
    assert (fleet_state.vm("a")["state"], fleet_state.vm("a")["host"]) == ("running", "host1")
    fleet_state.record("migrated", "a", {"source": "host1", "target": "host2", "downtime_ms": 20})
    assert (fleet_state.vm("a")["state"], fleet_state.vm("a")["host"]) == ("running", "host2")
    assert [m["status"] for m in fleet_state.migrations("a")] == ["failed", "completed"]


def test_records_follow_parking_and_resuming(fleet_state):
    fleet_state.record("suspending", "a", {})
    fleet_state.record("suspended", "a", {"from_host": "host1"})
    assert (fleet_state.vm("a")["state"], fleet_state.vm("a")["host"]) == ("suspended", "")
    fleet_state.record("resuming", "a", {"target": "host3"})
    fleet_state.record("resume_failed", "a", {"target": "host3", "error": "no room"})
    assert fleet_state.vm("a")["state"] == "suspended"
    fleet_state.record("resuming", "a", {"target": "host3"})
    fleet_state.record("resumed", "a", {"host": "host3"})
    assert (fleet_state.vm("a")["state"], fleet_state.vm("a")["host"]) == ("running", "host3")
    with pytest.raises(ValueError):
        fleet_state.record("teleported", "a", {})


def test_events_read_oldest_first_and_from_a_position(fleet_state):
    for i in range(5):
        fleet_state.event(f"e{i}", vm="a" if i % 2 else "b")
    all_events = fleet_state.events(10)
    assert [e["message"] for e in all_events] == ["e0", "e1", "e2", "e3", "e4"]
    assert [e["message"] for e in fleet_state.events(3)] == ["e2", "e3", "e4"]
    assert [e["message"] for e in fleet_state.events(10, after=all_events[2]["id"])] == ["e3", "e4"]
    assert [e["message"] for e in fleet_state.events(10, vm="a")] == ["e1", "e3"]


def test_tasks_count_runs_and_old_ones_go(fleet_state, monkeypatch):
    monkeypatch.setattr(state_mod, "TASKS_KEPT", 3)
    for i in range(5):
        fleet_state.add_task(f"t{i}", "migrate", {"vm": f"v{i}"}, "host.host1")
    assert [t["id"] for t in fleet_state.recent_tasks(10)] == ["t4", "t3", "t2"]
    assert fleet_state.task("t0") == {}
    assert fleet_state.task_started("t4", "host2") == 1
    assert fleet_state.task_started("t4", "host3") == 2  # redelivered to another worker
    assert fleet_state.task("t4")["worker"] == "host3"


def test_the_waiting_client_passes_on_each_event_once():
    seen, got = 0, []
    seen = _pass_on({"events": ["a", "b"], "event_count": 2}, seen, got.append)
    seen = _pass_on({"events": ["a", "b", "c"], "event_count": 3}, seen, got.append)
    seen = _pass_on({"events": ["c", "d"], "event_count": 4}, seen, got.append)  # trimmed meta
    assert got == ["a", "b", "c", "d"] and seen == 4
