"""The reconcile starts each post-copy recovery as the VM's own work: one that hangs in libvirt
must not hold up the fleet's reconcile (seen in CI: every later pass was blocked behind it)."""

from types import SimpleNamespace

from vmmgr import reconcile
from vmmgr.errors import Conflict
from vmmgr.state import FleetState


def _fleet(redis_url):
    state = FleetState(redis_url)
    state.set_vm("paused", state="postcopy-paused", host="host2", source="host1", target="host2")
    state.set_vm("held", state="postcopy-paused", host="host3", source="host2", target="host3")
    state.set_vm("fine", state="running", host="host1")
    state.acquire("vm", "held", "task-9", "post-copy recovery of held", ttl=30)
    return SimpleNamespace(state=state)


class Report:
    def __init__(self):
        self.events = []

    def event(self, message, **kw):
        self.events.append(message)


def test_each_paused_vm_not_held_is_started(redis_url):
    started = []
    done = reconcile.resume_postcopies(_fleet(redis_url), Report(),
                                       start=started.append)
    assert started == ["paused"]  # "held" is being recovered; "fine" runs
    assert done == ["paused"]


def test_a_start_that_fails_is_said_and_the_pass_goes_on(redis_url):
    report = Report()

    def start(vm):
        if vm == "paused":
            raise ConnectionError("broker away")

    fleet = _fleet(redis_url)
    fleet.state.release("vm", "held", "task-9")
    assert reconcile.resume_postcopies(fleet, report, start=start) == ["held"]
    assert report.events == ["paused: post-copy recovery not started: broker away"]


def test_a_busy_start_is_left_to_the_next_pass(redis_url):
    def start(vm):
        raise Conflict(f"VM {vm!r} is busy")

    assert reconcile.resume_postcopies(_fleet(redis_url), Report(), start=start) == []


def test_a_failed_try_waits_its_turn(redis_url):
    """A link down for hours: each failed try pushes the next one further out (10 s, doubling,
    at most 5 minutes), instead of a task every pass."""
    import time

    from vmmgr.operations import recovery_backoff

    fleet = _fleet(redis_url)
    fleet.state.set_vm("paused", recovery_tries=1, recovery_at=time.time() + 30)
    started = []
    assert reconcile.resume_postcopies(fleet, Report(), start=started.append) == []
    fleet.state.set_vm("paused", recovery_at=time.time() - 1)
    assert reconcile.resume_postcopies(fleet, Report(), start=started.append) == ["paused"]
    assert [recovery_backoff(n) for n in (1, 2, 3, 6, 20)] == [10, 20, 40, 300, 300]
