"""The deadline executor's threads, with the moves themselves faked: what runs at once."""

import threading
import time
from types import SimpleNamespace

from vmmgr import deadline_run
from vmmgr.deadline import Candidate, Move, Plan, Rates


class _Report:
    def __init__(self):
        self.events = []

    def event(self, message, **kw):
        self.events.append(message)


def test_migrations_replanned_into_saves_keep_to_the_storage_streams(mocker):
    """A link slower than planned turns queued migrations into saves; those saves take storage's
    streams (one here) like the planned ones, not one per link thread beside them."""
    running, most, lock = [], [0], threading.Lock()

    def fake_step(fleet, report, step, outcome, slots, deadline):
        with lock:
            running.append(step.vm)
            most[0] = max(most[0], len(running))
        time.sleep(0.05)
        with lock:
            running.remove(step.vm)
            (outcome.suspended if step.action == "suspend" else outcome.migrated).append(step.vm)

    mocker.patch.object(deadline_run, "run_step", fake_step)
    rates = Rates(link_mibps=1.0, link_total_mibps=4.0, storage_mibps=1000.0, save_streams=1,
                  overhead_s=0.0)  # four link streams; a 100 MiB migration now takes 100 s
    names = ["a", "b", "c", "d"]
    candidates = {n: Candidate(n, 100, target="h2") for n in names + ["e"]}
    plan = Plan([Move(n, "migrate", "h2", 0, 1, "") for n in names]
                + [Move("e", "suspend", None, 0, 1, "")], deadline_s=10)
    outcome = deadline_run.DeadlineReport("h1", [], [], {}, 0.0, deadline_s=10)
    saved = {}
    fleet = SimpleNamespace(state=SimpleNamespace(r=SimpleNamespace(
        hset=lambda key, mapping: saved.update(mapping))))
    report = _Report()
    deadline_run._carry_out(fleet, report, plan, candidates, time.time() + 10, rates, outcome,
                            time.monotonic())
    assert sorted(outcome.suspended) == names + ["e"] and not outcome.migrated
    assert most[0] == 1  # never two saves at once
    assert sum("re-planned" in e for e in report.events) == 4
    assert set(outcome.safe_at) == set(names + ["e"])


def test_a_save_is_chosen_over_a_migration_only_if_it_ends_in_time_behind_storages_work():
    move, c = Move("a", "migrate", "h2", 0, 1, ""), Candidate("a", 100, target="h2")
    rates = Rates(link_mibps=1.0, storage_mibps=100.0, save_streams=1, overhead_s=0.0)
    deadline_at = time.time() + 8  # the migration needs 100 s; a save alone 1 s
    assert deadline_run._replanned(move, c, deadline_at, rates, _Report()).how == "suspend"
    # behind 1000 MiB storage is writing, the save would end at ~11 s: it stays a migration
    assert deadline_run._replanned(move, c, deadline_at, rates, _Report(),
                                   storage_ahead_mib=1000).how == "migrate"


def test_a_surprise_outside_a_step_names_its_vm_and_the_other_moves_go_on(mocker):
    def fake_step(fleet, report, step, outcome, slots, deadline):
        outcome.migrated.append(step.vm)

    class FlakyReport(_Report):
        def event(self, message, **kw):
            if message.startswith("b: safe"):
                raise ConnectionError("the store is away")
            super().event(message, **kw)

    mocker.patch.object(deadline_run, "run_step", fake_step)
    rates = Rates(link_mibps=100, link_total_mibps=100, overhead_s=0.0)  # one link worker
    candidates = {n: Candidate(n, 10, target="h2") for n in "abc"}
    plan = Plan([Move(n, "migrate", "h2", 0, 1, "") for n in "abc"], deadline_s=60)
    outcome = deadline_run.DeadlineReport("h1", [], [], {}, 0.0, deadline_s=60)
    fleet = SimpleNamespace(state=SimpleNamespace(r=SimpleNamespace(hset=lambda k, mapping: 0)))
    deadline_run._carry_out(fleet, FlakyReport(), plan, candidates, time.time() + 60, rates,
                            outcome, time.monotonic())
    assert outcome.migrated == ["a", "b", "c"]  # c still moved after b's report failed
    assert not outcome.failed  # b moved: only its report was lost

    class AwayAtReplan(_Report):
        def event(self, message, **kw):
            if message.startswith("b: re-planned"):
                raise ConnectionError("the store is away")
            super().event(message, **kw)

    slow = Rates(link_mibps=1.0, link_total_mibps=1.0, storage_mibps=1000.0, overhead_s=0.0)
    outcome = deadline_run.DeadlineReport("h1", [], [], {}, 0.0, deadline_s=60)
    big = {n: Candidate(n, 100, target="h2") for n in "abc"}  # a migration: 100 s, a save: 0.1
    deadline_run._carry_out(fleet, AwayAtReplan(), plan, big, time.time() + 60, slow, outcome,
                            time.monotonic())
    assert sorted(outcome.migrated + outcome.suspended) == ["a", "c"]
    assert "the store is away" in outcome.failed["b"]  # never moved: named, not lost silently
