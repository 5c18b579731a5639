"""The migration policy's decisions, with the clock and the job stats passed in as numbers."""

from dataclasses import replace

import libvirt
import pytest

from vmmgr.errors import InvalidRequest
from vmmgr.migration import flags_and_params
from vmmgr.policy import (
    HOLD_BACK_MS, HOLD_BACKOFF_S, HOLD_GRACE_S, HOLD_GUARD_S, POLICIES, QEMU_LIMIT_LAG_S, Abort, Hold, Pause, Policy, Release, SetDowntime,
    StartPostCopy, SwitchOver, decide, downtime_step, for_link, get_policy, polls_fast, start,
    warning,
)

MiB = 2**20
BASE = Policy("t", "test", downtime_start_ms=100, downtime_max_ms=300, downtime_steps=4,
              downtime_step_after_s=2, postcopy_after_stall_s=6, progress_timeout_s=60,
              completion_timeout_s=300)


def run(policy, polls):
    """Feed (time, remaining MiB, iteration) polls; return every action with its time."""
    w, _ = start(policy, 0.0)
    seen = []
    for t, remaining, iteration in polls:
        w, actions = decide(policy, w, remaining * MiB, iteration, t)
        seen += [(t, a) for a in actions]
    return w, seen


def stalled_passes(until, pass_s=1.0, peak=64):
    """A guest that outpaces the link: every pass starts with the same dirty set."""
    polls, t, it = [], 0.0, 1
    while t <= until:
        polls += [(t, peak, it), (t + pass_s / 2, peak / 2, it)]
        t += pass_s
        it += 1
    return polls


def test_start_sets_the_first_downtime_limit():
    w, actions = start(BASE, 5.0)
    assert actions == [SetDowntime(100)] and w.downtime_ms == 100 and w.started == 5.0


def test_downtime_steps_are_even_and_capped():
    assert [downtime_step(BASE, ms) for ms in (100, 150, 250, 300)] == [150, 200, 300, 300]
    assert downtime_step(replace(BASE, downtime_steps=0), 100) == 100


def test_a_converging_guest_is_left_alone():
    # Each pass starts with less than the one before: progress, so no steps and no timeouts.
    polls = [(t, 100 / (t + 1), int(t) + 1) for t in range(0, 40)]
    _, seen = run(BASE, polls)
    assert seen == []


def test_a_stall_steps_the_downtime_up_then_switches_to_postcopy():
    policy = replace(BASE, postcopy=True)
    w, seen = run(policy, stalled_passes(until=30))
    steps = [(t, a.ms) for t, a in seen if isinstance(a, SetDowntime)]
    assert [ms for _, ms in steps] == [150, 200, 250, 300]
    assert all(b - a >= 2 for (a, _), (b, _) in zip(steps, steps[1:]))  # 2 s stalled each
    switches = [(t, a) for t, a in seen if isinstance(a, StartPostCopy)]
    assert len(switches) == 1
    t_switch, action = switches[0]
    assert t_switch - steps[-1][0] >= 6 and "top downtime limit (300 ms)" in action.reason
    assert w.postcopy
    assert seen[-1] == switches[0]  # nothing is decided after the switch


def test_without_postcopy_a_stall_ends_in_the_progress_timeout_abort():
    policy = replace(BASE, progress_timeout_s=20)
    _, seen = run(policy, stalled_passes(until=40))
    aborts = [(t, a) for t, a in seen if isinstance(a, Abort)]
    assert len(aborts) == 1
    t, abort = aborts[0]
    assert 20 <= t < 22 and abort.reason == "no progress for 20 s"


def test_completion_timeout_boundary():
    policy = replace(BASE, completion_timeout_s=10)
    w, _ = start(policy, 0.0)
    w, actions = decide(policy, w, 50 * MiB, 1, 9.999)
    assert actions == []
    w, actions = decide(policy, w, 40 * MiB, 1, 10.0)
    assert actions == [Abort("completion timeout (10 s)")]
    assert decide(policy, w, 30 * MiB, 1, 11.0)[1] == []  # the abort stands, once


@pytest.mark.parametrize("postcopy,expected", [(True, StartPostCopy), (False, Pause)])
def test_force_on_timeout_is_postcopy_or_a_pause(postcopy, expected):
    policy = replace(BASE, completion_timeout_s=5, on_timeout="force", postcopy=postcopy)
    w, _ = start(policy, 0.0)
    w, actions = decide(policy, w, 10 * MiB, 1, 5.0)
    assert [type(a) for a in actions] == [expected]
    assert "completion timeout" in actions[0].reason


def test_the_first_bulk_pass_is_not_a_stall():
    # 20 s of a slow first pass: remaining falls all along, nothing to decide.
    _, seen = run(BASE, [(t, 1000 - t * 10, 1) for t in range(0, 21)])
    assert seen == []


def test_named_policies_and_their_guarantees():
    assert set(POLICIES) == {"safe", "balanced", "never-fail"}
    assert not POLICIES["safe"].postcopy and POLICIES["safe"].on_timeout == "abort"
    assert POLICIES["balanced"].postcopy and POLICIES["balanced"].auto_converge
    assert POLICIES["never-fail"].on_timeout == "force"
    assert get_policy(None).name == "balanced"
    assert get_policy("safe", 32).bandwidth_mibps == 32


@pytest.mark.parametrize("args", [("fast",), ("safe", -1)])
def test_bad_policy_requests(args):
    with pytest.raises(InvalidRequest):
        get_policy(*args)


def test_invalid_policy_combinations():
    with pytest.raises(ValueError):
        Policy("x", "", on_timeout="retry")
    with pytest.raises(ValueError):
        Policy("x", "", postcopy=True, parallel_connections=4)


def test_warning_when_the_guest_outpaces_the_link():
    assert warning(80 * MiB, 32 * MiB, True) == (
        "dirtying memory faster than it can be sent; throttling")
    assert "auto-converge off" in warning(80 * MiB, 32 * MiB, False)
    assert warning(10 * MiB, 32 * MiB, True) is None
    assert warning(10 * MiB, 0, True) is None


def test_a_slow_link_gets_compressed_multifd_and_a_fast_or_unknown_one_does_not():
    safe = get_policy("safe")
    assert for_link(safe, None) == (safe, "")  # never measured: one stream
    assert for_link(safe, 110.0) == (safe, "")  # 1 Gbit/s: compression gains nothing there
    fitted, why = for_link(safe, 11.2)  # 100 Mbit/s
    assert fitted.parallel_connections == 2 and not fitted.postcopy
    assert "11 MiB/s" in why and "zstd" in why and "post-copy" not in why
    flags, params = flags_and_params(fitted)
    assert flags & libvirt.VIR_MIGRATE_PARALLEL
    assert params[libvirt.VIR_MIGRATE_PARAM_PARALLEL_CONNECTIONS] == 2


def test_the_default_policy_gives_up_its_post_copy_fallback_for_multifd_and_says_so():
    fitted, why = for_link(get_policy(None), 11.5)
    assert fitted.name == "balanced" and fitted.parallel_connections == 2
    assert not fitted.postcopy  # QEMU refuses multifd with the post-copy capability
    assert "without the post-copy fallback" in why
    flags, _ = flags_and_params(fitted)
    assert not flags & libvirt.VIR_MIGRATE_POSTCOPY


def test_an_operators_choice_and_a_post_copy_promise_are_kept_on_a_slow_link():
    for policy in (get_policy("never-fail"),  # finishes through post-copy: no multifd
                   get_policy("safe", 8),  # a bandwidth cap
                   get_policy("safe", parallel_connections=4),
                   get_policy("safe", compression="xbzrle")):
        assert for_link(policy, 5.0) == (policy, "")


def _first_postcopy_at(policy, first_pass_s: float = 5.0) -> float | None:
    """A guest that outpaces the link: after its first pass every pass peaks as high."""
    from vmmgr.policy import StartPostCopy, decide, start
    w, _ = start(policy, 0.0)
    t = 0.0
    while t < 60:
        t = round(t + 0.2, 1)
        iteration = 1 if t < first_pass_s else 2 + int((t - first_pass_s) // 2)
        w, actions = decide(policy, w, 100 if iteration == 1 else 80, iteration, t)
        if any(isinstance(a, StartPostCopy) for a in actions):
            return t - first_pass_s
    return None


def test_a_deadlines_early_postcopy_starts_about_a_second_after_the_first_pass():
    from vmmgr.policy import EARLY_POSTCOPY
    early = _first_postcopy_at(get_policy("never-fail", None, **EARLY_POSTCOPY))
    plain = _first_postcopy_at(get_policy("never-fail"))
    assert early is not None and early <= 1.5
    assert plain is not None and plain >= 10  # four 2 s downtime steps, then 3 s at the top


# ---- the edge holds the VM's packets through its switch-over -----------------------------

def held_run(polls, dirty_mibps=10, speed_mibps=100, policy=BASE):
    """(time, remaining MiB, iteration) polls with a steady dirty rate and link speed."""
    w, first = start(policy, 0.0, can_hold=True)
    seen = []
    for t, remaining, iteration in polls:
        w, actions = decide(policy, w, int(remaining * MiB), iteration, t,
                            int(dirty_mibps * MiB), int(speed_mibps * MiB))
        seen += [(t, a) for a in actions]
    return first, w, seen


def test_qemus_limit_is_held_back_until_the_edge_holds_near_the_end_of_a_pass():
    first, w, seen = held_run([(0.2, 100, 1), (0.4, 60, 1), (0.8, 20, 1), (0.95, 5, 1),
                               (0.99, 1.5, 1), (0.995, 1, 1), (1.0, 0.5, 1)])
    assert first == [SetDowntime(HOLD_BACK_MS)]  # QEMU does not pause the VM before the hold
    # 1.5 MiB left at 100 MiB/s: the pass ends in 15 ms. Held; once what the edge sent just
    # before has reached the VM (HOLD_GUARD_S), QEMU gets the policy's limit and may pause it.
    assert [(t, type(a)) for t, a in seen] == [(0.99, Hold), (0.99 + HOLD_GUARD_S, SetDowntime)]
    assert seen[1][1] == SetDowntime(100) and w.holding_since == 0.99
    assert "ends in about 15 ms" in seen[0][1].reason
    assert polls_fast(w, 1, 100 * MiB, 0.2, 1.0)  # watched closely while it is on
    # Pass 1 over (QEMU's limit was read at its own pace): what is left fits, vmmgr pauses
    # the VM at once; QEMU has its limit already.
    w, actions = decide(BASE, w, int(0.2 * MiB), 2, 1.01, 10 * MiB, 100 * MiB)
    assert [type(a) for a in actions] == [SwitchOver] and w.finished


def test_polls_fast_only_near_a_pass_end_and_never_without_an_edge_that_holds():
    w, _ = start(BASE, 0.0, can_hold=True)
    assert not polls_fast(w, 60 * MiB, 100 * MiB, 0.2, 0.5)  # 600 ms left
    assert polls_fast(w, 20 * MiB, 100 * MiB, 0.2, 0.5)  # 200 ms: the next poll may be late
    w, _ = start(BASE, 0.0)
    assert not polls_fast(w, 1, 100 * MiB, 0.2, 0.5)


def test_a_hold_whose_rest_fits_the_limit_pauses_the_vm_at_the_first_poll_past_the_guard():
    # Pass 2 ends in 30 ms at 1.0 s: held. At 1.01 s (HOLD_GUARD_S on) 2.5 MiB + 10 MiB/s
    # since the pass began (after the 0.8 s poll) = 4.6 MiB at 100 MiB/s: about 46 ms. vmmgr
    # pauses the VM then, not waiting for QEMU, which reads a new limit only at its next
    # measure of the link, up to 100 ms later (bench-stall: the hold's lead halved). QEMU is
    # not given the limit at all: a paused VM's migration completes under the 1 ms one, and a
    # pause that fails must find QEMU still held back.
    _, w, seen = held_run([(0.8, 30, 1), (1.0, 3, 2), (1.01, 2.5, 2), (1.02, 2, 2)])
    assert [(t, type(a)) for t, a in seen] == [(1.0, Hold), (1.01, SwitchOver)]
    assert w.finished and "about 46 ms" in seen[1][1].reason


def test_a_hold_not_switched_over_in_its_grace_is_released_and_tried_again_later():
    # A guest that dirties 200 MiB/s: the rest never fits 100 ms. At the grace QEMU is held
    # back again, and the hold goes only once QEMU has read that (QEMU_LIMIT_LAG_S).
    polls = [(0.8, 30, 1), (1.0, 3, 2), (1.02, 3, 2), (1.0 + HOLD_GRACE_S, 3, 2),
             (1.3, 3, 2), (1.4, 3, 3), (2.0, 3, 3), (2.5, 3, 4)]
    _, w, seen = held_run(polls, dirty_mibps=200)
    assert [(t, a if isinstance(a, SetDowntime) else type(a)) for t, a in seen] == [
        (1.0, Hold), (1.02, SetDowntime(100)), (1.0 + HOLD_GRACE_S, SetDowntime(HOLD_BACK_MS)),
        (1.4, Release), (2.5, Hold)]
    assert 1.0 + HOLD_GRACE_S + QEMU_LIMIT_LAG_S <= 1.4 and not w.finished


def test_a_guest_stalled_at_the_top_limit_without_a_hold_gets_qemus_choice_back():
    # Passes of 640 ms at 100 MiB/s: never within the lead, so no hold; vmmgr's limit steps up
    # while QEMU's stays held back; stalled at the top, QEMU gets the limit and the moment.
    _, w, seen = held_run(stalled_passes(until=12), dirty_mibps=200)
    assert [(round(t, 1), a) for t, a in seen] == [(11.0, SetDowntime(300))]
    assert w.downtime_ms == 300 and not w.can_hold
    w, actions = decide(BASE, w, 1 * MiB, w.iteration, 12.6, 200 * MiB, 100 * MiB)
    assert actions == []  # no more holds: as without an edge that holds


def test_a_decision_that_ends_the_steering_never_leaves_qemu_held_back_nor_an_abort_held():
    policy = replace(BASE, progress_timeout_s=3, on_timeout="abort")
    w, _ = start(policy, 0.0, can_hold=True)
    w, _ = decide(policy, w, 3 * MiB, 2, 0.5, 200 * MiB, 100 * MiB)  # held
    assert w.holding_since == 0.5
    w, actions = decide(policy, w, 3 * MiB, 2, 3.5, 200 * MiB, 100 * MiB)
    assert [type(a) for a in actions] == [SetDowntime, Release, Abort]
    assert actions[0] == SetDowntime(100) and not w.can_hold
    # Post-copy from a hold: QEMU gets its limit, the hold stays for the switch-over.
    policy = replace(BASE, postcopy=True, downtime_start_ms=300, postcopy_after_stall_s=1,
                     downtime_step_after_s=5)
    w, _ = start(policy, 0.0, can_hold=True)
    w = replace(w, iteration=3, holding_since=2.4, limit_given=True)  # held 100 ms ago
    w, actions = decide(policy, w, 60 * MiB, 3, 2.5, 200 * MiB, 100 * MiB)
    assert actions == [SetDowntime(300), actions[1]] and isinstance(actions[1], StartPostCopy)
    assert w.holding_since == 2.4 and not w.can_hold


def test_pages_of_zeros_draining_fast_are_watched_closely_but_the_hold_waits_for_the_links_pace():
    # The link says 100 MiB/s, but what is left shrank 40 MiB in 0.1 s (zeros): 400 MiB/s.
    w, _ = start(BASE, 0.0, can_hold=True)
    w, seen = decide(BASE, w, 60 * MiB, 1, 0.1, 0, 100 * MiB)
    assert seen == [] and not polls_fast(w, 60 * MiB, 100 * MiB, 0.2, 0.1)
    w, seen = decide(BASE, w, 20 * MiB, 1, 0.2, 0, 100 * MiB)
    assert seen == [] and w.drain_bps == 400 * MiB
    assert polls_fast(w, 20 * MiB, 100 * MiB, 0.2, 0.2)  # 50 ms left at the pace seen
    # A pass ends with the guest's data, sent at the link's pace: 6 MiB take 60 ms, not the
    # 15 ms the zeros' pace says (bench-stall: holds taken that early waited 50-90 ms more).
    w, seen = decide(BASE, w, 6 * MiB, 1, 0.235, 0, 100 * MiB)
    assert seen == []
    w, seen = decide(BASE, w, 3 * MiB, 1, 0.265, 0, 100 * MiB)
    assert [type(a) for a in seen] == [Hold]  # 30 ms left at the link's pace


def test_a_switch_over_that_sends_nothing_for_too_long_is_aborted_then_its_target_dropped():
    from vmmgr.policy import ABORT_GRACE_S, SWITCHOVER_STALL_S, DropTarget, after_giving_up, \
        decide_paused
    w, _ = start(BASE, 0.0)
    # A forced pause's rest: sent on, however long it takes, so long as bytes go. (What is
    # left may grow meanwhile: a pause mid-pass adds what the guest dirtied before it.)
    w, seen = decide_paused(w, 100 * MiB, 1.0)
    for t in range(2, 30):
        w, actions = decide_paused(w, (100 + t) * MiB, float(t))
        seen += actions
    assert seen == [] and w.paused_still_since == 29.0
    # No byte more (a target QEMU that stopped taking it: libvirt would wait for ever).
    w, seen = decide_paused(w, 129 * MiB, 29.0 + SWITCHOVER_STALL_S - 0.1)
    assert seen == []
    w, seen = decide_paused(w, 129 * MiB, 29.0 + SWITCHOVER_STALL_S)
    assert [type(a) for a in seen] == [Abort] and "the target does not take it" in seen[0].reason
    assert w.finished and w.gave_up_at == 29.0 + SWITCHOVER_STALL_S
    assert decide_paused(w, 129 * MiB, 60.0)[1] == []  # aborted once
    # The call still waits on the target: its copy is dropped after the grace, and asked again
    # as often (the move drops it only once the source runs the VM again).
    at = w.gave_up_at
    assert after_giving_up(w, at + ABORT_GRACE_S - 0.1)[1] == []
    w, seen = after_giving_up(w, at + ABORT_GRACE_S)
    assert [type(a) for a in seen] == [DropTarget]
    assert after_giving_up(w, at + 2 * ABORT_GRACE_S - 0.1)[1] == []
    assert [type(a) for a in after_giving_up(w, at + 2 * ABORT_GRACE_S)[1]] == [DropTarget]


def test_a_post_copy_asked_for_but_not_switched_to_is_watched_like_any_switch_over():
    # QEMU switches at a pass's end; a move that completed in pre-copy first paused the VM
    # for an ordinary switch-over (the monitor asks only while the source is not in post-copy).
    from vmmgr.policy import SWITCHOVER_STALL_S, decide_paused
    w, _ = start(BASE, 0.0)
    w = replace(w, postcopy=True)
    w, _ = decide_paused(w, 5 * MiB, 0.0)
    assert [type(a) for a in decide_paused(w, 5 * MiB, SWITCHOVER_STALL_S)[1]] == [Abort]


def test_a_source_that_does_not_answer_while_paused_has_its_idle_target_dropped():
    from vmmgr.policy import ABORT_GRACE_S, SWITCHOVER_STALL_S, TARGET_IDLE_CPU_NS, DropTarget, \
        decide_unanswered
    ms = 1_000_000
    w, _ = start(BASE, 0.0)
    w, seen = decide_unanswered(w, 2.0, 500 * ms)  # a query unanswered: the clock starts
    assert seen == [] and w.unanswered_since == 2.0
    w = replace(w, unanswered_since=None)  # it answered after all (the monitor clears it)
    w, _ = decide_unanswered(w, 4.0, 500 * ms)
    assert decide_unanswered(w, 4.0 + SWITCHOVER_STALL_S - 0.1, 500 * ms)[1] == []
    # The target kept working (a slow tail, not a hang): the clock starts again.
    busy, seen = decide_unanswered(w, 4.0 + SWITCHOVER_STALL_S,
                                   500 * ms + TARGET_IDLE_CPU_NS + 1)
    assert seen == [] and busy.unanswered_since == 4.0 + SWITCHOVER_STALL_S
    # Its CPU time unread: never dropped.
    assert decide_unanswered(w, 4.0 + SWITCHOVER_STALL_S, None)[1] == []
    w, seen = decide_unanswered(w, 4.0 + SWITCHOVER_STALL_S, 500 * ms + TARGET_IDLE_CPU_NS)
    assert seen == [DropTarget(seen[0].reason, stuck=True)] and "stuck sending" in seen[0].reason
    at = 4.0 + SWITCHOVER_STALL_S
    assert decide_unanswered(w, at + ABORT_GRACE_S - 0.1, 500 * ms)[1] == []  # only after
    assert [a.stuck for a in decide_unanswered(w, at + ABORT_GRACE_S, 500 * ms)[1]] == [True]
