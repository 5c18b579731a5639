"""`vmmgr notice ...`: the per-host preemption notice watcher."""

import os
import time

import click

from .. import metrics, notices, requests
from ..fleet import Fleet
from ..paths import Paths
from ..state import FleetState
from .base import cli, log_line
from .dispatch import run_request

MARGIN_S = 2.0  # kept back from a notice's deadline for the records and the host's own shutdown


@cli.group()
def notice() -> None:
    """Preemption notices: reclaim a host against the deadline its cloud gives."""


@notice.command("watch")
@click.option("--host", "host_name", default=lambda: os.environ.get("VMMGR_HOST"),
              help="The host watched (default: $VMMGR_HOST).")
@click.option("--source", "spec", default=lambda: os.environ.get("VMMGR_NOTICE_SOURCE"),
              help="gce, aws, file:PATH or an http(s) URL (default: $VMMGR_NOTICE_SOURCE).")
@click.option("--interval", default=1.0, show_default=True, help="Seconds between polls.")
@click.option("--once", is_flag=True, help="Poll once and exit (0: acted or nothing to do).")
@click.pass_obj
def notice_watch(paths: Paths, host_name: str | None, spec: str | None, interval: float,
                 once: bool) -> None:
    """Poll the source; on a notice, reclaim this host against its deadline (once per notice)."""
    if not host_name or not spec:
        raise click.UsageError("--host and --source are needed (or $VMMGR_HOST and "
                               "$VMMGR_NOTICE_SOURCE)")
    src = notices.source(spec)
    url = paths.redis_url()
    src.memory = notices.FirstSeen(FleetState(url).r if url else None, host_name)
    log_line(f"watching {spec} for notices to {host_name}")
    while True:
        try:
            found = src.poll()
            if found is not None:
                act(paths, host_name, found)
        except Exception as err:  # noqa: BLE001 - a watcher that dies misses the next notice
            # (a malformed document, a store or broker that does not answer: try again)
            log_line(f"notice: {type(err).__name__}: {err}")
        if once:
            return
        time.sleep(interval)


def act(paths: Paths, host: str, found: notices.Notice) -> bool:
    """Reclaim `host` against the notice's deadline, unless another watcher already did."""
    if notices.is_stale(found, time.time()):
        return False
    state = FleetState(paths.redis_url())
    if not notices.first_time(state.r, host, found):
        return False
    left = found.deadline_at - time.time() - MARGIN_S
    try:
        with Fleet(paths) as fleet:
            req = requests.evacuate(fleet, host, True, deadline_s=min(86400.0, max(1.0, left)))
        run_request(paths, req, wait=False)
    except BaseException:
        notices.forget(state.r, host, found)  # not acted on: the next poll tries again
        raise
    # recorded once it is acted on (a refused attempt, retried, is not a second notice)
    state.event(f"{host}: {found.detail or found.source + ' notice'}: taken back in "
                f"{left + MARGIN_S:.0f} s; reclaim submitted against that deadline", host=host,
                kind="notice")
    metrics.count(state.r, "notices", found.source)
    return True
