"""Submitting operations and waiting for them: what the CLI and the web console call.

`submit` refuses a conflicting request at once: it takes the VM's (or host's) lock in the new
task's name before the task is queued, so "VM busy" is an answer, not a task that fails later.
(A brief check of the reconcile's is waited for, up to `locks.HOUSEKEEPING_WAIT`.)
"""

import time
import uuid
from collections.abc import Callable

from celery.states import READY_STATES

from vmmgr import audit, locks
from vmmgr.errors import VmmgrError
from vmmgr.migration import JobProgress
from vmmgr.paths import Paths
from vmmgr.state import FleetState

from .app import app
from .runtime import LockSpec

QUEUED_LOCK_TTL = 600  # a queued task keeps its lock this long before a worker takes it up


def submit(paths: Paths, op: str, kwargs: dict, queue: str, lock: LockSpec | None,
           actor: dict | None = None, expires: float | None = None) -> str:
    """Queue the operation; recorded in the audit trail as `actor`'s request (the CLI's OS user
    and host unless the console says who)."""
    fleet_state = FleetState(paths.redis_url())
    task_id = str(uuid.uuid4())
    actor = actor or audit.cli_actor()
    if lock:
        try:
            locks.acquire(fleet_state, lock.kind, lock.name, task_id, lock.what,
                          QUEUED_LOCK_TTL)  # past a brief reconcile check, not a refusal
        except VmmgrError as err:
            audit.record(fleet_state.r, actor, op, audit.target_of(kwargs), kwargs,
                         f"refused: {err}")
            raise
    try:
        app.send_task(f"vmmgr.{op}", kwargs=kwargs, task_id=task_id, queue=queue,
                      expires=expires)
    except Exception:
        if lock:
            fleet_state.release(lock.kind, lock.name, task_id)
        raise
    fleet_state.add_task(task_id, op, kwargs, queue, lock.what if lock else op)
    try:
        audit.record(fleet_state.r, actor, op, audit.target_of(kwargs), kwargs, "queued", task_id)
    except Exception:
        pass  # queued all the same: the task's outcome is recorded when it ends
    return task_id


def wait(task_id: str, on_progress: Callable[[JobProgress | None], None] = lambda p: None,
         on_event: Callable[[str], None] = lambda m: None, poll: float = 0.1) -> dict:
    """Follow a task to its end, passing on its progress and events; its result, or its error
    raised as the same `VmmgrError` the operation raised in the worker. One read of the task's
    meta each time Celery stores a new state of it (its Redis backend publishes each one), and at
    least every `poll` seconds: the end is seen the moment it is stored, not a poll later
    (bench/hop.py's `result` phase)."""
    seen, last = 0, None
    stores = _stores_of(task_id)  # subscribed before the first read: no state slips between
    try:
        while True:
            meta = app.backend.get_task_meta(task_id)  # exceptions come back as exceptions
            status, info = meta["status"], meta["result"]
            if status == "PROGRESS" and isinstance(info, dict):
                seen = _pass_on(info, seen, on_event)
                if info.get("progress") and info["progress"] != last:
                    last = info["progress"]
                    on_progress(JobProgress(**{k: v for k, v in last.items() if k != "fraction"}))
            elif status in READY_STATES:  # REVOKED too: a queued task that expired
                break
            _next_store(stores, poll)
    finally:
        on_progress(None)
        if stores is not None:
            try:
                stores.close()
            except Exception:
                pass
    if status == "SUCCESS":
        return info
    if isinstance(info, VmmgrError):
        raise info
    if status == "REVOKED":
        raise VmmgrError(f"task {task_id} was revoked: it did not run (expired in its queue)")
    raise VmmgrError(f"task {task_id} failed: {info!r}")


def _stores_of(task_id: str):
    """A subscription to the channel Celery's Redis backend publishes each stored state of the
    task on (the value is set and published in one pipeline), or None where there is none: then
    the wait polls."""
    try:
        stores = app.backend.client.pubsub(ignore_subscribe_messages=True)
        stores.subscribe(app.backend.get_key_for_task(task_id))
        return stores
    except Exception:
        return None


def _next_store(stores, poll: float) -> None:
    """Until the task's next state is stored, or `poll` seconds."""
    if stores is None:
        time.sleep(poll)
        return
    try:
        stores.get_message(timeout=poll)
    except Exception:  # the subscription broke (Redis restarted): the meta read says more
        time.sleep(poll)


def _pass_on(meta: dict, seen: int, on_event) -> int:
    """Hand on the events not seen yet; returns how many have been seen."""
    events, count = meta.get("events", []), meta.get("event_count", 0)
    for message in events[max(0, len(events) - (count - seen)):]:
        on_event(message)
    return count
