"""How a migration is steered: named policies and the pure decisions that apply them.

The migration monitor polls libvirt's job stats and feeds them to `decide` with the current time;
`decide` returns what to do (raise the downtime limit, switch to post-copy, abort, pause the guest;
with an edge that holds, hold and release the VM's packets around its switch-over: `decide_hold`)
and the monitor's next state. No clock, no libvirt: every rule tests with plain numbers.

Progress means a pass that starts with less to send than any before it. Each pre-copy pass starts by
re-adding what the guest dirtied during the last one, so the peak of `data_remaining` in a pass is
the guest's dirty set; while the guest dirties faster than the link sends, that peak stops shrinking:
a stall. (The plain low of `data_remaining` is useless for this: it nears zero at the end of the
first pass and is never beaten again.) The remedies are more downtime allowed, throttling
(auto-converge, run by QEMU from the start), then post-copy.
"""

from dataclasses import dataclass, replace

from .errors import InvalidRequest


@dataclass(frozen=True)
class Policy:
    name: str
    description: str
    # Set when the migration starts:
    bandwidth_mibps: int = 0  # 0: unlimited
    auto_converge: bool = True  # QEMU throttles the vCPUs while the guest outpaces the link
    auto_converge_initial: int = 20  # percent
    auto_converge_increment: int = 10  # percent per pass that did not converge
    compression: str | None = None  # "xbzrle": only pays where pages change a little
    parallel_connections: int = 0  # >= 2: multifd (not with post-copy in QEMU 7.2)
    postcopy: bool = False  # may switch to post-copy (then the VM cannot go back)
    # Steered while it runs:
    downtime_start_ms: int = 20  # low first: on QEMU 10 the blackout sits near the limit set
    downtime_max_ms: int = 300
    downtime_steps: int = 4
    downtime_step_after_s: float = 2.0  # stalled this long -> next downtime step
    postcopy_after_stall_s: float = 6.0  # stalled this long at the top step -> post-copy
    progress_timeout_s: float = 60.0  # no new low for this long -> on_timeout
    completion_timeout_s: float = 300.0  # running this long -> on_timeout
    on_timeout: str = "abort"  # "abort" (VM stays on the source) or "force" (make it finish)

    def __post_init__(self) -> None:
        if self.on_timeout not in ("abort", "force"):
            raise ValueError(f"on_timeout must be 'abort' or 'force', not {self.on_timeout!r}")
        if self.postcopy and self.parallel_connections >= 2:
            raise ValueError("QEMU 7.2 cannot combine post-copy with multifd")


POLICIES = {
    p.name: p
    for p in (
        Policy(
            "safe",
            "Pre-copy only. Raises the downtime limit up to 300 ms and throttles the guest gently "
            "(auto-converge from 20 %, +10 % a pass) while it outpaces the link; aborts after 60 s "
            "without progress or at 300 s. Guarantee: the guest is never paused longer than the "
            "limit, and on any failure or timeout it keeps running on the source, untouched.",
            on_timeout="abort",
        ),
        Policy(
            "balanced",
            "The default. Pre-copy with firm throttling (auto-converge from 60 %, +20 % a pass, up "
            "to 99 %) and the downtime limit raised to 300 ms while it stalls: converges even when "
            "the guest dirties memory several times faster than the link, with the blackout "
            "within the limit. If it still stalls 10 s at the top limit it switches to post-copy "
            "(the VM runs on the destination at once and pulls the rest of its memory; if the "
            "link breaks then, the migration is resumed, never rolled back); over a link measured "
            "slow it moves in compressed multifd streams instead, which QEMU cannot combine "
            "with post-copy. Aborts (the VM stays on the source) after 60 s without progress "
            "or at 300 s.",
            auto_converge_initial=60,
            auto_converge_increment=20,
            postcopy=True,
            postcopy_after_stall_s=10.0,
            on_timeout="abort",
        ),
        Policy(
            "never-fail",
            "Finishes whatever happens: the throttling of balanced, post-copy after 3 s of stall "
            "at the top limit, and at a timeout forced completion through post-copy. Never "
            "aborts; the price is a post-copy phase whenever the guest outpaces the link.",
            auto_converge_initial=40,
            auto_converge_increment=20,
            postcopy=True,
            postcopy_after_stall_s=3.0,
            progress_timeout_s=30.0,
            completion_timeout_s=120.0,
            on_timeout="force",
        ),
    )
}
DEFAULT_POLICY = "balanced"
# What the deadline planner's "postcopy" means: a guest that outpaces the link switches to
# post-copy about a second after its first pass, so the move's time is bounded by its memory
# (never-fail alone steps the downtime limit up for 8 s and waits 3 s more before it does).
EARLY_POSTCOPY = {"downtime_steps": 1, "downtime_step_after_s": 0.5,
                  "postcopy_after_stall_s": 0.5}
# 1 TiB/s: more than any link; libvirt's own ceiling (INT64_MAX bytes/s) would overflow its
# typed parameter from Python long before, and the migration would fail after it started.
MAX_BANDWIDTH_MIBPS = 1024 * 1024


def get_policy(name: str | None, bandwidth_mibps: int | None = None, **overrides) -> Policy:
    name = name or DEFAULT_POLICY
    if name not in POLICIES:
        raise InvalidRequest(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    if bandwidth_mibps is not None:
        if bandwidth_mibps < 0:
            raise InvalidRequest("bandwidth must not be negative")
        if bandwidth_mibps > MAX_BANDWIDTH_MIBPS:
            raise InvalidRequest(f"bandwidth must be at most {MAX_BANDWIDTH_MIBPS} MiB/s")
        overrides["bandwidth_mibps"] = bandwidth_mibps
    for key, value in overrides.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise InvalidRequest(f"{key} must not be negative")
    return replace(POLICIES[name], **overrides)


# A stream slower than this is held back by the link, not by the hosts: one QEMU migration stream
# sends a few hundred MiB/s from an ordinary core (about 250 MiB/s between the lab's unshaped
# hosts, under TCG). Below it, compressed multifd streams carry more of the VM through the same
# link (a 128 MiB VM at 100 Mbit/s: 11.0 s in one stream, 6.4 s in two zstd streams); at 1 Gbit/s
# and above they gain nothing and spend a core each on compressing.
LINK_BOUND_MIBPS = 40.0
MULTIFD_STREAMS = 2  # each compresses in its own thread on the source: a core each


def for_link(policy: Policy, link_mibps: float | None) -> tuple[Policy, str]:
    """The policy fitted to the link between source and target, as the last move over it
    measured it (None: never measured), and why it changed ("" if it did not). Multifd, with
    zstd (set in every VM's definition), where the link is the bottleneck; never where an
    operator chose the streams, the compression or a bandwidth cap, nor for a policy whose
    promise is to finish through post-copy. QEMU 10.0 cannot combine multifd with post-copy:
    a policy that would fall back to post-copy does without, and says so."""
    if link_mibps is None or link_mibps >= LINK_BOUND_MIBPS:
        return policy, ""
    if (policy.parallel_connections or policy.compression or policy.bandwidth_mibps
            or policy.on_timeout == "force"):
        return policy, ""
    why = (f"the link carried {link_mibps:.0f} MiB/s on the last move over it: "
           f"{MULTIFD_STREAMS} zstd-compressed multifd streams")
    if policy.postcopy:
        why += ", without the post-copy fallback (QEMU cannot combine the two)"
    return replace(policy, parallel_connections=MULTIFD_STREAMS, postcopy=False), why


# ---- decisions --------------------------------------------------------------------------


@dataclass(frozen=True)
class SetDowntime:
    ms: int


@dataclass(frozen=True)
class Hold:
    """Hold the VM's packets at the edge: the switch-over is near."""
    reason: str


@dataclass(frozen=True)
class Release:
    """Let the held packets go to the VM where it runs (it did not switch over in time)."""
    reason: str


@dataclass(frozen=True)
class SwitchOver:
    """Pause the VM now, its packets held: the rest fits the downtime limit."""
    reason: str


@dataclass(frozen=True)
class StartPostCopy:
    reason: str


@dataclass(frozen=True)
class Abort:
    reason: str


@dataclass(frozen=True)
class Pause:
    """Pause the guest so the rest is sent in one go (force-complete without post-copy)."""

    reason: str


@dataclass(frozen=True)
class DropTarget:
    """Destroy the target's copy of the VM (one that never ran): the move was given up."""

    reason: str
    stuck: bool = False  # the source's QEMU does not answer: it has not sent the VM whole


@dataclass(frozen=True)
class Watch:
    """What the monitor remembers between polls."""

    started: float
    iteration: int = 0  # the pass being watched
    pass_peak: int = 0  # the most left to send seen in this pass: the dirty set at its start
    best_peak: int | None = None  # the smallest peak of a finished pass
    best_at: float = 0.0  # when that smallest peak was set: the last progress
    downtime_ms: int = 0
    stepped_at: float = 0.0
    postcopy: bool = False
    finished: bool = False  # an abort or a pause was ordered: nothing more to decide
    disk_s: float = 0.0  # how long the local disks' copy took before the memory's began
    can_hold: bool = False  # the edge can hold the VM's packets (see `decide_hold`)
    holding_since: float | None = None
    limit_given: bool = False  # QEMU has the policy's limit (some time into a hold)
    release_at: float | None = None  # a hold given up: let go once QEMU is held back again
    hold_again_at: float = 0.0
    polled_at: float = 0.0  # the last poll
    last_remaining: int = 0  # what was left of the memory at the last poll
    drain_bps: int = 0  # how fast what is left shrank between the last two polls of a pass
    pass_from: float = 0.0  # the current pass began after this (the poll before it was seen)
    paused_sent: int | None = None  # bytes sent, as last seen since the source paused
    paused_still_since: float = 0.0  # when they last grew (or the pause was seen)
    gave_up_at: float | None = None  # when a stalled switch-over was aborted
    next_drop_at: float = 0.0  # ... when the target's copy may next be dropped
    unanswered_since: float | None = None  # the source's job queries go unanswered since
    unanswered_cpu_ns: int = 0  # ... the target's QEMU's CPU time then


# A held switch-over (`decide_hold`): hold when the pass in flight ends within HOLD_LEAD_S (QEMU
# may pause the VM at its end), polling every HOLD_POLL_S meanwhile; a hold the VM has not
# paused in within HOLD_GRACE_S is released, and not made again for HOLD_BACKOFF_S. While no
# hold is on, QEMU's downtime limit is HOLD_BACK_MS: it pauses the VM by itself only when next
# to nothing is left.
HOLD_BACK_MS = 1
# Nothing pauses the VM until HOLD_GUARD_S after the hold (neither vmmgr, nor QEMU, which gets
# its limit only then): what the edge sent just before reaches the VM while it still runs.
HOLD_GUARD_S = 0.01
# QEMU reads a new downtime limit when it next measures the link: up to 100 ms later
# (BUFFER_DELAY in its migration.c). A hold given up is let go only once that has passed.
QEMU_LIMIT_LAG_S = 0.11
HOLD_LEAD_S = 0.04
HOLD_POLL_S = 0.01
HOLD_GRACE_S = 0.25
HOLD_BACKOFF_S = 1.0


# Once the source has paused for the switch-over, the rest must go: a target QEMU that stops
# taking it leaves the VM paused on its source for as long as it hangs, as libvirt waits without
# a limit (seen on the lab: a stopped target QEMU, 30 s paused with nothing left to send). A
# pause through which no byte more is sent for this long is given up: the job is aborted. (A
# forced pause's rest, however long, is sent on; a target host that dies ends the move by
# itself, through libvirt's keepalive.)
SWITCHOVER_STALL_S = 10.0
# The abort resumes the VM on its source if QEMU had not sent it all yet; if it had, the VM
# stays paused while libvirt waits for the target to load it (both seen on the lab, about half
# the runs each). Either way libvirt's call returns only once the target's side has ended,
# which a hung target QEMU never does: the call and the VM's lock would be held for ever. The
# target's copy is dropped this long after the abort, and tried again as often, but only once
# the source runs the VM again (`_Migration._drop_target`).
ABORT_GRACE_S = 10.0


def start(policy: Policy, now: float, can_hold: bool = False) -> tuple[Watch, list]:
    """The monitor's first state, and the downtime limit to set before the first pass."""
    w = Watch(started=now, best_at=now, downtime_ms=policy.downtime_start_ms, stepped_at=now,
              can_hold=can_hold, polled_at=now, pass_from=now)
    return w, [SetDowntime(HOLD_BACK_MS if can_hold else policy.downtime_start_ms)]


def decide_hold(w: Watch, remaining: int, iteration: int, now: float, dirty_bps: int,
                speed_bps: int) -> tuple[Watch, list]:
    """The edge holds the VM's packets from just before its pause, so none reach the paused
    source. QEMU pauses the VM at the end of a pass whose rest fits the downtime limit, a
    moment vmmgr cannot see coming from one pass to the next (a quiet guest's last passes take
    milliseconds). So QEMU's limit is held back (HOLD_BACK_MS) until the edge holds; the hold
    begins when the pass in flight is about to end, with the policy's limit for QEMU, and
    QEMU's pause (or vmmgr's, at the first poll past HOLD_GUARD_S where the rest fits the
    limit) follows within HOLD_GRACE_S; else
    the packets go on to the VM, still running on its source, the limit is held back again and
    the hold is tried again later."""
    if w.holding_since is None:
        # At the link's pace: a pass's tail is the guest's data, not the zeros that drain
        # faster (`polls_fast` watches closely at their pace all the same).
        pace = speed_bps or w.drain_bps
        if now < w.hold_again_at or pace <= 0:
            return w, []
        left_s = remaining / pace
        if left_s <= HOLD_LEAD_S:
            return replace(w, holding_since=now, limit_given=False), [Hold(
                f"pass {iteration} ends in about {left_s * 1000:.0f} ms")]
        return w, []
    if now - w.holding_since < HOLD_GUARD_S:
        return w, []
    if w.release_at is not None:  # given up: QEMU held back again, the hold goes after its lag
        if now < w.release_at:
            return w, []
        return replace(w, holding_since=None, limit_given=False, release_at=None,
                       hold_again_at=now + HOLD_BACKOFF_S), [Release(
            f"not switched over {HOLD_GRACE_S * 1000:.0f} ms after the hold")]
    estimate = paused_estimate_ms(w, remaining, dirty_bps, speed_bps, now)
    if iteration >= 2 and estimate is not None and estimate <= w.downtime_ms:
        # At once, whether or not QEMU has its limit yet (it reads a new one only at its next
        # measure of the link): a paused VM's migration completes once nothing is left to send.
        # Nor is it given after: a pause that fails must find QEMU still held back.
        return replace(w, finished=True), [SwitchOver(
            f"about {estimate:.0f} ms to send with the VM paused (limit {w.downtime_ms} ms)")]
    if not w.limit_given:  # held: QEMU may pause the VM as it would
        return replace(w, limit_given=True), [SetDowntime(w.downtime_ms)]
    if now - w.holding_since >= HOLD_GRACE_S:
        return replace(w, release_at=now + QEMU_LIMIT_LAG_S), [SetDowntime(HOLD_BACK_MS)]
    return w, []


def decide_paused(w: Watch, sent: int, now: float) -> tuple[Watch, list]:
    """A poll once the source has paused for the switch-over (by QEMU, by vmmgr, or forced),
    with the bytes the job has sent: abort if none more went for SWITCHOVER_STALL_S. (Sent, not
    left: a pause mid-pass adds what the guest dirtied before it to what is left.) An abort
    once QEMU has sent the last byte changes nothing: libvirt completes or fails the move as
    it would. (The monitor asks only while the source is not in post-copy: one asked for may
    not have been switched to, and then this is a pre-copy's switch-over like any other.)"""
    if w.gave_up_at is not None:
        return w, []
    if w.paused_sent is None or sent > w.paused_sent:
        return replace(w, paused_sent=sent, paused_still_since=now), []
    still = now - w.paused_still_since
    if still < SWITCHOVER_STALL_S:
        return w, []
    return replace(w, gave_up_at=now, finished=True), [Abort(
        f"nothing sent for {still:.0f} s with the VM paused for the switch-over: "
        "the target does not take it")]


# A target's QEMU that used no more CPU than this while the source's went unanswered is taken for
# hung (a stopped process uses none; one still reading the rest, however slowly, uses some).
TARGET_IDLE_CPU_NS = 20_000_000


def decide_unanswered(w: Watch, now: float, target_cpu_ns: int | None) -> tuple[Watch, list]:
    """A poll once the source has paused for the switch-over whose query of the job got no
    answer in time. QEMU (10.0) sends the tail of the VM (its last pages, its devices' state,
    the stream's end) holding its main lock, which its monitor needs; what can hang on storage
    comes before. So a source that does not answer is stuck sending that tail to a target that
    does not read it: the target cannot have the VM whole, nor start it (libvirt starts a
    target's vCPUs only once its QEMU has loaded it all). No answer for SWITCHOVER_STALL_S: the
    target's copy is dropped (every ABORT_GRACE_S), which fails the source's send, and libvirt
    resumes the VM there. (An abort could not get through: QEMU's `migrate_cancel` needs the
    same lock, and libvirt negotiates no out-of-band commands.) Only with the target seen idle
    all along, its QEMU's CPU time (`target_cpu_ns`, read without its monitor) not moving: a
    tail that goes slowly is not given up; a target whose CPU time cannot be read is never
    dropped. The monitor clears `unanswered_since` whenever the source answers. A post-copy
    asked for is left alone (unlike `decide_paused`'s abort, a drop is not harmless there: QEMU
    writes the post-copy package under the same lock, and a target dropped then leaves the
    source's post-copy failed, with no peer to resume it with)."""
    if w.postcopy or target_cpu_ns is None:
        return replace(w, unanswered_since=None), []
    if w.unanswered_since is None or target_cpu_ns - w.unanswered_cpu_ns > TARGET_IDLE_CPU_NS:
        return replace(w, unanswered_since=now, unanswered_cpu_ns=target_cpu_ns), []
    since = w.unanswered_since
    if now - since < SWITCHOVER_STALL_S or now < w.next_drop_at:
        return w, []
    return replace(w, next_drop_at=now + ABORT_GRACE_S), [DropTarget(
        f"the source's QEMU has not answered for {now - since:.0f} s with the VM paused for the "
        "switch-over, its target idle: it is stuck sending the rest to a target that does not "
        "take it",
        stuck=True)]


def after_giving_up(w: Watch, now: float) -> tuple[Watch, list]:
    """A poll after a stalled switch-over was aborted, libvirt's call not yet returned: drop
    the target's copy every ABORT_GRACE_S (the move drops it only once it is safe to)."""
    if w.gave_up_at is None or now < max(w.gave_up_at + ABORT_GRACE_S, w.next_drop_at):
        return w, []
    return replace(w, next_drop_at=now + ABORT_GRACE_S), [DropTarget(
        f"libvirt's call had not returned {now - w.gave_up_at:.0f} s after the abort")]


def stop_holding(w: Watch, actions: list, why: str = "") -> tuple[Watch, list]:
    """vmmgr gives the moment of the switch-over back to QEMU: before a decision that ends its
    steering (post-copy, an abort, a forced pause: none of them must find QEMU held back, should
    it fail), or when no hold came while the guest stalled at the top limit. A hold on stays
    for the switch-over that follows, but not for an abort."""
    if not w.can_hold:
        return w, actions
    before: list = [SetDowntime(w.downtime_ms)]
    if w.holding_since is not None and (why or any(isinstance(a, Abort) for a in actions)):
        before.append(Release(why or "the move is given up"))
        w = replace(w, holding_since=None)
    return replace(w, can_hold=False, release_at=None), before + actions


def polls_fast(w: Watch, remaining: int, speed_bps: int, poll_s: float, now: float) -> bool:
    """Whether the monitor should poll every HOLD_POLL_S: a hold is on, or due within a poll."""
    if not w.can_hold or w.finished or w.postcopy:
        return False
    if w.holding_since is not None:
        return True
    # Pages of zeros go at many times the link's speed: what is left may shrink faster.
    pace = max(speed_bps, w.drain_bps)
    return now >= w.hold_again_at and pace > 0 and remaining / pace <= 2 * poll_s + HOLD_LEAD_S


def paused_estimate_ms(w: Watch, remaining: int, dirty_bps: int, speed_bps: int,
                       now: float) -> float | None:
    """How long sending the rest would take with the VM paused now: what is left of this pass,
    plus what the guest dirtied since it began (at most since the poll before it was seen)."""
    if speed_bps <= 0:
        return None
    return (remaining + dirty_bps * (now - w.pass_from)) / speed_bps * 1000


def downtime_step(policy: Policy, current_ms: int) -> int:
    """The next downtime limit: equal steps from start to max, never beyond max."""
    if policy.downtime_steps <= 0:
        return current_ms
    step = max(1, (policy.downtime_max_ms - policy.downtime_start_ms) // policy.downtime_steps)
    return min(policy.downtime_max_ms, current_ms + step)


def in_disk_phase(stats: dict) -> bool:
    """Whether a migration is still copying local disks: libvirt mirrors them to the target
    before the memory's first pass, so QEMU has sent no memory yet."""
    return bool(stats.get("disk_total")) and not stats.get("memory_iteration") and not (
        stats.get("memory_processed"))


def decide_disk(policy: Policy, w: Watch, now: float) -> tuple[Watch, list]:
    """A poll in the disk phase: the memory's clocks start when its copy does (a disk over a
    WAN may take longer than a whole memory copy is allowed); a disk phase that outlasts the
    completion timeout is given up, the VM running on its source."""
    if w.finished:
        return w, []
    disk_started = w.started - w.disk_s  # the memory's clock was moved on by the disk phase
    if now - disk_started >= policy.completion_timeout_s:
        return replace(w, finished=True), [Abort(
            f"disk copy not done in the completion timeout ({policy.completion_timeout_s:g} s)")]
    held = now - w.started
    return replace(w, started=now, best_at=now, stepped_at=now, disk_s=w.disk_s + held), []


def decide(policy: Policy, w: Watch, remaining: int, iteration: int, now: float,
           dirty_bps: int = 0, speed_bps: int = 0,
           memory_left: int | None = None) -> tuple[Watch, list]:
    """One poll's decisions, from the bytes still to send and the pre-copy pass number (from 1);
    with a held switch-over also the guest's dirty rate, the link's speed (bytes/s) and what
    is left of the memory alone (a local disk's mirror counts in `remaining`, not in a pass)."""
    memory_left = remaining if memory_left is None else memory_left
    if w.finished or w.postcopy:
        return w, []  # post-copy cannot be steered back; an ordered abort or pause stands
    if iteration > w.iteration:
        if w.iteration >= 1 and (w.best_peak is None or w.pass_peak < w.best_peak):
            w = replace(w, best_peak=w.pass_peak, best_at=now)
        w = replace(w, iteration=iteration, pass_peak=remaining, pass_from=w.polled_at,
                    drain_bps=0)
    else:
        drained = w.last_remaining - memory_left
        w = replace(w, pass_peak=max(w.pass_peak, remaining), drain_bps=int(
            drained / (now - w.polled_at)) if drained > 0 and now > w.polled_at else 0)
    w = replace(w, polled_at=now, last_remaining=memory_left)
    stalled = now - max(w.best_at, w.stepped_at)
    elapsed = now - w.started

    timeout = None
    if elapsed >= policy.completion_timeout_s:
        timeout = f"completion timeout ({policy.completion_timeout_s:g} s)"
    elif now - w.best_at >= policy.progress_timeout_s:
        timeout = f"no progress for {policy.progress_timeout_s:g} s"
    if timeout:
        return stop_holding(*_on_timeout(policy, w, timeout))

    if w.can_hold:
        w, actions = decide_hold(w, memory_left, iteration, now, dirty_bps, speed_bps)
        if actions:
            return w, actions

    at_top = w.downtime_ms >= policy.downtime_max_ms
    if not at_top and iteration >= 2 and stalled >= policy.downtime_step_after_s:
        limit = downtime_step(policy, w.downtime_ms)
        # Held back, QEMU gets it with the next hold.
        held_back = w.can_hold and not (w.holding_since is not None and w.limit_given)
        return replace(w, downtime_ms=limit, stepped_at=now), [] if held_back else [
            SetDowntime(limit)]
    if at_top and w.can_hold and iteration >= 2 and stalled >= policy.downtime_step_after_s:
        return stop_holding(replace(w, stepped_at=now), [],
                            f"no switch-over within the top limit ({w.downtime_ms} ms)")
    if (at_top and policy.postcopy and iteration >= 2
            and stalled >= policy.postcopy_after_stall_s):
        reason = f"stalled {stalled:.1f} s at the top downtime limit ({w.downtime_ms} ms)"
        return stop_holding(replace(w, postcopy=True), [StartPostCopy(reason)])
    return w, []


def _on_timeout(policy: Policy, w: Watch, why: str) -> tuple[Watch, list]:
    if policy.on_timeout == "abort":
        return replace(w, finished=True), [Abort(why)]
    if policy.postcopy:
        return replace(w, postcopy=True), [StartPostCopy(why)]
    return replace(w, finished=True), [Pause(why)]


def warning(dirty_rate_bps: int, speed_bps: int, auto_converge: bool) -> str | None:
    """What to tell the operator when the guest outpaces the link."""
    if speed_bps and dirty_rate_bps > speed_bps:
        action = "throttling" if auto_converge else "not throttling (auto-converge off)"
        return f"dirtying memory faster than it can be sent; {action}"
    return None
