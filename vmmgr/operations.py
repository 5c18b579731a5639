"""Each operation's one body: what a task runs, what the CLI runs in its own process, and what
reclaim and reconcile run for each VM.

A body takes the fleet (whose owner holds the locks), its arguments exactly as the task API
carries them, and a report: where it tells, in one line per step, what it did (`event`), where a
migration's progress goes (`progress`), and whether an earlier run of the same request may have
done part of the work (`rerun`: a redelivered task). Every operation may run twice, so each looks
at libvirt before it acts: what an earlier run finished is reported, not redone; a job an earlier
run left running in libvirt is waited for. The fleet's records (Redis) are kept here, so they
say the same whichever surface asked.
"""

import time
from dataclasses import asdict
from typing import Protocol

from . import migration, reclaim, suspend as suspension
from .errors import (Conflict, HostUnreachable, MigrationFailed, NotFound, PostcopyPaused,
                     VmmgrError)
from .fleet import Fleet
from .inventory import HostRecord
from .placement import choose_host
from .policy import get_policy
from .render import address_of
from .spec import make_spec
from .state import stored

JOB_WAIT = 600  # seconds a re-run waits for a job its predecessor left running in libvirt


class Report(Protocol):
    rerun: bool

    def event(self, message: str, vm: str = "", host: str = "", kind: str = "info") -> None: ...

    def progress(self, progress) -> None: ...


class LocalReport:
    """A report for a body run in this process: events go to the fleet's log and to `on_event`."""

    rerun = False

    def __init__(self, fleet: Fleet, on_event=lambda m: None, on_progress=lambda p: None):
        self.fleet, self.on_event, self.on_progress = fleet, on_event, on_progress

    def event(self, message: str, vm: str = "", host: str = "", kind: str = "info") -> None:
        self.fleet.state.event(message, kind=kind, vm=vm, host=host, task=self.fleet.owner)
        self.on_event(message)

    def progress(self, progress) -> None:
        self.on_progress(progress)


def create(fleet: Fleet, report: Report, spec: dict, host: str | None = None) -> dict:
    paths = fleet.paths
    spec_obj = make_spec(spec["name"], memory_mib=spec["memory_mib"], vcpus=spec["vcpus"],
                         kernel=spec["kernel"], initrd=spec.get("initrd"),
                         cmdline=spec["cmdline"], image_root=paths.images,
                         workload=spec.get("workload", ""), gpu_model=spec.get("gpu_model", ""),
                         gpu_count=spec.get("gpu_count", 0), group=spec.get("group", ""),
                         image=spec.get("image", ""), disk_gib=spec.get("disk_gib", 0),
                         ssh_keys=tuple(spec.get("ssh_keys", ())),
                         user_data=spec.get("user_data", ""),
                         local_disk=spec.get("local_disk", False))
    vm = spec_obj.name
    with fleet.lock_vm(vm, f"create of {vm}"):
        existing = fleet.find(vm, strict=True)
        if existing is not None and report.rerun:
            return {"vm": vm, "host": existing.host_name}  # the earlier run created it
        if host is None:
            host, refused = choose_host(fleet.active_capacities(), spec_obj.memory_mib,
                                        spec_obj.vcpus, spec_obj.gpu_model, spec_obj.gpu_count)
            if host is None:
                why = "; ".join(f"{h}: {r}" for h, r in refused.items()) or "no hosts"
                raise Conflict(f"no host has room for {vm}: {why}")
        guest = fleet.create(spec_obj, host)
        fleet.state.set_vm(vm, state="running", host=guest.host_name, target="",
                           spec=_recorded(spec_obj), created=time.time())
        report.event(f"{vm}: created on {guest.host_name}", vm=vm, host=guest.host_name)
        return {"vm": vm, "host": guest.host_name}


def _recorded(spec) -> dict:
    """The spec as the VM's record keeps it: user-data may hold secrets, so only its size."""
    data = asdict(spec)
    if data.get("user_data"):
        data["user_data"] = f"({len(spec.user_data.encode())} bytes, in the seed only)"
    return data


def migrate(fleet: Fleet, report: Report, vm: str, target: str, policy: str | None = None,
            bandwidth: int | None = None, **steer) -> dict:
    """`steer`: fields of the policy set for this move only (`policy.EARLY_POSTCOPY`)."""
    chosen = get_policy(policy, bandwidth, **steer)
    with fleet.lock_vm(vm, f"migration of {vm} to {target}"):
        return _migrate(fleet, report, vm, target, chosen)


def _migrate(fleet: Fleet, report: Report, vm: str, target: str, chosen) -> dict:
    if _recovered(fleet, report, vm) and fleet.is_suspended(vm):  # an intent left behind
        raise Conflict(f"VM {vm!r} is suspended to disk: a save cut short had completed "
                       "(`vm resume` brings it back)")
    orphan = fleet.locate(vm) if report.rerun else None
    if orphan is not None and orphan.has_job():
        # The earlier run's migration goes on in libvirt without its monitor: steer it.
        source, started = orphan.host_name, time.time()
        aborted = migration.adopt(fleet, vm, target, chosen, on_progress=report.progress)
        if aborted:
            error = (f"migration of {vm} from {source} to {target} aborted by policy "
                     f"{chosen.name}: {aborted}; the VM is still running on {source}")
            fleet.state.record("migration_failed", vm, {
                "source": source, "target": target, "error": error, "policy": chosen.name,
                "started_at": started, "ended_at": time.time()})
            report.event(f"{vm}: {error}", vm=vm, kind="error")
            raise MigrationFailed(error)
    guest = _settled(fleet, vm, report)
    if report.rerun:
        for host in fleet.tidy_local_disks(vm):
            report.event(f"{vm}: the local disk its earlier run left on {host} removed", vm=vm)
    if guest.host_name == target and report.rerun:
        # The earlier run's migration ended there: its address goes with it, its record too.
        guest_address = address_of(guest.xml(inactive=True))
        stored(lambda: fleet.route_address(guest_address, target))
        stored(lambda: fleet.state.set_vm(vm, state="running", host=target, target=""))
        return {"vm": vm, "source": None, "target": target, "already_done": True}
    source = guest.host_name
    fleet.state.record("migrating", vm, {"target": target})
    started = time.time()
    try:
        result = migration.migrate(fleet, vm, target, policy=chosen, on_progress=report.progress)
    except PostcopyPaused as err:
        _record_postcopy_paused(fleet, report, vm, err, chosen, started)
        raise
    except VmmgrError as err:
        fleet.state.record("migration_failed", vm, {
            "source": source, "target": target, "error": str(err), "policy": chosen.name,
            "started_at": started, "ended_at": time.time()})
        report.event(f"{vm}: migration to {target} failed: {err}", vm=vm, kind="error")
        raise
    # The VM has moved: a store outage now delays its record, never loses it.
    stored(lambda: fleet.state.record("migrated", vm, result.as_dict() | {"ended_at": time.time()}))
    stored(lambda: report.event(f"{vm}: {source} -> {target}, blackout {result.downtime_ms} ms",
                                vm=vm))
    return result.as_dict()


def _record_postcopy_paused(fleet: Fleet, report: Report, vm: str, err: PostcopyPaused,
                            chosen, started: float) -> None:
    stored(lambda: fleet.state.record("postcopy_paused", vm, {
        "source": err.source, "target": err.target, "error": str(err), "policy": chosen.name,
        "bandwidth": chosen.bandwidth_mibps, "started_at": started, "ended_at": time.time()}))
    report.event(f"{vm}: paused in post-copy between {err.source} and {err.target}: {err}",
                 vm=vm, kind="error")


def resume_postcopy(fleet: Fleet, report: Report, vm: str) -> dict:
    """Resume the migration a broken post-copy left paused on both hosts (the reconcile runs
    this for each VM recorded so). While the link is down it stays paused, and recorded so."""
    with fleet.lock_vm(vm, f"post-copy recovery of {vm}"):
        rec = fleet.state.vm(vm)
        if rec.get("state") != "postcopy-paused":
            raise Conflict(f"VM {vm!r} is not paused in post-copy")
        chosen = get_policy(rec.get("policy") or None, int(rec.get("bandwidth") or 0))
        started = time.time()
        try:
            result = migration.resume_postcopy(fleet, vm, rec["source"], rec["target"], chosen,
                                               on_progress=report.progress)
        except VmmgrError as err:
            still_split = isinstance(err, PostcopyPaused) or _in_postcopy(fleet, vm, rec)
            report.event(f"{vm}: post-copy {'still cannot resume' if still_split else 'recovery'}"
                         f": {err}", vm=vm, kind="error")
            if still_split:  # the next try waits longer each time (a link down for hours)
                tries = int(rec.get("recovery_tries") or 0) + 1
                stored(lambda: fleet.state.set_vm(
                    vm, recovery_tries=tries, recovery_at=time.time() + recovery_backoff(tries)))
            else:  # no longer paused in post-copy: record what libvirt says
                record_truth(fleet, vm)
            raise
        stored(lambda: fleet.state.record("migrated", vm, result.as_dict()
                                          | {"ended_at": time.time(), "started_at": started}))
        stored(lambda: report.event(f"{vm}: post-copy resumed: {result.source} -> "
                                    f"{result.target}", vm=vm, host=result.target))
        return result.as_dict()


def recovery_backoff(tries: int) -> float:
    """Seconds before the next try at resuming a post-copy after `tries` failed ones."""
    return min(10.0 * 2 ** (tries - 1), 300.0)


def _in_postcopy(fleet: Fleet, vm: str, rec: dict) -> bool:
    """Whether either side still holds the VM in post-copy (a resume given up on may still be
    settling in libvirt): its record must keep saying so, or nothing would resume it."""
    for host in (rec["source"], rec["target"]):
        try:
            guest = fleet.host(host).find_guest(vm)
            if guest is not None and guest.postcopy_phase() is not None:
                return True
        except VmmgrError:
            return True  # a side that does not answer may hold it so
    return False


def cancel(fleet: Fleet, report: Report, vm: str) -> dict:
    # No lock: cancelling is exactly what one does while the migration holds it.
    source = migration.cancel(fleet, vm)
    report.event(f"{vm}: migration cancelled; stays on {source}", vm=vm)
    return {"vm": vm, "host": source}


def suspend(fleet: Fleet, report: Report, vm: str, mode: str | None = None,
            parked: bool = False, why: str = "") -> dict:
    with fleet.lock_vm(vm, f"suspend of {vm}"):
        return _suspend(fleet, report, vm, mode, parked, why)


def _suspend(fleet: Fleet, report: Report, vm: str, mode: str | None, parked: bool,
             why: str) -> dict:
    _recovered(fleet, report, vm)
    done = suspension.find_suspended(fleet, vm)
    if done is not None and report.rerun:
        return asdict(done)
    if done is None:
        _settled(fleet, vm, report)
    fleet.state.record("suspending", vm, {"reason": why} if why else {})
    try:
        record = suspension.suspend(fleet, vm, parked=parked, mode=mode)
    except VmmgrError:
        record_truth(fleet, vm)
        raise
    stored(lambda: fleet.state.record("suspended", vm, asdict(record)))
    how = "hibernated by its guest" if record.mode == "guest" else "suspended"
    stored(lambda: report.event(f"{vm}: {how} on {record.from_host} ({record.save_ms} ms)"
                                + (", parked" if parked else ""), vm=vm))
    return asdict(record)


def resume(fleet: Fleet, report: Report, vm: str, host: str | None = None) -> dict:
    with fleet.lock_vm(vm, f"resume of {vm}"):
        return _resume(fleet, report, vm, host)


def _resume(fleet: Fleet, report: Report, vm: str, host: str | None) -> dict:
    _recovered(fleet, report, vm)
    if report.rerun and not fleet.is_suspended(vm) and fleet.find(vm) is not None:
        return _resumed_before(fleet, report, vm)
    fleet.state.record("resuming", vm, {"target": host or ""})
    try:
        result = suspension.resume(fleet, vm, host)
    except VmmgrError:
        record_truth(fleet, vm)
        raise
    _say_resumed(fleet, report, result)
    return asdict(result)


def _say_resumed(fleet: Fleet, report: Report, result: suspension.Resumed) -> None:
    vm = result.vm
    stored(lambda: fleet.state.record("resumed", vm, asdict(result)))
    words = (f"resumed on {result.host} ({result.restore_ms} ms)" if result.state == "running"
             else f"stopped, its definition back on {result.host}")
    if result.restored is False:  # it runs, but not where it stopped: say so, loudly
        words = (f"its hibernation image did not restore on {result.host}: the guest booted "
                 f"afresh and what it had in memory is lost (its disks are as it left them)")
    stored(lambda: report.event(f"{vm}: {words}", vm=vm, host=result.host,
                                kind="error" if result.restored is False else "info"))


def _resumed_before(fleet: Fleet, report: Report, vm: str) -> dict:
    """A rerun finds the VM back: its first run died after the boot. If that run had not
    recorded it yet, the record is finished here, and for a hibernated guest the wait it died
    in is done again, so the answer still says whether the guest came back where it stopped."""
    guest = fleet.locate(vm)
    record = stored(lambda: fleet.state.vm(vm)) or {}
    # "resumed" clears saved_as; an observer that saw the VM run meanwhile leaves it
    if record.get("state") != "resuming" and not record.get("saved_as"):
        return {"vm": vm, "host": guest.host_name, "already_done": True}
    restored, segment = None, guest.console_path()
    if record.get("saved_as") == "hibernated" and guest.workload() and segment:
        restored = suspension.came_back(fleet.consoles, segment, guest, suspension.RESTORE_WAIT)
    result = suspension.Resumed(vm, guest.host_name, 0, 0.0,
                                state="running" if guest.is_active() else "shutoff",
                                restored=restored)
    _say_resumed(fleet, report, result)
    return {**asdict(result), "already_done": True}


def park_stopped(fleet: Fleet, report: Report, vm: str, why: str) -> dict:
    """A stopped VM on a host being emptied, with no room anywhere else: its definition is kept
    on storage (parked), and comes back to a host, still stopped, when room returns."""
    with fleet.lock_vm(vm, f"parking of stopped {vm}"):
        _recovered(fleet, report, vm)
        done = suspension.find_suspended(fleet, vm)
        if done is None:
            try:
                done = suspension.park_stopped(fleet, vm)
            finally:
                fleet.publish(vm)
        stored(lambda: fleet.state.record("suspended", vm, asdict(done)))
        stored(lambda: report.event(f"{vm}: stopped, its definition parked on storage ({why})",
                                    vm=vm))
        return asdict(done)


STOP_TIMEOUT = 120  # s a guest OS gets to shut down cleanly (TCG boots and stops slowly)


def _defined(fleet: Fleet, vm: str, verb: str):
    """The VM's guest on the host that holds it; a clear error for one parked on storage."""
    if fleet.find(vm) is None and fleet.is_suspended(vm):
        raise Conflict(f"{vm} is suspended to disk: `vm resume` it first, then {verb} it")
    return fleet.locate(vm)


def stop(fleet: Fleet, report: Report, vm: str, timeout: float = STOP_TIMEOUT) -> dict:
    """Shut the guest down cleanly (its agent, else the ACPI power button) and wait until it
    is off. It stays defined on its host with its room, disk and address kept for `start`."""
    with fleet.lock_vm(vm, f"stop of {vm}"):
        guest = _defined(fleet, vm, "stop")
        if guest.is_active():
            fleet.state.set_vm(vm, state="stopping", host=guest.host_name, target="")
            guest.shutdown()
            deadline = time.monotonic() + timeout
            while guest.is_active():
                if time.monotonic() > deadline:
                    fleet.state.set_vm(vm, state=guest.state(), host=guest.host_name)
                    raise Conflict(f"{vm} did not shut down within {timeout:.0f} s: its OS did "
                                   f"not act on the request and it is still running (`vm "
                                   f"destroy` removes it without a shutdown)")
                time.sleep(0.5)
        elif not report.rerun:
            raise Conflict(f"{vm} is not running (it is {guest.state()})")
        # (A rerun finds the guest off: the run killed after asking left its record "stopping".)
        fleet.state.set_vm(vm, state="shutoff", host=guest.host_name, target="")
        fleet.publish(vm)
        report.event(f"{vm}: stopped on {guest.host_name}", vm=vm, host=guest.host_name)
        return {"vm": vm, "host": guest.host_name, "state": "shutoff"}


def start(fleet: Fleet, report: Report, vm: str) -> dict:
    """Boot a stopped VM again on the host that kept it; the edge routes its address there."""
    with fleet.lock_vm(vm, f"start of {vm}"):
        guest = _defined(fleet, vm, "start")
        host = fleet.host(guest.host_name)
        if not guest.is_active():
            if host.record.state != "active":
                raise Conflict(f"{vm} is stopped on {host.name}, which takes no VMs now "
                               f"({host.record.state})")
            guest.start()
        elif not report.rerun:
            raise Conflict(f"{vm} is already running on {guest.host_name}")
        # (A rerun finds it running: the run killed after booting it had not routed its
        # address nor written its record yet; both are done again, they are idempotent.)
        fleet.route_address(address_of(guest.xml()), host.name)
        fleet.state.set_vm(vm, state="running", host=host.name, target="")
        fleet.publish(vm)
        report.event(f"{vm}: started on {host.name}", vm=vm, host=host.name)
        return {"vm": vm, "host": host.name, "state": "running"}


def relocate_stopped(fleet: Fleet, report: Report, vm: str, target: str) -> dict:
    """A stopped VM leaves a host being emptied: its definition moves, nothing boots."""
    with fleet.lock_vm(vm, f"move of stopped {vm} to {target}"):
        _recovered(fleet, report, vm)  # a parking's intent left behind, settled first
        source = fleet.locate(vm).host_name
        fleet.relocate_stopped(vm, target)  # a rerun finishes what an earlier run began
        report.event(f"{vm}: stopped, its definition moved from {source} to {target}", vm=vm,
                     host=target)
        return {"vm": vm, "host": target, "state": "shutoff"}


def reboot(fleet: Fleet, report: Report, vm: str) -> dict:
    """Ask the guest OS to reboot; it stays where it is, with everything it wrote."""
    with fleet.lock_vm(vm, f"reboot of {vm}"):
        guest = _defined(fleet, vm, "reboot")
        if not guest.is_active():
            raise Conflict(f"{vm} is not running (it is {guest.state()}): `vm start` boots it")
        guest.reboot()
        report.event(f"{vm}: reboot asked of its OS on {guest.host_name}", vm=vm,
                     host=guest.host_name)
        return {"vm": vm, "host": guest.host_name, "state": "running"}


def destroy(fleet: Fleet, report: Report, vm: str) -> dict:
    with fleet.lock_vm(vm, f"destroy of {vm}"):
        try:
            where = fleet.destroy(vm)
        except NotFound:
            if not report.rerun:
                raise
            where = "nowhere (an earlier run destroyed it)"
        fleet.state.forget_vm(vm)
        report.event(f"{vm}: destroyed on {where}", vm=vm)
        return {"vm": vm, "host": where}


def drain_host(fleet: Fleet, report: Report, host: str, timeout: float = 600) -> dict:
    return asdict(reclaim.evacuate(fleet, host, False, report, wait_timeout=timeout))


def reclaim_host(fleet: Fleet, report: Report, host: str, deadline_at: float | None = None) -> dict:
    """Empty a host; with `deadline_at` (unix time, a notice's), by a plan that races it."""
    if deadline_at is not None:
        from . import deadline_run  # here: it builds on reclaim, which builds on this module
        return asdict(deadline_run.reclaim_by(fleet, host, deadline_at, report))
    return asdict(reclaim.evacuate(fleet, host, True, report))


def enable_host(fleet: Fleet, report: Report, host: str) -> dict:
    resumed = reclaim.enable(fleet, host, report)
    return {"host": host, "resumed": resumed}


def add_host(fleet: Fleet, report: Report, record: dict) -> dict:
    new = HostRecord.from_dict(record)
    if report.rerun and new.name in {r.name for r in fleet.inventory.records()}:
        return record
    fleet.inventory.add(new)
    try:
        cap = fleet.host(new.name).capacity()  # it must answer before it takes VMs
    except HostUnreachable:
        fleet.inventory.remove({new.name})
        raise
    fleet.state.set_host(new.name, {"state": new.state, "reachable": True, **asdict(cap)})
    report.event(f"{new.name}: added ({cap.memory_mib} MiB, {cap.vcpus} vCPUs)", host=new.name)
    resumed = reclaim.resume_parked(fleet, report)
    return record | {"resumed": resumed}


# The task API's operations by name: a task runs `OPERATIONS[name](fleet, run, **kwargs)`, and so
# does the CLI in its own process.
OPERATIONS = {f.__name__: f for f in (create, migrate, cancel, suspend, resume, destroy,
                                      stop, start, reboot, drain_host, reclaim_host,
                                      enable_host, add_host, resume_postcopy)}


def recover(fleet: Fleet, report: Report, vm: str) -> str | None:
    """Finish or undo a suspend or resume of `vm` that was cut short (the reconcile's pass over
    storage): at once, or not at all while another holds the VM or libvirt's job still runs."""
    with fleet.lock_vm(vm, f"recovery of {vm}"):
        return _recovered(fleet, report, vm, wait=0)


# ---- helpers ----------------------------------------------------------------------------

def _recovered(fleet: Fleet, report: Report, vm: str, wait: float = JOB_WAIT) -> str | None:
    """What a run cut short left of a suspend or resume, finished or undone first (see
    `suspend.recover`), so that what follows sees the VM either running or suspended."""
    words = suspension.recover(fleet, vm, wait)
    if words:
        report.event(f"{vm}: {words}", vm=vm, kind="repair")
        record_truth(fleet, vm)
        fleet.publish(vm)
    return words


def _settled(fleet: Fleet, vm: str, report: Report):
    """The VM's guest once no job runs on it (an earlier run's migration or save may)."""
    deadline = time.monotonic() + JOB_WAIT
    while True:
        guest = fleet.locate(vm)
        if not guest.has_job() or time.monotonic() > deadline:
            return guest
        report.event(f"{vm}: waiting for the job already running on {guest.host_name}", vm=vm)
        time.sleep(1)


def record_truth(fleet: Fleet, vm: str) -> None:
    """After a failure: record what libvirt and the storage say of the VM."""
    if fleet.is_suspended(vm):
        fleet.state.set_vm(vm, state="suspended", host="", target="")
        return
    guest = fleet.find(vm)
    if guest is not None:
        fleet.state.set_vm(vm, state=guest.state(), host=guest.host_name, target="")
