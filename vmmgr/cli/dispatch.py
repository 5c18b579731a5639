"""How a mutating command runs: through the task API when a broker is configured (the lab
writes one; production sets $VMMGR_REDIS_URL), or, with `--in-process`, right here: the same
operation body (`vmmgr.operations`) under the same lock a task would hold.

The CLI is the one part of `vmmgr` that talks to Celery, and only here, imported late: the core
library stays free of it.
"""

import os
from contextlib import nullcontext

import click

from ..fleet import Fleet
from ..locks import Lease
from ..paths import Paths
from .. import audit
from .base import audit_cli, log_line, progress_printer


handed_over = False  # the request was checked and handed to a task (or run here)


def wait_option(f):
    return click.option("--wait/--no-wait", default=True, show_default=True,
                        help="Follow the task to its end (with progress), or only submit it.")(f)


def in_process() -> bool:
    return os.environ.get("VMMGR_IN_PROCESS") == "1"


def run_request(paths: Paths, req, *, wait: bool, progress: bool = False,
                events: bool = True) -> dict | None:
    """`run_operation` for a checked `vmmgr.requests.Request`."""
    return run_operation(paths, req.op, req.kwargs, host=req.host, lock=req.lock, wait=wait,
                         progress=progress, events=events, site=req.site)


def run_operation(paths: Paths, op: str, kwargs: dict, *, host: str | None,
                  lock: tuple[str, str, str] | None, wait: bool, progress: bool = False,
                  events: bool = True, site: str | None = None) -> dict | None:
    """The operation's result, or None when it was only submitted (--no-wait).

    `host` names the host whose worker should run it; else `site`, the site whose workers
    should (None: any worker, on the control queue).
    """
    global handed_over
    handed_over = True  # from here on, the outcome is the operation's, recorded by its run
    url = paths.redis_url()
    if url is None or in_process():
        return _here(paths, op, kwargs, lock, progress, events)
    from tasks import client
    from tasks.app import queue_for, use_broker
    from tasks.runtime import LockSpec

    use_broker(url)
    queue = queue_for(host, site)
    task_id = client.submit(paths, op, kwargs, queue, LockSpec(*lock) if lock else None)
    if not wait:
        click.echo(f"submitted {op}: task {task_id}")
        return None
    log_line(f"task {task_id} ({op}) on queue {queue}")
    show = progress_printer(enabled=progress)
    return client.wait(task_id, on_progress=show,
                       on_event=log_line if events else (lambda m: None))


def _here(paths: Paths, op: str, kwargs: dict, lock, progress: bool, events: bool) -> dict:
    """The operation's one body in this process, holding the lock a task would hold."""
    from .. import operations, reconcile

    show = progress_printer(enabled=progress)
    with Fleet(paths) as fleet:
        report = operations.LocalReport(fleet, log_line if events else (lambda m: None), show)
        if op == "reconcile":
            lock = ("fleet", "reconcile", "reconcile")
        held = Lease(fleet.state, lock[0], lock[1], fleet.owner, lock[2]) if lock else nullcontext()
        outcome = "failed"
        try:
            with held:
                if op == "reconcile":
                    result = reconcile.reconcile(fleet, report)
                else:
                    result = operations.OPERATIONS[op](fleet, report, **kwargs)
            outcome = "ok"
            return result
        except Exception as err:
            outcome = f"failed: {err}"
            raise
        finally:
            show(None)
            audit_cli(paths, op, audit.target_of(kwargs), f"{outcome} (run in the CLI)", kwargs)
