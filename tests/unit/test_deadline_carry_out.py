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
