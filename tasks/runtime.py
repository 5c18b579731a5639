"""One run of an operation task: its locks, its heartbeat, its progress and its events.

The submitter takes the VM's (or host's) lock in the task's name before queueing it, so a
conflicting request is refused at once; the run re-takes the same lock (same owner: the task id,
which a redelivered message keeps) and holds it with a heartbeat. The heartbeat also keeps the
task's message from being redelivered while it runs: kombu's Redis transport redelivers an
unacknowledged message once its entry in the unacked index is older than the visibility timeout,
so refreshing that entry means "still working on it".
"""

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

from celery.signals import task_received, worker_ready

from vmmgr import audit, errors, view
from vmmgr.locks import Lease
from vmmgr.paths import default_paths
from vmmgr.state import FleetState, stored

from vmmgr.inventory import Inventory

from .app import UNACKED_INDEX, VISIBILITY_TIMEOUT, site_queue

HEARTBEAT = max(1.0, VISIBILITY_TIMEOUT / 3)
LOCK_TTL = 2 * VISIBILITY_TIMEOUT  # outlives a dead worker until its task is redelivered
EVENTS_IN_META = 200

_delivery_tags: dict[str, str] = {}  # task id -> its message's tag, for the heartbeat


@task_received.connect
def _remember_delivery_tag(request=None, **_):
    tag = getattr(request.message, "delivery_tag", None) if request is not None else None
    if tag:
        _delivery_tags[request.id] = tag


@worker_ready.connect
def _announce_ready(sender=None, **_):
    # The fleet view follows this host's libvirt events (view.follow_host) for as long as the
    # worker runs.
    threading.Thread(target=view.follow_host, name="view-events", daemon=True,
                     args=(default_paths(), worker_host(), threading.Event(),
                           logging.getLogger("vmmgr.view").warning)).start()
    # `vmmgr lab up` (and an operator's health check) wait for this key.
    state().r.set(f"vmmgr:worker:{worker_host()}", f"{os.getpid()} {sender.hostname}")
    try:
        _consume_own_sites_queue(sender)
    except Exception:  # noqa: BLE001 - started on its queues all the same; said in its log
        logging.getLogger("vmmgr.worker").exception("its site's queue not checked")


def _consume_own_sites_queue(consumer) -> None:
    """The site queue of this host's site as the inventory names it, if the worker was not
    started on it (`-Q`, the role's `vmmgr_worker_site`): a site's resumes and reclaims must never
    wait on a queue none of its workers reads because one setting was missed."""
    site = {r.name: r.site for r in Inventory(state().r).records()}.get(worker_host(), "")
    if site and not consumer.task_consumer.consuming_from(site_queue(site)):
        logging.getLogger("vmmgr.worker").warning(
            "%s is in site %s but was not started on its queue: consuming %s", worker_host(),
            site, site_queue(site))
        consumer.add_task_queue(site_queue(site))


def worker_host() -> str:
    return os.environ.get("VMMGR_HOST") or socket.gethostname()


def state() -> FleetState:
    return FleetState(default_paths().redis_url() or "redis://localhost:6379/0")


def run_once(task, lock: "LockSpec | None", body):
    """`body(run)` as a run of `task`, unless a run has already ended it.

    A message comes back when its acknowledgement is lost: a broker restart drops the
    connection a finished task would have acknowledged on. Running it again could undo what
    came after it (a reclaim emptying a host re-enabled since), so the redelivered message
    answers with the outcome recorded when the task ended. A run that died mid-way recorded
    nothing, and runs again.
    """
    task_id = task.request.id
    ended = state().task(task_id).get("outcome")
    if ended:
        state().event(f"task {task_id} had already ended: its redelivered message is not run",
                      task=task_id)
        return replay(json.loads(ended))
    with Run(task, lock) as run:
        try:
            result = body(run)
        except Exception as err:
            run.ended({"error": type(err).__name__, "message": str(err)})
            _audit(run, task, f"failed: {err}")
            raise
        run.ended({"result": result})
        _audit(run, task, "ok")
        return result


def _audit(run, task, outcome: str) -> None:
    try:
        audit.ended(run.state.r, run.id, getattr(task, "name", "").removeprefix("vmmgr."), outcome)
    except Exception:  # the trail must not fail the operation; its request is recorded
        pass


def replay(outcome: dict):
    """The recorded outcome again: the result, or the error (as the operator's kind of error)."""
    if "result" in outcome:
        return outcome["result"]
    kind = getattr(errors, outcome["error"], None)
    if isinstance(kind, type) and issubclass(kind, errors.VmmgrError):
        try:
            error = kind(outcome["message"])
        except TypeError:  # a class that needs more than its message to build
            error = errors.VmmgrError(outcome["message"])
        raise error
    raise RuntimeError(f"{outcome['error']}: {outcome['message']}")


@dataclass(frozen=True)
class LockSpec:
    kind: str  # "vm", "host" or "fleet"
    name: str
    what: str


class Run:
    def __init__(self, task, lock: LockSpec | None):
        self.task = task
        self.id = task.request.id
        self.lock = lock
        self.state = state()
        self.events: list[str] = []
        self.progress_record: dict | None = None
        self.rerun = False  # a redelivered task: an earlier run may have done part of the work
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)

    def __enter__(self) -> "Run":
        runs = self.state.task_started(self.id, worker_host())
        self.rerun = runs > 1 or bool(self.task.request.delivery_info.get("redelivered"))
        if self.lock:  # taken over from the submitter (same owner: the task id), renewed
            self._lease = Lease(self.state, self.lock.kind, self.lock.name, self.id,
                                self.lock.what, ttl=LOCK_TTL).__enter__()
        self._beat.start()
        if self.rerun:
            self.event(f"run {runs} of this task: checking what the earlier run did")
        return self

    def ended(self, outcome: dict) -> None:
        # Before Celery stores the result and acknowledges: an outage delays this, never loses
        # it. If the store stays away, a redelivery runs again, as any rerun does.
        try:
            stored(lambda: self.state.task_ended(self.id, outcome))
        except Exception:
            pass

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._beat.join()
        if self.lock:
            self._lease.__exit__(None, None, None)
        try:  # the task is over: nothing may stay locked in its name (a dead earlier run's steps)
            self.state.release_owned(self.id)
        except Exception:
            pass  # they expire by themselves
        _delivery_tags.pop(self.id, None)

    def event(self, message: str, vm: str = "", host: str = "", kind: str = "info") -> None:
        if not vm and self.lock and self.lock.kind == "vm":
            vm = self.lock.name
        if not host and self.lock and self.lock.kind == "host":
            host = self.lock.name
        self.state.event(message, kind=kind, vm=vm, host=host, task=self.id)
        with self._mutex:
            self.events.append(message)
            self._push()

    def progress(self, progress) -> None:
        """The engine's progress callback: a JobProgress, or None when the job ends."""
        with self._mutex:
            self.progress_record = progress.as_dict() if progress is not None else None
            self._push()

    def _push(self) -> None:
        # task_id given: the engine may call from its own threads, where the task's request
        # context (thread-local) is empty.
        self.task.update_state(task_id=self.id, state="PROGRESS", meta={
            "events": self.events[-EVENTS_IN_META:], "event_count": len(self.events),
            "progress": self.progress_record})

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            try:
                tag = _delivery_tags.get(self.id)
                if tag:
                    self.state.r.zadd(UNACKED_INDEX, {tag: time.time()}, xx=True)
            except Exception:  # a Redis hiccup must not kill the operation; the next beat retries
                continue
