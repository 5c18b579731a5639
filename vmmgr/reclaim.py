"""Reclaim and drain: empty a host without killing anything on it.

`reclaim` has a deadline: every VM that fits elsewhere is live-migrated (several at once, at most
`per_target` into any one host), and every VM that does not is suspended to disk and parked.
`drain` has none: it migrates what fits and waits for room for the rest. Either way the host takes
no new VMs from the start and ends `reclaimed` (empty, out of service) until `enable`.
`resume_parked` brings suspended VMs back, oldest first, wherever there is room: it runs when a host
is enabled and on every reconcile.

The plan is a pure function over capacities; the executor here only carries it out, each step
through the operation's one body (`operations`), which takes the VM's lock, keeps its records and
reports to the same report as the whole.
"""

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import devices, local_disks, metrics, operations, suspend
from .errors import VmmgrError
from .fleet import Fleet
from .guest import Guest, read_each
from .host import Capacity, Host
from .placement import choose_host
from .policy import EARLY_POSTCOPY


@dataclass(frozen=True)
class Step:
    vm: str
    action: str  # "migrate", "hibernate" (then resume on target), "suspend" or "wait"
    target: str | None
    reason: str
    policy: str | None = None  # the migration policy; None: the default
    early_postcopy: bool = False  # post-copy right after the first pass (a deadline's choice)


@dataclass(frozen=True)
class VMSize:
    name: str
    memory_mib: int
    vcpus: int
    device_model: str = ""
    device_count: int = 0
    live: bool = True  # False: a device blocks live migration; the VM moves by hibernating
    site_bound: bool = False  # a disk on its site's storage: it stays in that site


def plan_evacuation(vms: list[VMSize], capacities: dict[str, Capacity], deadline: bool,
                    site_of: dict[str, str] | None = None, source: str = "") -> list[Step]:
    """Where each VM goes: largest first onto the host with most room, room reserved as it goes;
    inside the site of `source` (the host being emptied) while it has room, then elsewhere.

    Hosts in `capacities` are the ones allowed to take VMs (not the one being emptied).
    """
    room = dict(capacities)
    site_of = site_of or {}
    near = site_of.get(source, "") if source else None
    steps = []
    for vm in sorted(vms, key=lambda v: (-v.memory_mib, v.name)):
        allowed = room
        if vm.site_bound and near is not None and any(site_of.values()):
            allowed = {h: c for h, c in room.items() if site_of.get(h, "") == near}
        target, refused = choose_host(allowed, vm.memory_mib, vm.vcpus, vm.device_model,
                                      vm.device_count, site_of, near)
        if target:
            room[target] = reserve(room[target], vm)
            where = _where(site_of, source, target)
            if vm.live:
                steps.append(Step(vm.name, "migrate", target, f"{target} has the most room{where}"))
            else:
                steps.append(Step(vm.name, "hibernate", target,
                                  f"{target} has room and a free {vm.device_model}{where}"))
        else:
            why = "; ".join(f"{h}: {r}" for h, r in refused.items()) or "no other active host"
            if allowed is not room:
                why = f"its disk on site {near or '-'}'s storage keeps it there; {why}"
            steps.append(Step(vm.name, "suspend" if deadline else "wait", None, f"no room ({why})"))
    return steps


def _where(site_of: dict[str, str], source: str, target: str) -> str:
    """How a step's reason names the sites, when the fleet names any."""
    if not source or not any(site_of.values()):
        return ""
    here, there = site_of.get(source, "") or "-", site_of.get(target, "") or "-"
    if here == there:
        return f" in site {here}"
    return f": a cross-site move ({here} -> {there}), no room left in {here}"


@dataclass
class EvacuationReport:
    host: str
    migrated: list[str]
    suspended: list[str]
    failed: dict[str, str]
    seconds: float
    hibernated: list[str] = field(default_factory=list)  # moved by guest hibernation


def evacuate(fleet: Fleet, host: str, deadline: bool, report, per_target: int = 2,
             parallel: int = 3, wait_timeout: float = 600) -> EvacuationReport:
    """Empty `host`: reclaim (deadline=True) or drain (deadline=False)."""
    fleet.host(host)  # NotFound for an unknown host
    fleet.inventory.set_state(host, "draining")
    on_event = _host_events(report, host)
    on_event(f"{host}: draining (takes no new VMs)")
    t0 = time.monotonic()
    outcome = EvacuationReport(host, [], [], {}, 0.0)
    while True:
        source = fleet.host(host)
        # A job already running here (a migration or save an earlier, dead run started) ends
        # first: libvirt finishes it without its caller, and the plan must see where VMs ended up.
        _wait_for_jobs(source, on_event, timeout=wait_timeout)
        vms = [v for v in read_each(source.guests(), lambda g: _size(g, fleet.paths.storage))
               if v]
        if not vms:
            break
        steps = plan_evacuation(vms, fleet.active_capacities(exclude=host), deadline,
                                fleet.sites(), host)
        _carry_out(fleet, steps, outcome, per_target, parallel, deadline, report)
        if deadline or time.monotonic() - t0 > wait_timeout:
            break
        if all(s.action == "wait" for s in steps):
            time.sleep(2)  # drain: wait for room
    return finish(fleet, host, outcome, "reclaim" if deadline else "drain", t0, on_event)


def finish(fleet: Fleet, host: str, outcome, kind: str, t0: float, on_event):
    """The end of an evacuation: the host `reclaimed` if nothing is left on it, the time taken,
    and how each VM left counted."""
    left = [n for n in read_each(fleet.host(host).guests(),
                                 lambda g: g.is_persistent() and g.name) if n]
    if not left:
        fleet.inventory.set_state(host, "reclaimed")
        on_event(f"{host}: empty, reclaimed")
    outcome.seconds = round(time.monotonic() - t0, 1)
    for how, vms in (("migrated", outcome.migrated), ("suspended", outcome.suspended),
                     ("hibernated", outcome.hibernated), ("failed", outcome.failed)):
        metrics.count(fleet.state.r, "evacuated_vms", kind, how, by=len(vms))
    metrics.count(fleet.state.r, "evacuations", kind)
    return outcome


def _host_events(report, host: str) -> Callable[[str], None]:
    return lambda message: report.event(message, host=host)


def _size(g: Guest, storage: Path) -> VMSize | None:
    """What the plan needs to know of a VM (`storage`: its site's, for the disks it holds)."""
    if not g.is_persistent():  # an incoming migration's twin is not this host's to move
        return None
    return VMSize(g.name, g.memory_mib(), g.vcpus(), *g.device_needs(), live=g.live_migratable()[0],
                  site_bound=bool(local_disks.site_bound(g.xml(), storage)))


def _wait_for_jobs(source: Host, on_event, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [n for n in read_each(_guests_or_none(source), lambda g: g.has_job() and g.name)
                if n]
        if not busy:
            return
        on_event(f"waiting for the jobs already running on {', '.join(busy)}")
        time.sleep(1)


def _guests_or_none(host: Host) -> list[Guest]:
    try:
        return host.guests()
    except VmmgrError:
        return []


def _carry_out(fleet, steps, outcome, per_target, parallel, deadline, report) -> None:
    slots = {s.target: threading.Semaphore(per_target) for s in steps if s.target}
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(lambda step: run_step(fleet, report, step, outcome, slots, deadline),
                      [s for s in steps if s.action != "wait"]))


def run_step(fleet, report, step: Step, outcome, slots: dict, deadline: bool) -> None:
    """One step of an evacuation; its outcome goes into `outcome`'s lists. At most `slots[target]`
    moves into one target at once."""
    def park(vm: str, why: str, mode: str | None = None) -> dict:
        report.event(f"{vm}: suspending, {why}", vm=vm)
        return operations.suspend(fleet, report, vm, mode=mode, parked=True, why=why)

    def hibernate_to() -> None:
        """Hibernate, then boot on the target; if that fails the VM stays parked, not lost."""
        park(step.vm, f"moving to {step.target} by guest hibernation", mode="guest")
        try:
            operations.resume(fleet, report, step.vm, step.target)
        except VmmgrError as err:
            outcome.suspended.append(step.vm)
            report.event(f"{step.vm}: not resumed on {step.target} ({err}); stays parked",
                         vm=step.vm)
            return
        outcome.hibernated.append(step.vm)

    try:
        guest = fleet.find(step.vm)
        if guest is not None and not guest.is_active():  # stopped: nothing runs to migrate
            if step.target is None:  # kept on storage: nothing is lost with the host
                operations.park_stopped(fleet, report, step.vm, "no other host has room")
                outcome.suspended.append(step.vm)
                return
            operations.relocate_stopped(fleet, report, step.vm, step.target)
            outcome.migrated.append(step.vm)
            return
        if step.action == "migrate":
            with slots[step.target]:
                report.event(f"{step.vm}: migrating to {step.target} ({step.reason})", vm=step.vm)
                try:
                    operations.migrate(fleet, report, step.vm, step.target, step.policy,
                                       **(EARLY_POSTCOPY if step.early_postcopy else {}))
                except VmmgrError as err:
                    if not deadline:
                        raise
                    # The host must be emptied: a VM that could not move is parked, not lost;
                    # one whose device refused the migration hibernates (a save would fail too).
                    blocked = devices.is_blocker_refusal(str(err))
                    park(step.vm, f"migration failed ({err})", "guest" if blocked else None)
                    outcome.suspended.append(step.vm)
                    return
                outcome.migrated.append(step.vm)
        elif step.action == "hibernate":
            with slots[step.target]:
                hibernate_to()
        elif step.action == "suspend":
            park(step.vm, step.reason)
            outcome.suspended.append(step.vm)
    except VmmgrError as err:
        outcome.failed[step.vm] = str(err)
        report.event(f"{step.vm}: {err}", vm=step.vm)


def enable(fleet: Fleet, host: str, report) -> list[str]:
    fleet.host(host)
    fleet.inventory.set_state(host, "active")
    report.event(f"{host}: active", host=host)
    return resume_parked(fleet, report)


def resume_parked(fleet: Fleet, report, synced: bool = False) -> list[str]:
    """Resume parked VMs, oldest first, on active hosts with room; the rest stay parked. A job's
    parked VMs (`group`) resume together, only when there is room for all of them. Each resume
    takes the VM's lock: another node resuming the same VM at once is refused."""
    resumed = []
    if not synced:  # (the reconcile's pass has just done it)
        suspend.sync_records(fleet, report)  # a job's member the store lacks is waited for
    waiting = [r for r in suspend.suspended(fleet) if r.parked]  # an operator's wait for them
    saving = suspend.saving_groups(fleet)  # a job with a save still going waits
    jobs: dict[str, list] = {}
    for record in waiting:
        if record.group not in saving:
            jobs.setdefault(record.group or f"vm:{record.vm}", []).append(record)
    own = fleet.own_site()
    for members in jobs.values():
        sites = fleet.sites()
        if all(m.site != own for m in members):
            continue  # saved on another site's storage: that site's pass resumes them
        caps = fleet.active_capacities()
        if any(_site_bound(fleet, m) for m in members if m.site == own):
            caps = {h: c for h, c in caps.items() if sites.get(h, "") == own}
        targets = place_together(caps, members, sites, members[0].site)
        if targets is None:
            continue
        for record, target in zip(members, targets):
            if record.site != own:
                continue  # a member saved on another site: its site's pass, with the same room
            try:
                operations.resume(fleet, report, record.vm, target)
                resumed.append(record.vm)
            except VmmgrError as err:  # e.g. raced with another operation: the image stays
                report.event(f"{record.vm}: not resumed: {err}", vm=record.vm)
    return resumed


def _site_bound(fleet: Fleet, record) -> bool:
    """Whether a parked VM has a disk on its site's storage (it resumes only there)."""
    try:
        xml = (suspend.save_dir(fleet, record.vm) / "domain.xml").read_text()
    except OSError:
        return False  # resumed meanwhile: its resume says so
    return bool(local_disks.site_bound(xml, fleet.paths.storage))


def place_together(capacities: dict[str, Capacity], members: list,
                   site_of: dict[str, str] | None = None, near: str | None = None
                   ) -> list[str] | None:
    """A host for each member with room reserved as it goes (in site `near` first), or None if
    any has none."""
    room, targets = dict(capacities), []
    for m in members:
        target, _ = choose_host(room, m.memory_mib, m.vcpus, m.device_model, m.device_count,
                                site_of, near)
        if target is None:
            return None
        room[target] = reserve(room[target], m)
        targets.append(target)
    return targets


def reserve(cap: Capacity, vm) -> Capacity:
    """`cap` with `vm`'s memory, vCPUs and devices taken."""
    free = list(cap.free_devices)
    for _ in range(vm.device_count):
        free.remove(vm.device_model)
    return replace(cap, used_memory_mib=cap.used_memory_mib + vm.memory_mib,
                   used_vcpus=cap.used_vcpus + vm.vcpus, free_devices=tuple(free))
