"""The operations, as Celery tasks: each one a thin run of a `vmmgr` function.

Every task may run twice (a worker died and the message came back). So each one first looks at
libvirt: work an earlier run finished is reported, not redone; a job an earlier run started and
libvirt is still carrying out is waited for. Expected failures (`VmmgrError`) end the task in
FAILURE with the operator's message and exit code; Celery does not log them as crashes.
"""

import time
from dataclasses import asdict

from vmmgr import migration, reclaim, suspend as suspension
from vmmgr.addresses import pool_for
from vmmgr.edge import Edge
from vmmgr.errors import Conflict, HostUnreachable, NotFound, VmmgrError
from vmmgr.fleet import Fleet
from vmmgr.guest import read_each
from vmmgr.inventory import HostRecord
from vmmgr.locks import Lease
from vmmgr.paths import default_paths
from vmmgr.placement import choose_host
from vmmgr.policy import get_policy
from vmmgr.spec import make_spec
from vmmgr.state import FleetState

from .app import app
from .runtime import LockSpec, Run, state

JOB_WAIT = 600  # seconds a re-run waits for a job its predecessor left running in libvirt


def operation(name: str):
    return app.task(name=f"vmmgr.{name}", bind=True, throws=(VmmgrError,))


@operation("create")
def create(self, spec: dict, host: str | None = None) -> dict:
    paths = default_paths()
    spec_obj = make_spec(spec["name"], memory_mib=spec["memory_mib"], vcpus=spec["vcpus"],
                         kernel=spec["kernel"], initrd=spec.get("initrd"),
                         cmdline=spec["cmdline"], image_root=paths.images,
                         workload=spec.get("workload", ""), gpu_model=spec.get("gpu_model", ""),
                         gpu_count=spec.get("gpu_count", 0))
    vm = spec_obj.name
    with Run(self, LockSpec("vm", vm, f"create {vm}")) as run, Fleet(paths, run.id) as fleet:
        existing = fleet.find(vm)
        if existing is not None and run.rerun:
            return {"vm": vm, "host": existing.host_name}  # the earlier run created it
        if host is None:
            host, refused = choose_host(fleet.active_capacities(), spec_obj.memory_mib,
                                        spec_obj.vcpus, spec_obj.gpu_model, spec_obj.gpu_count)
            if host is None:
                why = "; ".join(f"{h}: {r}" for h, r in refused.items()) or "no hosts"
                raise Conflict(f"no host has room for {vm}: {why}")
        guest = fleet.create(spec_obj, host)
        run.state.set_vm(vm, state="running", host=guest.host_name, target="",
                         spec=asdict(spec_obj), created=time.time())
        run.event(f"{vm}: created on {guest.host_name}", host=guest.host_name)
        return {"vm": vm, "host": guest.host_name}


@operation("migrate")
def migrate(self, vm: str, target: str, policy: str | None = None,
            bandwidth: int | None = None) -> dict:
    chosen = get_policy(policy, bandwidth)
    with Run(self, LockSpec("vm", vm, f"migration of {vm} to {target}")) as run, \
            Fleet(default_paths(), run.id) as fleet:
        guest = _settled(fleet, vm, run)
        if guest.host_name == target and run.rerun:
            return {"vm": vm, "source": None, "target": target, "already_done": True}
        source = guest.host_name
        run.state.record("migrating", vm, {"target": target})
        started = time.time()
        try:
            result = migration.migrate(fleet, vm, target, policy=chosen, on_progress=run.progress)
        except VmmgrError as err:
            run.state.record("migration_failed", vm, {
                "source": source, "target": target, "error": str(err), "policy": chosen.name,
                "started_at": started, "ended_at": time.time()})
            run.event(f"{vm}: migration to {target} failed: {err}", kind="error")
            raise
        run.state.record("migrated", vm, result.as_dict() | {"ended_at": time.time()})
        run.event(f"{vm}: {source} -> {target}, blackout {result.downtime_ms} ms")
        return result.as_dict()


@operation("cancel")
def cancel(self, vm: str) -> dict:
    # No lock: cancelling is exactly what one does while the migration task holds it.
    with Fleet(default_paths()) as fleet:
        source = migration.cancel(fleet, vm)
    state().event(f"{vm}: migration cancelled; stays on {source}", vm=vm, task=self.request.id)
    return {"vm": vm, "host": source}


@operation("suspend")
def suspend(self, vm: str, mode: str | None = None) -> dict:
    with Run(self, LockSpec("vm", vm, f"suspend of {vm}")) as run, \
            Fleet(default_paths(), run.id) as fleet:
        done = suspension.find_suspended(fleet, vm)
        if done is not None and run.rerun:
            return asdict(done)
        _settled(fleet, vm, run)
        run.state.record("suspending", vm, {})
        try:
            record = suspension.suspend(fleet, vm, mode=mode)
        except VmmgrError:
            _record_truth(run.state, fleet, vm)
            raise
        run.state.record("suspended", vm, asdict(record))
        how = "hibernated by its guest" if record.mode == "guest" else "suspended"
        run.event(f"{vm}: {how} on {record.from_host} ({record.save_ms} ms)")
        return asdict(record)


@operation("resume")
def resume(self, vm: str, host: str | None = None) -> dict:
    with Run(self, LockSpec("vm", vm, f"resume of {vm}")) as run, \
            Fleet(default_paths(), run.id) as fleet:
        if run.rerun and not fleet.is_suspended(vm) and fleet.find(vm) is not None:
            return {"vm": vm, "host": fleet.locate(vm).host_name, "already_done": True}
        run.state.record("resuming", vm, {"target": host or ""})
        try:
            result = suspension.resume(fleet, vm, host)
        except VmmgrError:
            _record_truth(run.state, fleet, vm)
            raise
        run.state.record("resumed", vm, asdict(result))
        run.event(f"{vm}: resumed on {result.host} ({result.restore_ms} ms)", host=result.host)
        return asdict(result)


@operation("destroy")
def destroy(self, vm: str) -> dict:
    with Run(self, LockSpec("vm", vm, f"destroy of {vm}")) as run, \
            Fleet(default_paths(), run.id) as fleet:
        try:
            where = fleet.destroy(vm)
        except NotFound:
            if not run.rerun:
                raise
            where = "nowhere (an earlier run destroyed it)"
        run.state.forget_vm(vm)
        run.event(f"{vm}: destroyed on {where}")
        return {"vm": vm, "host": where}


@operation("drain_host")
def drain_host(self, host: str, timeout: float = 600) -> dict:
    return _evacuate(self, host, deadline=False, wait_timeout=timeout)


@operation("reclaim_host")
def reclaim_host(self, host: str) -> dict:
    return _evacuate(self, host, deadline=True)


def _evacuate(task, host: str, deadline: bool, **kw) -> dict:
    verb = "reclaim" if deadline else "drain"
    with Run(task, LockSpec("host", host, f"{verb} of {host}")) as run, \
            Fleet(default_paths(), run.id) as fleet:
        report = reclaim.evacuate(fleet, host, deadline, on_event=run.event,
                                  on_record=run.state.record, **kw)
        return asdict(report)


@operation("enable_host")
def enable_host(self, host: str) -> dict:
    with Run(self, LockSpec("host", host, f"enable of {host}")) as run, \
            Fleet(default_paths(), run.id) as fleet:
        resumed = reclaim.enable(fleet, host, on_event=run.event, on_record=run.state.record)
        return {"host": host, "resumed": [asdict(r) for r in resumed]}


@operation("add_host")
def add_host(self, record: dict) -> dict:
    new = HostRecord.from_dict(record)
    with Run(self, LockSpec("host", new.name, f"add of {new.name}")) as run, \
            Fleet(default_paths(), run.id) as fleet:
        if run.rerun and new.name in {r.name for r in fleet.inventory.records()}:
            return record
        fleet.inventory.add(new)
        try:
            cap = fleet.host(new.name).capacity()  # it must answer before it takes VMs
        except HostUnreachable:
            fleet.inventory.remove({new.name})
            raise
        run.event(f"{new.name}: added ({cap.memory_mib} MiB, {cap.vcpus} vCPUs)")
        resumed = reclaim.resume_parked(fleet, on_event=run.event, on_record=run.state.record)
        return record | {"resumed": [r.vm for r in resumed]}


@operation("reconcile")
def reconcile(self) -> dict:
    """Resume parked VMs where there is room, and make the records match libvirt."""
    try:
        lease = Lease(state(), "fleet", "reconcile", self.request.id, "reconcile").__enter__()
    except Conflict:
        return {"skipped": "another reconcile is running"}
    try:  # the lease is renewed while it runs: a slow reconcile never overlaps the next
        with Run(self, None) as run, Fleet(default_paths(), run.id) as fleet:
            resumed = reclaim.resume_parked(fleet, on_event=run.event,
                                            on_record=run.state.record)
            repaired = _repair_records(run, fleet)
            rerouted = _repair_edge(run, fleet)
            _snapshot_hosts(run.state, fleet)
            return {"resumed": [r.vm for r in resumed], "repaired": repaired,
                    "rerouted": rerouted}
    finally:
        lease.__exit__(None, None, None)


# ---- helpers ----------------------------------------------------------------------------

def _settled(fleet: Fleet, vm: str, run: Run):
    """The VM's guest once no job runs on it (an earlier run's migration or save may)."""
    deadline = time.monotonic() + JOB_WAIT
    while True:
        guest = fleet.locate(vm)
        if not guest.has_job() or time.monotonic() > deadline:
            return guest
        run.event(f"{vm}: waiting for the job already running on {guest.host_name}")
        time.sleep(1)


def _record_truth(fleet_state: FleetState, fleet: Fleet, vm: str) -> None:
    if fleet.is_suspended(vm):
        fleet_state.set_vm(vm, state="suspended", host="", target="")
        return
    guest = fleet.find(vm)
    if guest is not None:
        fleet_state.set_vm(vm, state=guest.state(), host=guest.host_name, target="")


def _repair_records(run: Run, fleet: Fleet) -> list[str]:
    truth = {i.name: (i.host, i.state) for i in fleet.vms()}
    truth |= {r.vm: ("", "suspended") for r in suspension.suspended(fleet)}
    records = run.state.vms()
    repaired = []
    for vm, (host, now) in truth.items():
        if run.state.holder("vm", vm):
            continue  # an operation is changing it right now
        rec = records.get(vm, {})
        if (rec.get("host"), rec.get("state")) != (host, now):
            was = f"{rec.get('state')} on {rec.get('host') or '-'}" if rec else "unrecorded"
            run.state.set_vm(vm, host=host, state=now, target="")
            run.event(f"{vm}: record repaired: was {was}, libvirt says {now} on {host or '-'}",
                      vm=vm, kind="repair")
            repaired.append(vm)
    for vm in set(records) - set(truth):
        if not run.state.holder("vm", vm):
            run.state.forget_vm(vm)
            run.event(f"{vm}: record removed: libvirt knows no such VM", vm=vm, kind="repair")
            repaired.append(vm)
    return sorted(repaired)


def _repair_edge(run: Run, fleet: Fleet) -> list[str]:
    """Make the edge route every running VM's address to the host libvirt says holds it."""
    edge, pool = Edge.load(fleet.paths, fleet.state), pool_for(fleet.paths)
    if edge is None or pool is None:
        return []
    # A move under way routes its own VM at its switch-over; repairing around it could undo
    # that. So: only when nothing moves (a VM lock, a host being emptied, a libvirt job).
    try:
        if any(run.state.holder("vm", vm) for vm in pool.in_use().values()) or any(
                h.record.state == "draining" or any(read_each(h.guests(), lambda g: g.has_job()))
                for h in fleet.hosts()):
            return []
    except VmmgrError:
        return []  # a host does not answer: its VMs' routes stay as they are
    where = {i.name: i.host for i in fleet.vms() if i.state == "running"}
    placement = {ip: where[vm] for ip, vm in pool.in_use().items() if vm in where}
    changed = edge.sync(placement)
    for host in changed:
        run.event(f"edge routes to {host} repaired", host=host, kind="repair")
    return changed


def _snapshot_hosts(fleet_state: FleetState, fleet: Fleet) -> None:
    hosts = {}
    for h in fleet.hosts():
        try:
            cap = h.capacity()
            hosts[h.name] = {"state": h.record.state, "reachable": True, **asdict(cap)}
        except VmmgrError as err:
            hosts[h.name] = {"state": h.record.state, "reachable": False, "error": str(err)}
    fleet_state.set_hosts(hosts)
