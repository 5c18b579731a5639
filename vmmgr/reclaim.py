"""Reclaim and drain: empty a host without killing anything on it.

`reclaim` has a deadline: every VM that fits elsewhere is live-migrated (several at once, at most
`per_target` into any one host), and every VM that does not is suspended to disk and parked.
`drain` has none: it migrates what fits and waits for room for the rest. Either way the host takes
no new VMs from the start and ends `reclaimed` (empty, out of service) until `enable`.
`resume_parked` brings suspended VMs back, oldest first, wherever there is room: it runs when a host
is enabled and on every reconcile.

The plan is a pure function over capacities; the executor here only carries it out.
"""

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from . import suspend
from .errors import Conflict, VmmgrError
from .fleet import Fleet
from .host import Capacity
from .migration import migrate
from .placement import choose_host


@dataclass(frozen=True)
class Step:
    vm: str
    action: str  # "migrate", "suspend" or "wait"
    target: str | None
    reason: str


@dataclass(frozen=True)
class VMSize:
    name: str
    memory_mib: int
    vcpus: int


def plan_evacuation(vms: list[VMSize], capacities: dict[str, Capacity], deadline: bool) -> list[Step]:
    """Where each VM goes: largest first onto the host with most room, room reserved as it goes.

    Hosts in `capacities` are the ones allowed to take VMs (not the one being emptied).
    """
    room = dict(capacities)
    steps = []
    for vm in sorted(vms, key=lambda v: (-v.memory_mib, v.name)):
        target, refused = choose_host(room, vm.memory_mib, vm.vcpus)
        if target:
            cap = room[target]
            room[target] = replace(cap, used_memory_mib=cap.used_memory_mib + vm.memory_mib,
                                   used_vcpus=cap.used_vcpus + vm.vcpus)
            steps.append(Step(vm.name, "migrate", target, f"{target} has the most room"))
        else:
            why = "; ".join(f"{h}: {r}" for h, r in refused.items()) or "no other active host"
            steps.append(Step(vm.name, "suspend" if deadline else "wait", None, f"no room ({why})"))
    return steps


@dataclass
class EvacuationReport:
    host: str
    migrated: list[str]
    suspended: list[str]
    failed: dict[str, str]
    seconds: float


def evacuate(fleet: Fleet, host: str, deadline: bool, per_target: int = 2, parallel: int = 3,
             wait_timeout: float = 600, on_event: Callable[[str], None] = lambda m: None
             ) -> EvacuationReport:
    """Empty `host`: reclaim (deadline=True) or drain (deadline=False)."""
    fleet.host(host)  # NotFound for an unknown host
    fleet.inventory.set_state(host, "draining")
    on_event(f"{host}: draining (takes no new VMs)")
    t0 = time.monotonic()
    report = EvacuationReport(host, [], [], {}, 0.0)
    while True:
        source = fleet.host(host)
        vms = [VMSize(g.name, g.memory_mib(), g.vcpus()) for g in source.guests()
               if g.is_persistent()]
        if not vms:
            break
        steps = plan_evacuation(vms, fleet.active_capacities(exclude=host), deadline)
        _carry_out(fleet, steps, report, per_target, parallel, deadline, on_event)
        if deadline or time.monotonic() - t0 > wait_timeout:
            break
        if all(s.action == "wait" for s in steps):
            time.sleep(2)  # drain: wait for room
    left = [g.name for g in fleet.host(host).guests() if g.is_persistent()]
    if not left:
        fleet.inventory.set_state(host, "reclaimed")
        on_event(f"{host}: empty, reclaimed")
    report.seconds = round(time.monotonic() - t0, 1)
    return report


def _carry_out(fleet, steps, report, per_target, parallel, deadline, on_event) -> None:
    slots = {s.target: threading.Semaphore(per_target) for s in steps if s.target}

    def park(vm: str, why: str) -> None:
        on_event(f"{vm}: suspending, {why}")
        suspend.suspend(fleet, vm)
        report.suspended.append(vm)
        on_event(f"{vm}: suspended to disk, parked")

    def run(step: Step) -> None:
        try:
            if step.action == "migrate":
                with slots[step.target]:
                    on_event(f"{step.vm}: migrating to {step.target}")
                    try:
                        r = migrate(fleet, step.vm, step.target)
                    except VmmgrError as err:
                        if not deadline:
                            raise
                        # The host must be emptied: a VM that could not move is parked, not lost.
                        park(step.vm, f"migration failed ({err})")
                        return
                    report.migrated.append(step.vm)
                    on_event(f"{step.vm}: on {step.target} (blackout {r.downtime_ms} ms)")
            elif step.action == "suspend":
                park(step.vm, step.reason)
        except VmmgrError as err:
            report.failed[step.vm] = str(err)
            on_event(f"{step.vm}: {err}")

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(run, [s for s in steps if s.action != "wait"]))


def enable(fleet: Fleet, host: str, on_event: Callable[[str], None] = lambda m: None) -> list:
    fleet.host(host)
    fleet.inventory.set_state(host, "active")
    on_event(f"{host}: active")
    return resume_parked(fleet, on_event)


def resume_parked(fleet: Fleet, on_event: Callable[[str], None] = lambda m: None) -> list:
    """Resume suspended VMs, oldest first, on active hosts with room; the rest stay parked."""
    resumed = []
    for record in suspend.suspended(fleet):
        target, _ = choose_host(fleet.active_capacities(), record.memory_mib, record.vcpus)
        if target is None:
            continue
        try:
            resumed.append(suspend.resume(fleet, record.vm, target))
            on_event(f"{record.vm}: resumed on {target}")
        except Conflict as err:  # raced with another operation: next reconcile retries
            on_event(f"{record.vm}: {err}")
    return resumed
