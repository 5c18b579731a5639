"""A reclaim against a deadline, carried out: measure, plan (`deadline.plan`), move, re-plan.

The deadline is a wall-clock instant (a notice's), so a rerun of the same task after a dead worker
plans what is left against the time that is left. Each VM's outcome is logged against it: safe at
what second, by which way, within the deadline or not. Every move goes through the operation's one
body (`operations`), under the VM's lock, as a plain reclaim's moves do.
"""

import math
import threading
import time
from dataclasses import dataclass, field, replace

from . import deadline, local_disks, metrics, os_images, site_images
from .errors import NotFound, VmmgrError
from .fleet import Fleet
from .guest import read_each
from .reclaim import (EvacuationReport, Step, _size, _wait_for_jobs, finish, plan_evacuation,
                      run_step)

DIRTY_SAMPLE_S = 1
MAX_STREAMS = deadline.MAX_STREAMS
RATES = "vmmgr:rates"  # measured link and storage bandwidths, MiB/s, kept between reclaims


@dataclass
class DeadlineReport(EvacuationReport):
    deadline_s: float = 0.0  # the time the reclaim had, from its start
    plan: str = ""
    safe_at: dict[str, float] = field(default_factory=dict)  # VM -> seconds from the start
    late: list[str] = field(default_factory=list)  # safe after the deadline, or never


def reclaim_by(fleet: Fleet, host: str, deadline_at: float, report,
               rates: deadline.Rates | None = None, strategy: str = "plan") -> DeadlineReport:
    """Empty `host` so that every VM is safe by `deadline_at` (unix time) if it can be.
    `strategy`: the planner's, or one of `deadline.NAIVE` (what the benchmark compares)."""
    fleet.host(host)  # NotFound for an unknown host
    fleet.inventory.set_state(host, "draining")
    t0, wall0 = time.monotonic(), time.time()
    budget = deadline_at - wall0
    say = lambda msg, **kw: report.event(msg, host=host, **kw)  # noqa: E731
    say(f"{host}: draining; everything must be safe within {budget:.0f} s")
    source = fleet.host(host)
    _wait_for_jobs(source, say, timeout=max(1.0, budget / 4))
    listed = source.guests()
    sizes = [s for s in read_each(listed, lambda g: _size(g, fleet.paths.storage)) if s]
    guests = [g for g in listed if g.name in {s.name for s in sizes}]
    groups = dict(read_each(guests, lambda g: (g.name, g.group())))
    dirty = _dirty_rates(guests)
    disks = dict(read_each(guests, lambda g: (g.name, _disk_mib(g))))
    rates = rates or measured_rates(fleet.state.r)
    steps = {s.vm: s for s in plan_evacuation(sizes, fleet.active_capacities(exclude=host), True,
                                              fleet.sites(), host)}
    by_name, bases = {g.name: g for g in guests}, {}
    candidates = {s.name: deadline.Candidate(
        s.name, s.memory_mib, dirty.get(s.name, 0.0), s.live,
        steps[s.name].target, groups.get(s.name, ""),
        _link(fleet, host, steps[s.name].target), disks.get(s.name, 0.0),
        _base_mib(fleet, by_name[s.name], steps[s.name].target, bases)
        if disks.get(s.name) else 0.0,
        _link_overhead(fleet, host, steps[s.name].target)) for s in sizes}
    budget = deadline_at - time.time()
    if strategy == "plan":
        plan, run_with = deadline.plan(list(candidates.values()), budget, rates), rates
    else:
        plan, run_with = deadline.naive(list(candidates.values()), strategy, budget, rates)
    say(f"{host}: {plan.summary()} (rates: link {rates.link_mibps:.0f} MiB/s a stream, "
        f"storage {rates.storage_mibps:.0f} MiB/s; dirty {_dirty_words(dirty)})", kind="plan")
    outcome = DeadlineReport(host, [], [], {}, 0.0, deadline_s=round(deadline_at - wall0, 1),
                             plan=plan.summary())
    _carry_out(fleet, report, plan, candidates, deadline_at, run_with, outcome, t0,
               replanning=strategy == "plan")
    finish(fleet, host, outcome, "reclaim", t0, say)
    outcome.late = sorted(set(candidates) - {v for v, s in outcome.safe_at.items()
                                             if s <= outcome.deadline_s})
    met = len(candidates) - len(outcome.late)
    say(f"{host}: {met} of {len(candidates)} VMs safe within the {outcome.deadline_s:.0f} s "
        f"deadline" + (f"; late or not saved: {', '.join(outcome.late)}" if outcome.late else ""),
        kind="plan")
    metrics.count(fleet.state.r, "deadline_vms", "met", by=met)
    metrics.count(fleet.state.r, "deadline_vms", "missed", by=len(outcome.late))
    return outcome


def _carry_out(fleet, report, plan, candidates, deadline_at, rates, outcome, t0,
               replanning: bool = True) -> None:
    """Each resource's moves in the plan's order, as many at once as pay; before a migration
    starts, it is re-planned on the rates measured so far and turns into a save if it would
    now end after the deadline while a save would not (that save queues first for storage,
    within its streams like the planned ones). When migrations prove slower than the
    link (a stream bound by the CPU or by latency), more run at once: as many as pay at the
    measured rate of one (`Rates.streams_for`)."""
    lock = threading.Lock()
    queues = {"link": [m for m in plan.moves if m.resource == "link"],
              "storage": [m for m in plan.moves if m.resource == "storage"]}
    seen = {"link": rates.link_mibps, "storage": rates.storage_mibps / max(1, rates.save_streams)}
    samples = {"link": 0, "storage": 0}
    per_target = MAX_STREAMS if replanning else max(2, rates.link_streams)
    slots = {s: threading.Semaphore(per_target) for s in {m.target for m in plan.moves if m.target}}

    active = {"link": 0, "storage": 0}  # workers still taking moves from their queue
    save_streams = max(1, min(rates.save_streams, MAX_STREAMS))
    saving_mib = [0]  # what the running saves write
    replanned: set[str] = set()  # saves re-planned from migrations, still queued

    def next_move(resource: str):
        with lock:
            if queues[resource]:
                return queues[resource].pop(0)
            active[resource] -= 1  # this worker takes no more: a later save starts its own
            return None

    def worker(resource: str) -> None:
        drained = False
        try:
            while (move := next_move(resource)) is not None:
                try:
                    carry(resource, move)
                except Exception as err:  # noqa: BLE001 - e.g. the store away as it reported:
                    with lock:            # a VM not moved is named; the next moves go on
                        if move.vm not in (*outcome.migrated, *outcome.suspended,
                                           *outcome.hibernated):
                            outcome.failed.setdefault(move.vm, f"{type(err).__name__}: {err}")
            drained = True  # next_move counted this worker out
        finally:
            if not drained:  # a surprise outside a step: the queue must not be left unserved
                with lock:
                    active[resource] -= 1
                    if queues[resource] and not active[resource]:
                        start(resource)

    def carry(resource: str, move) -> None:
        c = candidates[move.vm]
        if resource == "link" and replanning:
            with lock:
                ahead = saving_mib[0] + sum(_mib(candidates[v]) for v in replanned)
            move = _replanned(move, c, deadline_at, replace(
                rates, link_mibps=seen["link"]), report, storage_ahead_mib=ahead)
            if move.resource == "storage":  # a save takes one of storage's streams, before
                with lock:                  # the planned saves, after earlier re-planned ones
                    queued = {m.vm for m in queues["storage"]}
                    queues["storage"].insert(len(replanned & queued), move)
                    replanned.add(move.vm)
                    if active["storage"] < save_streams:
                        start("storage")
                return
        if resource == "storage":
            with lock:
                replanned.discard(move.vm)
                saving_mib[0] += _mib(c)
        started = time.monotonic()
        if resource == "link" and not replanning:
            move = replace(move, how="migrate")
        how = {"migrate": "migrate", "postcopy": "migrate", "suspend": "suspend",
               "hibernate": "hibernate" if move.target else "suspend"}[move.how]
        step = Step(move.vm, how, move.target, move.reason,
                    policy="never-fail" if move.how == "postcopy" else None,
                    early_postcopy=move.how == "postcopy")
        try:
            run_step(fleet, report, step, outcome, slots, deadline=True)
        except Exception as err:  # noqa: BLE001 - one VM's surprise must not stop the rest
            outcome.failed[move.vm] = f"{type(err).__name__}: {err}"
            report.event(f"{move.vm}: {type(err).__name__}: {err}", vm=move.vm)
        finally:
            if resource == "storage":
                with lock:
                    saving_mib[0] -= _mib(c)
        spent = time.monotonic() - started
        safe = move.vm not in outcome.failed
        with lock:
            if safe:
                outcome.safe_at[move.vm] = round(time.monotonic() - t0, 1)
            # a move that went the way it was planned tells how fast its resource is
            kind = ("link" if move.vm in outcome.migrated and move.resource == "link" else
                    "storage" if move.vm in outcome.suspended and move.how == "suspend"
                    else None)
            if kind:  # the first measurement replaces the prior; later ones average in
                # over a link that measured its own time outside the copy (a WAN's), that
                overhead = (c.overhead_s if kind == "link" and c.overhead_s is not None
                            else rates.overhead_s)
                rate = ((rates.sent_mib(c.memory_mib) + c.disk_mib)
                        / max(0.1, spent - overhead))
                seen[kind] = rate if not samples[kind] else 0.5 * seen[kind] + 0.5 * rate
                samples[kind] += 1
            if kind == "link" and replanning:
                pay = replace(rates, link_mibps=seen["link"]).streams_for(c.memory_mib)
                while len(running["link"]) < min(MAX_STREAMS, pay, len(queues["link"]) +
                                                 len(running["link"])):
                    start("link")
        if safe:
            at = outcome.safe_at[move.vm]
            report.event(f"{move.vm}: safe at {at:.1f} s by {move.how} "
                         f"({'within' if at <= outcome.deadline_s else 'AFTER'} the "
                         f"{outcome.deadline_s:.0f} s deadline)", vm=move.vm, kind="plan")

    running: dict[str, list[threading.Thread]] = {"link": [], "storage": []}
    threads: list[threading.Thread] = []

    def start(resource: str) -> None:  # with `lock` held, or before any worker runs
        active[resource] += 1
        t = threading.Thread(target=worker, args=(resource,),
                             name=f"reclaim-{resource}-{len(running[resource])}")
        running[resource].append(t)
        threads.append(t)
        t.start()

    with lock:
        for resource, n in (("link", plan.link_streams), ("storage", rates.save_streams)):
            for _ in range(min(n, MAX_STREAMS) if replanning else n):  # naive: as told
                start(resource)
    joined = 0
    while True:  # workers started meanwhile are joined too
        with lock:
            if joined == len(threads):
                break
            t = threads[joined]
        t.join()
        joined += 1
    if replanning:  # a naive strategy's rates are not the planner's to learn from
        _remember(fleet.state.r, seen, rates)


def _replanned(move, c, deadline_at, rates, report, storage_ahead_mib: float = 0.0):
    left = deadline_at - time.time()
    how, secs = deadline.migration_seconds(c, rates.link_mibps, rates)
    _, save = deadline.save_seconds(c, rates.storage_mibps / max(1, rates.save_streams), rates)
    # the save shares storage with what it already writes and waits behind earlier re-plans
    save = max(save, (storage_ahead_mib + _mib(c)) / rates.storage_mibps + rates.overhead_s)
    if secs > left and save <= left and not c.group:
        report.event(f"{c.name}: re-planned: a migration would now take ~{secs:.0f} s of the "
                     f"{left:.0f} s left, a save ~{save:.0f} s; saving it", vm=c.name, kind="plan")
        return replace(move, how="suspend", target=None, reason="re-planned: the link is slower")
    return replace(move, how=how)


def _mib(c: deadline.Candidate) -> float:
    """What saving the VM writes to storage: its memory and its local disk."""
    return c.memory_mib + c.disk_mib


def _base_mib(fleet: Fleet, guest, target: str | None, known: dict) -> float:
    """The MiB of the base image a move of this local-disk VM to `target` sends first, its
    storage lacking it (0: it holds it, or no target). Every move to that target pays it: each
    waits for the one copy. Asked once per target and image (`known`); an unreadable answer
    costs the estimate, never the reclaim."""
    if target is None:
        return 0.0
    try:
        _, base = local_disks.overlay_of(guest.connection(), guest.name)
        if not site_images.is_image_disk(base):
            return 0.0
        if (target, base) not in known:  # not told (a copy to it runs): counted
            known[target, base] = 0.0 if site_images.holds(fleet, target, base) else (
                os_images.get(fleet.paths.images, site_images.image_name(base)).size / 2**20)
        return known[target, base]
    except VmmgrError:
        return 0.0


def _disk_mib(guest) -> float:
    """Its local disk's data, for the estimate; an unreadable pool costs the estimate, never
    the reclaim."""
    try:
        return local_disks.data_mib(guest)
    except NotFound:
        raise
    except VmmgrError:
        return 0.0


def _dirty_rates(guests) -> dict[str, float]:
    """Each running guest's dirty rate, sampled for all at once (DIRTY_SAMPLE_S)."""
    started = [g for g in guests if _try(g.start_dirty_rate, DIRTY_SAMPLE_S) is not _FAILED]
    if not started:
        return {}
    time.sleep(DIRTY_SAMPLE_S + 0.2)
    out = {}
    for g in started:
        for _ in range(10):
            rate = _try(g.dirty_rate_mibps)
            if isinstance(rate, float):  # None: still measuring
                out[g.name] = rate
                break
            if rate is _FAILED:
                break
            time.sleep(0.1)
    return out


_FAILED = object()


def _try(fn, *args):
    try:
        return fn(*args)
    except VmmgrError:
        return _FAILED


def _dirty_words(dirty: dict[str, float]) -> str:
    return ", ".join(f"{vm} {r:.0f}" for vm, r in sorted(dirty.items())) or "not measured"


def _link(fleet: Fleet, source: str, target: str | None) -> float | None:
    """The rate a move from `source` to `target` measured last (a WAN between sites shows)."""
    return fleet.state.link_mibps(source, target) if target else None


def _link_overhead(fleet: Fleet, source: str, target: str | None) -> float | None:
    """A move's time outside the copy that moves from `source` to `target` measured."""
    return fleet.state.link_overhead_s(source, target) if target else None


def measured_rates(r) -> deadline.Rates:
    """The defaults, with what earlier moves measured where there is some: the bandwidths
    (reclaims), the share of memory a move sends and its time outside the copy (every live
    migration, `FleetState.learn_move`)."""
    seen = r.hgetall(RATES) or {}
    base = deadline.Rates()
    link = _positive(seen.get("link_mibps")) or base.link_mibps
    storage = _positive(seen.get("storage_mibps")) or base.storage_mibps
    sent = min(1.0, _positive(seen.get("sent_fraction")) or base.sent_fraction)
    overhead = _positive(seen.get("overhead_s")) or base.overhead_s
    return replace(base, link_mibps=link, link_total_mibps=max(base.link_total_mibps, link),
                   storage_mibps=storage, sent_fraction=sent, overhead_s=overhead)


def _remember(r, seen: dict, rates: deadline.Rates) -> None:
    r.hset(RATES, mapping={"link_mibps": f"{seen['link']:.1f}",
                           "storage_mibps": f"{seen['storage'] * max(1, rates.save_streams):.1f}"})


def _positive(text) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if value > 0 and math.isfinite(value) else None
