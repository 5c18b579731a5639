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


def test_a_task_never_listed_keeps_its_record_a_day_and_a_listed_one_its_runs(fleet_state):
    """The beat's reconcile (every few seconds) and the passes it queues are not submitted
    through `add_task`: their records must not pile up in the store for ever. A listed task a
    worker started before the submitter listed it keeps its run count and its record."""
    key = "vmmgr:task:beat1"
    assert fleet_state.task_started("beat1", "host1") == 1
    assert 0 < fleet_state.r.ttl(key) <= state_mod.UNLISTED_TASK_TTL
    assert fleet_state.task_started("fast", "host1") == 1  # started before it was listed
    fleet_state.add_task("fast", "resume", {"vm": "v"}, "site.east")
    assert fleet_state.r.ttl("vmmgr:task:fast") == -1 and fleet_state.task("fast")["runs"] == "1"
    assert fleet_state.task_started("fast", "host2") == 2


def test_the_waiting_client_passes_on_each_event_once():
    seen, got = 0, []
    seen = _pass_on({"events": ["a", "b"], "event_count": 2}, seen, got.append)
    seen = _pass_on({"events": ["a", "b", "c"], "event_count": 3}, seen, got.append)
    seen = _pass_on({"events": ["c", "d"], "event_count": 4}, seen, got.append)  # trimmed meta
    assert got == ["a", "b", "c", "d"] and seen == 4


def _row(name, state="running", host="h1"):
    return {"name": name, "host": host, "state": state}


def test_an_observers_row_never_overwrites_an_operations(fleet_state):
    """A lifecycle event read as a suspend wrote the image saw the VM nowhere; the suspend then
    wrote its row: the observer's late drop must not land (the lab's API test lost a VM so)."""
    fleet_state.set_vm_view("a", _row("a"))
    since = fleet_state.view_mark()  # the observer starts to look ...
    fleet_state.set_vm_view("a", _row("a", "suspended", "-"))  # ... the suspend ends meanwhile
    assert fleet_state.observe_vm_views({"a": None}, since) == ["a"]
    assert fleet_state.vm_view("a")["state"] == "suspended"
    # A look begun after the operation's write is newer than it, and lands.
    assert fleet_state.observe_vm_views({"a": None}, fleet_state.view_mark()) == []
    assert fleet_state.vm_view("a") is None


def test_an_observer_leaves_a_vm_an_operation_holds(fleet_state):
    fleet_state.set_vm_view("a", _row("a"))
    fleet_state.acquire("vm", "a", "task-1", "migration of a", ttl=30)
    since = fleet_state.view_mark()
    assert fleet_state.observe_vm_views({"a": _row("a", "paused")}, since) == ["a"]
    assert fleet_state.vm_view("a")["state"] == "running"
    fleet_state.release("vm", "a", "task-1")
    assert fleet_state.observe_vm_views({"a": _row("a", "paused")}, since) == []
    assert fleet_state.vm_view("a")["state"] == "paused"


def test_a_whole_look_keeps_what_it_must_and_drops_what_it_did_not_see(fleet_state):
    for name in "abcd":
        fleet_state.set_vm_view(name, _row(name))
    since = fleet_state.view_mark()
    fleet_state.acquire("vm", "b", "task-1", "destroy of b", ttl=30)  # held: kept as it was
    fleet_state.set_vm_view("c", _row("c", host="h2"))  # written while the look ran: kept
    left = fleet_state.observe_vm_views({"a": _row("a", "shutoff"), "e": _row("e")}, since,
                                        whole=True)  # d was not seen: gone
    assert sorted(left) == ["b", "c"]
    rows = {r["name"]: r for r in fleet_state.vm_views()}
    assert sorted(rows) == ["a", "b", "c", "e"]
    assert (rows["a"]["state"], rows["b"]["state"], rows["c"]["host"]) == ("shutoff", "running",
                                                                          "h2")
    # The look supersedes the stamps older than it: only c's (newer) is left.
    assert fleet_state.r.hkeys("vmmgr:view:stamps") == ["c"]


def test_a_look_begun_before_a_whole_look_began_lands_nowhere(fleet_state):
    """The whole look drops the stamps older than it: a single look begun before it must not
    take their absence for a clear field (it is older than the whole look everywhere)."""
    fleet_state.set_vm_view("a", _row("a"))
    follower = fleet_state.view_mark()  # an event's look begins ...
    fleet_state.set_vm_view("a", _row("a", "suspended", "-"))  # ... a suspend ends ...
    reconcile = fleet_state.view_mark()  # ... a reconcile looks and lands (and prunes) ...
    fleet_state.observe_vm_views({"a": _row("a", "suspended", "-")}, reconcile, whole=True)
    assert fleet_state.r.hkeys("vmmgr:view:stamps") == []
    # ... and then the event's stale look arrives.
    assert fleet_state.observe_vm_views({"a": None}, follower) == ["a"]
    assert fleet_state.vm_view("a")["state"] == "suspended"
    # An older whole look, arriving late, lands nowhere either.
    assert fleet_state.observe_vm_views({}, follower, whole=True) == []
    assert fleet_state.vm_view("a")["state"] == "suspended"


def test_what_moves_teach_reaches_the_deadline_planners_rates(fleet_state):
    from vmmgr.deadline_run import measured_rates
    assert measured_rates(fleet_state.r).sent_fraction == 1.0  # nothing learnt: the defaults
    fleet_state.learn_move(0.72, 1.2)
    first = measured_rates(fleet_state.r)
    assert (first.sent_fraction, first.overhead_s) == (0.72, 1.2)
    fleet_state.learn_move(1.0, 2.0)  # the newest weighs a quarter
    second = measured_rates(fleet_state.r)
    assert second.sent_fraction == pytest.approx(0.79) and second.overhead_s == pytest.approx(1.4)


def test_each_link_learns_its_own_time_outside_the_copy(fleet_state):
    assert fleet_state.link_overhead_s("host1", "host3") is None
    fleet_state.learn_link_overhead("host1", "host3", 4.0)
    fleet_state.learn_link_overhead("host1", "host3", 8.0)  # the newest weighs a quarter
    assert fleet_state.link_overhead_s("host1", "host3") == pytest.approx(5.0)
    assert fleet_state.link_overhead_s("host3", "host1") is None  # each direction its own
