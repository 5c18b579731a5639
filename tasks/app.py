"""The Celery app: Redis as broker and result backend, one worker per host.

Queues: `host.<name>` carries work that belongs on one host (the migrations it sends, its saves);
`site.<site>` work on one site's storage (resumes and destroys of the VMs saved there, reclaims
and drains of its hosts, whose saves are written there: another site's workers do not see it); `control` fleet-wide work (placement,
reconcile). Every worker consumes its own host's queue, its site's (where it has one) and
`control`.

Delivery is at least once. A task is acknowledged only when it ends (acks_late); a worker that
dies leaves its message unacknowledged and Redis hands it to another worker after the visibility
timeout. A running task's heartbeat keeps its message from being handed out meanwhile (see
`runtime`), so only a dead worker's tasks come back, and every task looks at libvirt before it
acts, so a second run finishes the job instead of repeating it.
"""

import os

from celery import Celery

from vmmgr.paths import default_paths

VISIBILITY_TIMEOUT = int(os.environ.get("VMMGR_VISIBILITY_TIMEOUT", "30"))
RECONCILE_SECONDS = float(os.environ.get("VMMGR_RECONCILE_SECONDS", "10"))
UNACKED_INDEX = "unacked_index"  # kombu's default key, named here because the heartbeat uses it
CONTROL_QUEUE = "control"


def host_queue(host: str) -> str:
    return f"host.{host}"


def site_queue(site: str) -> str:
    """Work on a site's storage (its saves): every worker of the site consumes it. A fleet
    that names no site has one storage, seen by every worker: the control queue."""
    return f"site.{site}" if site else CONTROL_QUEUE


def queue_for(host: str | None, site: str | None = None) -> str:
    """Where a request runs: its host's worker, else its site's, else any."""
    return host_queue(host) if host else site_queue(site) if site else CONTROL_QUEUE


def broker_url() -> str:
    return default_paths().redis_url() or "redis://localhost:6379/0"


app = Celery("vmmgr", include=["tasks.ops"])
app.conf.update(
    broker_url=broker_url(),
    result_backend=broker_url(),
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "unacked_index_key": UNACKED_INDEX,
        # Look for a dead worker's messages every 5 s (kombu's default sweep is ~100 s).
        "unacked_restore_interval": 5,
        "unacked_restore_throttle": 1,
    },
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,  # a busy worker leaves waiting tasks to the others
    task_track_started=True,
    result_extended=True,
    result_expires=7 * 24 * 3600,
    task_default_queue=CONTROL_QUEUE,
    # Flower and `celery events` see tasks through these.
    worker_send_task_events=True,
    task_send_sent_event=True,
    beat_schedule={
        "reconcile": {"task": "vmmgr.reconcile", "schedule": RECONCILE_SECONDS,
                      "options": {"queue": CONTROL_QUEUE, "expires": RECONCILE_SECONDS}},
    },
)


def use_broker(url: str) -> None:
    """Point the app at another Redis (the CLI's --home may name a different state directory)."""
    if app.conf.broker_url != url:
        app.conf.broker_url = url
        app.conf.result_backend = url
        # Connections made for the old URL are cached: drop them (a process that switches is a
        # test or a CLI call, never a worker).
        app._pool = None
        app.amqp._producer_pool = None
        app._backend_cache = None
        app._local.__dict__.pop("backend", None)
