"""`vmmgr usage`: per-second usage of every VM in a window of time."""

import csv
import io
import time

import click

from .. import display, usage
from ..errors import InvalidRequest
from ..paths import Paths
from .activity import _state
from .base import cli, emit_json


def _time(text: str, now: float) -> float:
    try:
        return usage.parse_time(text, now)
    except ValueError as err:
        raise InvalidRequest(str(err)) from None


@cli.command("usage")
@click.option("--since", default="30d", show_default=True,
              help="Start: unix seconds, ISO 8601 (UTC unless it says), or 90m/6h/7d before now.")
@click.option("--until", default="", help="End (default: now); the same forms.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--csv", "as_csv", is_flag=True, help="One row per VM, seconds per state.")
@click.pass_obj
def usage_report(paths: Paths, since: str, until: str, as_json: bool, as_csv: bool) -> None:
    """Seconds each VM ran, moved (blackouts apart), waited suspended or parked, and slept
    hibernated, from its recorded state changes."""
    now = time.time()
    lo, hi = _time(since, now), _time(until, now) if until else now
    if hi <= lo:
        raise InvalidRequest("--until must come after --since")
    data = usage.report(_state(paths), lo, hi)
    if as_json:
        return emit_json(data)
    fields = ["vm", *usage.CATEGORIES]
    if as_csv:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(data["vms"])
        return click.echo(out.getvalue(), nl=False)
    click.echo(display.table([f if f == "vm" else f"{f} s" for f in fields],
                             [[row[f] for f in fields] for row in data["vms"]]))
