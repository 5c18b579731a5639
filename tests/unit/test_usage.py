"""Usage metering on a made-up clock: seconds per state, exact, clipped to the window."""

import time

import pytest

from vmmgr.state import FleetState
from vmmgr.usage import Usage, account, parse_time


def e(t, vm, state=None, blackout_ms=None):
    return {"time": str(t), "vm": vm, **({"state": state} if state else {}),
            **({"blackout_ms": str(blackout_ms)} if blackout_ms is not None else {})}


def test_each_state_is_counted_to_the_second():
    entries = [e(100, "a", "running"), e(160, "a", "migrating"), e(163, "a", blackout_ms=250),
               e(163, "a", "running"), e(200, "a", "suspending"), e(204, "a", "parked"),
               e(304, "a", "parked"), e(310, "a", "running"), e(400, "a", "gone")]
    [a] = account(entries, since=0, until=1000)
    assert a == Usage("a", running=60 + 37 + 90, migrating=3 - 0.25, blackout=0.25,
                      suspended=4, parked=106)


def test_the_window_clips_and_the_state_before_it_counts():
    entries = [e(100, "a", "running"), e(500, "a", "hibernated"), e(900, "b", "running")]
    a, b = account(entries, since=300, until=1000)
    assert a.running == 200 and a.hibernated == 500
    assert b.running == 100
    assert account(entries, since=0, until=50) == []  # nothing ran yet


def test_a_vm_destroyed_counts_nothing_after():
    [a] = account([e(0, "a", "running"), e(10, "a", "gone")], since=0, until=100)
    assert a.running == 10 and a.as_dict()["stopped"] == 0


def test_shut_off_and_paused_count_apart():
    [a] = account([e(0, "a", "running"), e(5, "a", "shutoff"), e(8, "a", "running")], 0, 10)
    assert (a.running, a.stopped) == (7, 3)


def test_times_are_read_as_unix_iso_or_a_span_before_now():
    assert parse_time("1700000000", now=0) == 1700000000
    assert parse_time("2026-12-03T12:00:00", now=0) == parse_time("2026-12-03T12:00:00+00:00", 0)
    assert parse_time("90m", now=10_000) == 10_000 - 5400
    with pytest.raises(ValueError, match="not a time"):
        parse_time("yesterday", now=0)
    with pytest.raises(ValueError):
        parse_time("\u00b2h", now=0)


def test_records_feed_the_stream_parked_and_hibernated_apart(redis_url):
    state = FleetState(redis_url)
    state.set_vm("a", state="running", host="h1")
    state.record("suspending", "a", {})
    state.record("suspended", "a", {"parked": True, "mode": "save"})
    state.record("resuming", "a", {"target": "h2"})
    state.record("resumed", "a", {"host": "h2"})
    state.record("migrating", "a", {"target": "h1"})
    state.record("migrated", "a", {"source": "h2", "target": "h1", "downtime_ms": 80})
    state.record("suspended", "a", {"parked": False, "mode": "guest"})
    state.set_vm("a", state="suspended", host="", target="")  # a repair: still hibernated
    state.forget_vm("a")
    kinds = [x.get("state") or f"blackout {x['blackout_ms']}" for x in state.usage_entries()]
    assert kinds == ["running", "suspending", "parked", "parked", "running", "migrating",
                     "blackout 80", "running", "hibernated", "hibernated", "gone"]


T0 = 0  # set per test: the made-up clock runs near the store's, which stamps stream ids


@pytest.fixture(autouse=True)
def near_now():
    """T0 from when the test runs, not when the module was collected (a whole suite earlier)."""
    global T0
    T0 = int(time.time()) - 1500


def _report(state, since, until):
    since, until = T0 + since, T0 + until
    return {u.vm: u for u in account(state.usage_entries(since, until), since, until)}


def test_a_report_starts_from_the_baseline_before_its_window(redis_url, mocker):
    """The daily baseline holds every VM's state and the stream's position: a report replays
    only what follows it, and counts the same as from the stream's start."""
    clock = mocker.patch("vmmgr.state.time.time", return_value=T0 + 1000.0)
    state = FleetState(redis_url)
    state.set_vm("a", state="running")
    clock.return_value = T0 + 1100.0
    state.record("suspending", "b", {})
    state.record("suspended", "b", {"parked": True, "mode": "save"})
    clock.return_value = T0 + 1200.0
    assert state.write_usage_baseline(every=3600)
    assert not state.write_usage_baseline(every=3600)  # once per period, whoever offers it
    clock.return_value = T0 + 1300.0
    state.record("resuming", "b", {"target": "h1"})
    state.record("resumed", "b", {"host": "h1"})
    clock.return_value = T0 + 1500.0

    entries = state.usage_entries(T0 + 1250, T0 + 1500)
    assert {(e["vm"], e["state"]) for e in entries if e["time"] == f"{T0 + 1200:.3f}"} == {
        ("a", "running"), ("b", "parked")}
    assert len(entries) == 4  # the baseline's two VMs and the two changes after it
    whole = {u.vm: u for u in account(state.usage_entries(0, T0 + 1500), T0 + 1250, T0 + 1500)}
    assert _report(state, 1250, 1500) == whole
    assert whole["a"].running == 250 and whole["b"].parked == 50 and whole["b"].running == 200
    # A window that starts before the baseline replays the stream from its start.
    early = _report(state, 1000, 1500)
    assert early["a"].running == 500 and early["b"].parked == 200


def test_a_vm_older_than_the_stream_is_known_from_the_first_baseline(redis_url, mocker):
    """An upgrade: a VM's record predates the usage stream. Before, it was unknown until its
    next change; the first baseline knows it, and so does every report after it."""
    mocker.patch("vmmgr.state.time.time", return_value=T0 + 1000.0)
    state = FleetState(redis_url)
    state.r.hset("vmmgr:vm:old", mapping={"state": "suspended", "saved_as": "hibernated"})
    state.r.sadd("vmmgr:vms", "old")
    assert _report(state, 1000, 2000) == {}
    state.write_usage_baseline()
    assert _report(state, 1500, 2000)["old"].hibernated == 500
