"""The console's one door to the fleet: Fleet and the fleet view (both in the store, Redis) for
what is, the task API for what to do, FleetState for records, progress and events."""

import codecs
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

from celery.result import AsyncResult
from flask import current_app, g, request

from tasks import client
from tasks.app import app as celery_app, queue_for, use_broker
from tasks.runtime import LockSpec
from vmmgr import audit, console, guest_ssh, usage
from vmmgr.errors import InvalidRequest
from vmmgr.fleet import Fleet
from vmmgr.locks import HOUSEKEEPING
from vmmgr.paths import Paths
from vmmgr.requests import Request
from vmmgr.state import FleetState

from .errors import BrokerMissing


def paths() -> Paths:
    return current_app.config["VMMGR_PATHS"]


@contextmanager
def fleet() -> Iterator[Fleet]:
    broker_url()  # the fleet's store: without it, 503 (the console is misconfigured)
    with Fleet(paths()) as f:
        yield f


def broker_url() -> str:
    url = paths().redis_url()
    if not url:
        raise BrokerMissing("no task broker configured ($VMMGR_REDIS_URL or <home>/redis.url)")
    use_broker(url)
    return url


def state() -> FleetState:
    return FleetState(broker_url())


def actor() -> dict:
    """Who is asking, for the audit trail: the user, how (page or API, with the token's id) and
    from where."""
    return {"who": g.user.name, "via": "api" if request.path.startswith("/api/") else "web",
            "client": request.remote_addr or "", "token": g.get("token_id", "")}


def refused(action: str, target: str, args: dict, err: Exception) -> None:
    """A request the console refused (nothing changed), in the audit trail."""
    try:
        audit.record(state().r, actor(), action, target, args, f"refused: {err}")
    except Exception:
        pass  # no store: nothing could have changed either


def submit(req: Request) -> dict:
    """Queue a checked request; the lock is taken first, so a busy VM is refused here."""
    broker_url()
    queue = queue_for(req.host, req.site)
    task_id = client.submit(paths(), req.op, req.kwargs, queue,
                            LockSpec(*req.lock) if req.lock else None, actor=actor())
    return {"task": task_id, "op": req.op, "queue": queue}


def task_status(task_id: str) -> dict | None:
    """A task's record with its live state: progress and events while it runs, then its result
    or error. None for a task vmmgr never queued."""
    record = state().task(task_id)
    if not record:
        return None
    result = AsyncResult(task_id, app=celery_app)
    status, info = result.state, result.info
    out = {"task": task_id, "op": record.get("name", ""), "queue": record.get("queue", ""),
           "submitted_at": float(record.get("submitted", 0) or 0),
           "worker": record.get("worker", ""), "runs": int(record.get("runs", 0) or 0),
           "state": status, "progress": None, "events": [], "result": None, "error": None}
    if status == "PROGRESS" and isinstance(info, dict):
        out["progress"], out["events"] = info.get("progress"), info.get("events", [])
    elif status == "SUCCESS":
        out["result"] = json.loads(json.dumps(info, default=str))
    elif status == "FAILURE":
        out["error"] = str(info)
    return out


def operation(vm: str) -> dict | None:
    """The task holding the VM's lock now, if any: (task id, what). One of the reconcile's
    brief checks is none: no task to follow, nothing to cancel (a request waits for it)."""
    holder = state().holder("vm", vm)
    if not holder:
        return None
    task_id, _, what = holder.partition(" ")
    if what.startswith(HOUSEKEEPING):
        return None
    return {"task": task_id, "what": what}


def last_operation(vm: str, recent: int = 50) -> dict | None:
    """The VM's most recent locked operation (a migration, suspend, ...) among recent tasks."""
    for t in state().recent_tasks(recent):
        args = json.loads(t.get("args") or "{}")
        if vm in (args.get("vm"), (args.get("spec") or {}).get("name")) and t.get("name") != "cancel":
            return {"task": t["id"], "what": t.get("what") or t.get("name", "")}
    return None


def progress_stream(vm: str) -> Iterator[dict]:
    """Snapshots of the VM's current (or else its last) operation, each time they change."""
    followed, last = operation(vm) or last_operation(vm), None
    deadline = time.monotonic() + current_app.config["SSE_MAX_SECONDS"]
    while time.monotonic() < deadline:
        op = operation(vm)
        if op and op["task"] != (followed or {}).get("task"):
            followed = op
        snap = {"vm": vm, "operation": None}
        if followed:
            status = task_status(followed["task"]) or {"state": "PENDING"}
            snap["operation"] = followed | status
            if status["state"] in ("SUCCESS", "FAILURE") and not op:
                followed = None  # shown once more below, then the next operation is awaited
        if snap != last:
            yield snap
            last = snap
        time.sleep(0.4)


def ssh_host_keys(vm: str) -> list[str]:
    """The SSH host keys the VM printed on its console at first boot (a VM from an OS image)."""
    with fleet() as f:
        return guest_ssh.host_keys(console.read(f.consoles, vm).decode(errors="replace"))


def console_stream(vm: str, tail: int = 65536) -> Iterator[str]:
    """The VM's serial output as text: the last `tail` bytes written so far, then what follows,
    across every host the VM moves to. A viewer costs a chunk of memory, not the log's size."""
    deadline = time.monotonic() + current_app.config["SSE_MAX_SECONDS"]
    text = codecs.getincrementaldecoder("utf-8")("replace")  # a character may span two reads
    with fleet() as f:
        for chunk in console.follow(f.consoles, vm, tail=tail,
                                    stop=lambda: time.monotonic() > deadline):
            if decoded := text.decode(chunk):
                yield decoded


def window(args, since_default: str) -> tuple[float, float]:
    """The [since, until) a query asks for (`until` defaults to now); a bad time is refused."""
    now = time.time()
    try:
        since = usage.parse_time(args.get("since", since_default), now)
        until = usage.parse_time(args["until"], now) if "until" in args else now
    except ValueError as err:
        raise InvalidRequest(str(err)) from None
    if until <= since:
        raise InvalidRequest("until must come after since")
    return since, until


def usage_window(args) -> dict:
    """Usage in the window the query asks for (default: the last 30 days)."""
    return usage.report(state(), *window(args, "30d"))
