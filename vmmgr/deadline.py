"""The deadline planner: how each VM leaves a host that must be empty by a deadline, in what order
and how many at once, so that every VM is safe in time: running on another host, or saved whole
on shared storage.

Pure: it works from each VM's memory and measured dirty rate, the link's and the storage's
measured bandwidth, what moves send of a VM's memory and what they spend outside the copy, and
where placement found room; the executor (`deadline_run.reclaim_by`) measures, asks, carries the
plan out and asks again as each move ends, with the rates it saw.

The model. Migrations share the link and saves share the storage, and the two run side by side.
A migration stream gets `link_mibps` until `link_total_mibps` is shared out while it copies, and
leaves the link idle while it sets up and switches over; streams beyond what fills the link
buy nothing ("streams that pay", `Rates.streams_for`). Pre-copy sends the memory once (what of
it the guest touched: `sent_fraction`) and then what the guest dirtied meanwhile: about
`memory / (bw - dirty)` in all. A guest that dirties more than half the stream's rate is
switched to post-copy after its first pass (`memory / bw`), which is bounded whatever it
dirties. A save writes the memory once (the guest is paused); a guest hibernation does the same
from inside the guest, with the boot and the shutdown around it. Each move also pays a fixed
overhead (setup, switch-over, records).

Choices, in order: every VM safe before the deadline; then as many VMs as possible still running
(migrated rather than parked); then the earliest end. A job's VMs (`group`) go the same way: all
migrate, or all are parked and resumed together. On the link the longest moves go first: the
move whose estimate is least sure (a big or busy guest) gets the most slack, and the short ones
behind it can still be re-planned into saves if the link proves slower. Saves, whose time is
sure, go shortest first, so that as many VMs as possible are safe early. Where longest-first
would leave more VMs late than shortest-first (a deadline nothing meets), shortest-first is
kept. When not everything can be safe in time the plan says so (`late`) before anything starts,
and still saves the most it can.
"""

from dataclasses import dataclass, field, replace

from .errors import InvalidRequest

POSTCOPY_ABOVE = 0.5  # dirty rate / stream rate above which pre-copy is not worth waiting on
MAX_STREAMS = 4  # migrations at once from one host, however slow each is


@dataclass(frozen=True)
class Rates:
    link_mibps: float = 110.0  # one migration stream between two hosts
    link_total_mibps: float = 220.0  # all streams together
    storage_mibps: float = 200.0  # all saves together, to shared storage
    save_streams: int = 2  # saves at once
    overhead_s: float = 3.0  # per move: the task round trip, setup, switch-over, records
    hibernate_overhead_s: float = 10.0  # the guest's own suspend and power-off
    # what a migration or a save sends of a VM's memory: pages the guest never touched go as
    # zero flags (an idle 128 MiB guest sends about 92 MiB)
    sent_fraction: float = 1.0

    def sent_mib(self, memory_mib: float) -> float:
        return memory_mib * self.sent_fraction

    @property
    def link_streams(self) -> int:  # streams that fill the link while they copy
        return streams_that_pay(self.link_total_mibps, self.link_mibps)

    def streams_for(self, memory_mib: float) -> int:
        """Migrations at once that pay for moves of about `memory_mib` each. A move holds the
        link only while it copies: while it sets up and switches over (`overhead_s`) the link
        idles unless another move copies meanwhile."""
        copy_s = self.sent_mib(memory_mib) / max(self.link_mibps, 1e-9)
        use = self.link_mibps * copy_s / (copy_s + self.overhead_s)  # a stream's mean rate
        return min(MAX_STREAMS, streams_that_pay(self.link_total_mibps, use))


def streams_that_pay(total_mibps: float, stream_mibps: float) -> int:
    """Streams at once over a link: one more pays while it adds at least half a stream's worth
    (a link of 1.9 streams' rate left at one stream idles almost half of it)."""
    return max(1, int(total_mibps / max(stream_mibps, 1e-9) + 0.5))


@dataclass(frozen=True)
class Candidate:
    name: str
    memory_mib: int
    dirty_mibps: float = 0.0
    live: bool = True  # False: a device blocks live migration and a save; the guest hibernates
    target: str | None = None  # where placement found room; None: nowhere
    group: str = ""
    # What a move to `target` measured on the wire before (a WAN between sites is slower than
    # the LAN the defaults assume); None: nothing measured, the fleet's rate holds.
    link_mibps: float | None = None
    # A local disk's data (`local_disks`): copied before the memory by a migration, kept beside
    # the save by a suspend; never by post-copy.
    disk_mib: float = 0.0
    # The base image under that disk when the target's storage lacks it (another site): a
    # migration sends it first (`site_images`); a suspend keeps only the disk.
    base_mib: float = 0.0
    # A move's time outside the copy measured over that link (a WAN's round trips); None:
    # nothing measured, the fleet's `Rates.overhead_s` holds.
    overhead_s: float | None = None


@dataclass(frozen=True)
class Move:
    vm: str
    how: str  # "migrate", "postcopy", "suspend" or "hibernate"
    target: str | None  # for migrate/postcopy, and for a hibernation that resumes elsewhere
    start_s: float  # estimated, from the plan's start
    end_s: float
    reason: str

    @property
    def resource(self) -> str:
        return "link" if self.how in ("migrate", "postcopy") else "storage"


@dataclass
class Plan:
    moves: list[Move]
    deadline_s: float
    late: list[str] = field(default_factory=list)  # estimated to miss the deadline
    link_streams: int = 1  # migrations at once

    @property
    def feasible(self) -> bool:
        return not self.late

    @property
    def end_s(self) -> float:
        return max((m.end_s for m in self.moves), default=0.0)

    def summary(self) -> str:
        kinds = {}
        for m in self.moves:
            kinds[m.how] = kinds.get(m.how, 0) + 1
        ways = ", ".join(f"{n} {how}" for how, n in sorted(kinds.items())) or "nothing to move"
        head = (f"plan: {ways}; all safe in ~{self.end_s:.0f} s of {self.deadline_s:.0f} s"
                if self.feasible else
                f"plan: {ways}; cannot save everything in time: {len(self.late)} of "
                f"{len(self.moves)} VMs ({', '.join(self.late)}) would be safe only after "
                f"~{self.end_s:.0f} s of {self.deadline_s:.0f} s; saving the most it can")
        return head


def migration_seconds(c: Candidate, bw_mibps: float, rates: Rates) -> tuple[str, float]:
    """("migrate" or "postcopy", estimated seconds) for one stream of `bw_mibps`."""
    sent = rates.sent_mib(c.memory_mib)
    overhead = rates.overhead_s if c.overhead_s is None else c.overhead_s
    # the base image a site lacks, then the disk's mirror, first; neither is compressed
    disk_s = (c.base_mib + c.disk_mib) / bw_mibps
    if c.dirty_mibps > POSTCOPY_ABOVE * bw_mibps:
        if not c.disk_mib:
            return "postcopy", sent / bw_mibps + overhead
        # with a local disk, pre-copy throttled (auto-converge) to what post-copy would leave
        return "migrate", disk_s + sent / ((1 - POSTCOPY_ABOVE) * bw_mibps) + overhead
    return "migrate", disk_s + sent / (bw_mibps - c.dirty_mibps) + overhead


def save_seconds(c: Candidate, bw_mibps: float, rates: Rates) -> tuple[str, float]:
    if c.live:
        return "suspend", ((rates.sent_mib(c.memory_mib) + c.disk_mib) / bw_mibps
                           + rates.overhead_s)
    return "hibernate", c.memory_mib / bw_mibps + rates.hibernate_overhead_s


def plan(vms: list[Candidate], deadline_s: float, rates: Rates) -> Plan:
    """The plan that makes every VM safe soonest, preferring migration where time allows."""
    # no more streams than the executor runs (a slow stream's rate must not promise eight)
    rates = replace(rates, link_total_mibps=min(rates.link_total_mibps,
                                                rates.link_mibps * MAX_STREAMS))
    units = _units(vms)
    # Start from "every unit that can migrate does", then move the unit that frees the most
    # link time to storage while that ends everything sooner and keeps the deadline in sight.
    on_link = {key for key, members in units.items() if _can_migrate(members)}
    best = _schedule(units, on_link, deadline_s, rates)
    while True:
        if _end(best) <= deadline_s:
            break  # in time with the most migrations this greedy walk allows
        trial = None
        for key in sorted(on_link, key=lambda k: -_link_seconds(units[k], rates)):
            candidate = _schedule(units, on_link - {key}, deadline_s, rates)
            if _better(candidate, best):
                trial = (key, candidate)
                break
        if trial is None:
            break
        on_link.discard(trial[0])
        best = trial[1]
    best.late = sorted(m.vm for m in best.moves if m.end_s > deadline_s)
    return best


def _units(vms: list[Candidate]) -> dict[str, list[Candidate]]:
    units: dict[str, list[Candidate]] = {}
    for vm in vms:
        units.setdefault(f"group:{vm.group}" if vm.group else f"vm:{vm.name}", []).append(vm)
    return units


def _can_migrate(members: list[Candidate]) -> bool:
    return all(m.live and m.target for m in members)


def _link_seconds(members: list[Candidate], rates: Rates) -> float:
    return sum(migration_seconds(m, _stream(m, rates.link_mibps), rates)[1] for m in members)


def _link_words(c: Candidate, link_bw: float, rates: Rates) -> str:
    """What the plan's reason says of a link slower than the fleet's: its rate, and its time
    outside the copy (a WAN's round trips), as moves over it measured them."""
    slow = []
    if c.link_mibps and c.link_mibps < link_bw:
        slow.append(f"{c.link_mibps:g} MiB/s")
    if c.overhead_s is not None and c.overhead_s > rates.overhead_s:
        slow.append(f"{c.overhead_s:g} s a move outside its copy")
    return f", over a link measured at {' and '.join(slow)}" if slow else ""


def _stream(c: Candidate, bw_mibps: float) -> float:
    """A stream's rate for this VM: the fleet's share, or less over a link measured slower."""
    return min(bw_mibps, c.link_mibps) if c.link_mibps else bw_mibps


def _schedule(units, on_link: set[str], deadline_s: float, rates: Rates,
              streams: int | None = None) -> Plan:
    """The link's moves longest first, unless shortest first leaves fewer VMs late."""
    longest = _schedule_in(units, on_link, deadline_s, rates, streams, longest_first=True)
    shortest = _schedule_in(units, on_link, deadline_s, rates, streams, longest_first=False)
    return shortest if _late(shortest) < _late(longest) else longest


def _schedule_in(units, on_link: set[str], deadline_s: float, rates: Rates,
                 streams: int | None, longest_first: bool) -> Plan:
    if streams is None:  # the planner's: as many as pay for the moves it puts on the link
        sizes = sorted(m.memory_mib for k in on_link for m in units[k]) or [0]
        streams = rates.streams_for(sizes[len(sizes) // 2])
    link_bw = min(rates.link_mibps, rates.link_total_mibps / streams)
    save_bw = rates.storage_mibps / max(1, rates.save_streams)
    link_jobs, storage_jobs = [], []
    for key, members in units.items():
        for m in members:
            if key in on_link:
                how, secs = migration_seconds(m, _stream(m, link_bw), rates)
                link_jobs.append((secs, m, how, m.target,
                                  f"{m.target} has room{_link_words(m, link_bw, rates)}"))
            else:
                how, secs = save_seconds(m, save_bw, rates)
                target = m.target if how == "hibernate" else None
                why = ("a device blocks live migration" if not m.live else
                       "no host has room" if not m.target else
                       f"its job {m.group!r} moves as one and a peer cannot migrate"
                       if not _can_migrate(members) else "the link cannot carry it in time")
                storage_jobs.append((secs, m, how, target, why))
    moves = (_list_schedule(link_jobs, streams, longest_first)
             + _list_schedule(storage_jobs, rates.save_streams))
    return Plan(sorted(moves, key=lambda mv: (mv.start_s, mv.vm)), deadline_s,
                link_streams=streams)


def _list_schedule(jobs, slots: int, longest_first: bool = False) -> list[Move]:
    """Shortest (or longest) first onto whichever of `slots` frees first."""
    free = [0.0] * max(1, slots)
    moves = []
    sign = -1 if longest_first else 1
    for secs, vm, how, target, why in sorted(jobs, key=lambda j: (sign * j[0], j[1].name)):
        i = min(range(len(free)), key=free.__getitem__)
        moves.append(Move(vm.name, how, target, free[i], free[i] + secs, why))
        free[i] += secs
    return moves


def _end(p: Plan) -> float:
    return p.end_s


def _late(p: Plan) -> int:
    return sum(m.end_s > p.deadline_s for m in p.moves)


def _better(a: Plan, b: Plan) -> bool:
    """Fewer VMs late, then an earlier end."""
    return (_late(a), a.end_s) < (_late(b), b.end_s)


# What the planner is measured against (`./run bench-reclaim`), carried out by the same executor.
NAIVE = ("all-at-once", "one-at-a-time", "suspend-all")


def naive(vms: list[Candidate], strategy: str, deadline_s: float,
          rates: Rates) -> tuple[Plan, Rates]:
    """A naive strategy's plan and the parallelism it runs with: every VM with room migrates,
    all at once or one at a time; or every VM is saved, all at once. No clock in the choice."""
    units = _units(vms)
    n = max(1, len(vms))
    if strategy == "suspend-all":
        run_with = replace(rates, save_streams=n)
        on_link: set[str] = set()
    elif strategy in ("all-at-once", "one-at-a-time"):
        streams = n if strategy == "all-at-once" else 1
        run_with = replace(rates, link_total_mibps=rates.link_mibps * streams)
        on_link = {key for key, members in units.items() if _can_migrate(members)}
    else:
        raise ValueError(f"unknown strategy {strategy!r} (known: {', '.join(NAIVE)})")
    p = _schedule_in(units, on_link, deadline_s, run_with, run_with.link_streams,
                     longest_first=False)
    p.late = sorted(m.vm for m in p.moves if m.end_s > deadline_s)
    return p, run_with


def parse_duration(text: str) -> float:
    """Seconds from `30`, `30s`, `2m` or `1h`: more than 0, at most a day."""
    units = {"s": 1, "m": 60, "h": 3600}
    raw = text.strip()
    unit = units.get(raw[-1:], None)
    digits = raw[:-1] if unit else raw
    if not (digits.isascii() and digits.replace(".", "", 1).isdecimal()):
        raise InvalidRequest(f"{text[:40]!r} is not a duration (30s, 2m, 1h)")
    seconds = float(digits) * (unit or 1)
    if not 0 < seconds <= 86400:
        raise InvalidRequest(f"a deadline must be more than 0 s and at most a day, not {text!r}")
    return seconds
