"""`vmmgr tasks` and `vmmgr events`: what the task API did and is doing."""

import json
import time
from datetime import datetime

import click

from .. import display
from ..errors import InvalidRequest
from ..paths import Paths
from ..state import FleetState
from .base import emit_json, cli


def _state(paths: Paths) -> FleetState:
    url = paths.redis_url()
    if url is None:
        raise InvalidRequest("no task broker configured: set $VMMGR_REDIS_URL or run `vmmgr lab up`")
    return FleetState(url)


def _when(ts: str | None) -> str:
    return datetime.fromtimestamp(float(ts)).strftime("%H:%M:%S") if ts else "-"


@cli.command("tasks")
@click.option("--limit", default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def tasks_list(paths: Paths, limit: int, as_json: bool) -> None:
    """Recent tasks, newest first, with their state."""
    from celery.result import AsyncResult  # late: only this command and dispatch need Celery
    from tasks.app import app, use_broker

    fleet_state = _state(paths)
    use_broker(fleet_state.url)
    rows = []
    for t in fleet_state.recent_tasks(limit):
        result = AsyncResult(t["id"], app=app)
        status = result.state
        error = str(result.info) if status == "FAILURE" else ""
        rows.append(t | {"state": status, "error": error})
    if as_json:
        return emit_json(rows)
    click.echo(display.table(
        ["submitted", "task", "operation", "args", "queue", "worker", "runs", "state"],
        [[_when(r.get("submitted")), r["id"][:8], r["name"], _args(r["args"]), r["queue"],
          r.get("worker", "-"), r.get("runs", "0"),
          r["state"] + (f": {r['error']}" if r["error"] else "")] for r in rows]))


def _args(args_json: str) -> str:
    """`vm=c1 target=host2`: a create's spec by its name, unset options left out."""
    args = json.loads(args_json)
    return " ".join(f"{k}={v['name'] if isinstance(v, dict) and 'name' in v else v}"
                    for k, v in args.items() if v is not None)


@cli.command("events")
@click.option("--limit", default=50, show_default=True)
@click.option("--vm", help="Only this VM's events.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def events(paths: Paths, limit: int, vm: str | None, follow: bool, as_json: bool) -> None:
    """The fleet's event log, oldest first."""
    fleet_state = _state(paths)
    batch = fleet_state.events(limit, vm=vm)
    if as_json and not follow:
        return emit_json(batch)
    last = batch[-1]["id"] if batch else "0-0"
    try:
        while True:
            for e in batch:
                click.echo(f"{_when(e['time'])}  {e['kind']:6} {e.get('host') or '-':8} "
                           f"{e['message']}")
            if not follow:
                return
            time.sleep(0.5)
            batch = fleet_state.events(1000, after=last, vm=vm)
            last = batch[-1]["id"] if batch else last
    except KeyboardInterrupt:
        pass


@cli.command("audit")
@click.option("--since", default="7d", show_default=True,
              help="Start: unix seconds, ISO 8601 (UTC unless it says), or 90m/6h/7d before now.")
@click.option("--until", default="", help="End (default: now); the same forms.")
@click.option("--who", default=None, help="Only this user's requests.")
@click.option("--on", "target", default=None, help="Only requests on this VM or host.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def audit_trail(paths: Paths, since: str, until: str, who: str | None, target: str | None,
                as_json: bool) -> None:
    """Who asked for what, on what, when, and how it ended (CLI, console and API alike)."""
    from .. import audit, usage

    now = time.time()
    try:
        lo = usage.parse_time(since, now)
        hi = usage.parse_time(until, now) if until else now
    except ValueError as err:
        raise InvalidRequest(str(err)) from None
    rows = audit.trail(_state(paths).r, lo, hi, who, target)
    if as_json:
        return emit_json(rows)
    click.echo(display.table(
        ["time", "who", "via", "from", "action", "on", "outcome", "result"],
        [[datetime.fromtimestamp(float(r["time"])).strftime("%Y-%m-%d %H:%M:%S"), r["who"],
          r["via"] + (f" token {r['token']}" if r.get("token") else ""), r["client"], r["action"],
          r["target"], r["outcome"] + (f" ({r['task'][:8]})" if r.get("task") else ""),
          r["result"]] for r in rows]))
