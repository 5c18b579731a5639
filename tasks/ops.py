"""The operations, as Celery tasks: each one a run (its lock, heartbeat, progress and events) of
the operation's one body in `vmmgr.operations`, which the CLI and reclaim run too.

Every task may run twice (a worker died and the message came back): the bodies look at libvirt
before they act. Expected failures (`VmmgrError`) end the task in FAILURE with the operator's
message and exit code; Celery does not log them as crashes.
"""

import logging

from vmmgr import operations, reconcile as reconciliation, requests
from vmmgr.errors import Conflict, VmmgrError
from vmmgr.fleet import Fleet
from vmmgr.inventory import HostRecord
from vmmgr.locks import Lease
from vmmgr.paths import default_paths

from .app import CONTROL_QUEUE, RECONCILE_SECONDS, app, site_queue
from .client import QUEUED_LOCK_TTL, submit
from .runtime import LockSpec, Run, run_once, state


def operation(name: str):
    return app.task(name=f"vmmgr.{name}", bind=True, throws=(VmmgrError,))


def _run(task, lock: LockSpec | None, op: str, **kwargs) -> dict:
    def body(run):
        with Fleet(default_paths(), run.id) as fleet:
            return operations.OPERATIONS[op](fleet, run, **kwargs)
    return run_once(task, lock, body)


@operation("create")
def create(self, spec: dict, host: str | None = None) -> dict:
    return _run(self, LockSpec("vm", spec["name"], f"create {spec['name']}"), "create",
                spec=spec, host=host)


@operation("migrate")
def migrate(self, vm: str, target: str, policy: str | None = None,
            bandwidth: int | None = None) -> dict:
    return _run(self, LockSpec("vm", vm, f"migration of {vm} to {target}"), "migrate",
                vm=vm, target=target, policy=policy, bandwidth=bandwidth)


@operation("cancel")
def cancel(self, vm: str) -> dict:
    return _run(self, None, "cancel", vm=vm)  # no lock: the migration holds it


@operation("suspend")
def suspend(self, vm: str, mode: str | None = None) -> dict:
    return _run(self, LockSpec("vm", vm, f"suspend of {vm}"), "suspend", vm=vm, mode=mode)


@operation("resume")
def resume(self, vm: str, host: str | None = None) -> dict:
    return _run(self, LockSpec("vm", vm, f"resume of {vm}"), "resume", vm=vm, host=host)


@operation("resume_postcopy")
def resume_postcopy(self, vm: str) -> dict:
    return _run(self, LockSpec("vm", vm, f"post-copy recovery of {vm}"), "resume_postcopy", vm=vm)


@operation("destroy")
def destroy(self, vm: str) -> dict:
    return _run(self, LockSpec("vm", vm, f"destroy of {vm}"), "destroy", vm=vm)


@operation("stop")
def stop(self, vm: str, timeout: float = operations.STOP_TIMEOUT) -> dict:
    return _run(self, LockSpec("vm", vm, f"stop of {vm}"), "stop", vm=vm, timeout=timeout)


@operation("start")
def start(self, vm: str) -> dict:
    return _run(self, LockSpec("vm", vm, f"start of {vm}"), "start", vm=vm)


@operation("reboot")
def reboot(self, vm: str) -> dict:
    return _run(self, LockSpec("vm", vm, f"reboot of {vm}"), "reboot", vm=vm)


@operation("drain_host")
def drain_host(self, host: str, timeout: float = 600) -> dict:
    return _run(self, LockSpec("host", host, f"drain of {host}"), "drain_host", host=host,
                timeout=timeout)


@operation("reclaim_host")
def reclaim_host(self, host: str, deadline_at: float | None = None) -> dict:
    return _run(self, LockSpec("host", host, f"reclaim of {host}"), "reclaim_host", host=host,
                deadline_at=deadline_at)


@operation("enable_host")
def enable_host(self, host: str) -> dict:
    return _run(self, LockSpec("host", host, f"enable of {host}"), "enable_host", host=host)


@operation("add_host")
def add_host(self, record: dict) -> dict:
    new = HostRecord.from_dict(record)
    added = _run(self, LockSpec("host", new.name, f"add of {new.name}"), "add_host",
                 record=record)
    if new.site:
        try:
            _site_queue_to_its_worker(new.name, new.site)
        except Exception:  # noqa: BLE001 - added all the same: the worker takes it at its start
            logging.getLogger("vmmgr.worker").exception("%s: its worker not told to consume "
                                                        "its site's queue", new.name)
    return added


def _site_queue_to_its_worker(host: str, site: str) -> None:
    """The worker already running on a host just recorded in a site consumes the site's queue
    now (a no-op where it does already): its role's `vmmgr_worker_site` may have been missed,
    and it checks the inventory only when it starts."""
    started = state().r.get(f"vmmgr:worker:{host}")  # "pid nodename", set at its start
    if started:
        app.control.add_consumer(site_queue(site), destination=[started.split(" ", 1)[1]],
                                 reply=False)


def _submitter(fleet: Fleet):
    """How the reconcile starts a VM's own recovery: queued as its own task, its lock taken
    before it is queued (so the next pass sees it held and does not queue it twice)."""
    def start(vm: str) -> None:
        req = requests.resume_postcopy(vm)
        # A message no worker took up in time is dropped with its lock's expiry: the next
        # pass queues a fresh one, not a pile of stale ones.
        submit(fleet.paths, req.op, req.kwargs, CONTROL_QUEUE, LockSpec(*req.lock),
               actor={"who": "reconcile", "via": "beat", "client": "-"},
               expires=QUEUED_LOCK_TTL)
    return start


@operation("reconcile")
def reconcile(self) -> dict:
    """Resume parked VMs where there is room, and make the records match libvirt."""
    lease = Lease(state(), "fleet", "reconcile", self.request.id, "reconcile")
    try:
        lease.__enter__()
    except Conflict:
        return {"skipped": "another reconcile is running"}
    try:  # the lease is renewed while it runs: a slow reconcile never overlaps the next
        with Run(self, None) as run, Fleet(default_paths(), run.id) as fleet:
            return reconciliation.reconcile(fleet, run, start=_submitter(fleet),
                                            start_saves=_start_saves)
    finally:
        lease.__exit__(None, None, None)


def _start_saves(site: str) -> None:
    """Queue a site's pass over its saves on that site's queue: only its workers see them.
    Sent as the beat sends the reconcile: a message no worker takes up within one period is
    dropped, and the next pass sends a fresh one."""
    app.send_task("vmmgr.reconcile_saves", queue=site_queue(site), expires=RECONCILE_SECONDS)


@operation("reconcile_saves")
def reconcile_saves(self) -> dict:
    """This worker's site's pass over the saves on its storage (`reconcile.reconcile_saves`:
    one at a time per site)."""
    with Run(self, None) as run, Fleet(default_paths(), run.id) as fleet:
        return reconciliation.reconcile_saves(fleet, run)
