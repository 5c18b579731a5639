"""The root command, the shared helpers and the error boundary of the CLI."""

import json
import os
import sys
from pathlib import Path

import click

from .. import display
from ..errors import VmmgrError
from ..paths import Paths, default_paths

def main() -> None:
    try:
        cli(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except VmmgrError as err:
        _audit_refusal(sys.argv[1:], err)
        click.echo(f"vmmgr: error: {err}", err=True)
        sys.exit(err.exit_code)


# Commands that change nothing: their failures are not requests refused.
READ_ONLY = {"tasks", "events", "demo", "lab", "web", "usage", "audit", "net status",
             "host list", "migrate policies", "user list", "user tokens", "vm list", "vm show",
             "vm console"}
VALUED = {"--home"}  # top-level options that take a value


def _audit_refusal(argv: list[str], err: VmmgrError) -> None:
    """A mutating command refused (nothing changed): into the audit trail, if there is one."""
    words, skip = [], False
    for w in argv:
        if skip or w in VALUED:
            skip = not skip if w in VALUED else False
            continue
        if not w.startswith("-"):
            words.append(w)
    if not words or words[0] in READ_ONLY or " ".join(words[:2]) in READ_ONLY:
        return
    home = argv[argv.index("--home") + 1] if "--home" in argv[:-1] else None
    audit_cli(Paths(Path(home)) if home else default_paths(), " ".join(words[:2]),
              words[2] if len(words) > 2 else "", f"refused: {err}", {"argv": argv})


def audit_cli(paths: Paths, action: str, target: str, outcome: str,
              args: dict | None = None) -> None:
    """Record a CLI action done here (not through a task) in the audit trail."""
    from .. import audit
    from ..state import FleetState

    try:
        url = paths.redis_url()
        if url:
            audit.record(FleetState(url).r, audit.cli_actor(), action, target, args, outcome)
    except Exception:
        pass  # no store reachable: the command's own outcome stands


def log_line(msg: str) -> None:
    click.echo(f"  {msg}", err=True)


def emit_json(data) -> None:
    # Indented for people; a long listing (20,000 VMs) compact, which Python encodes 15x faster.
    long = isinstance(data, list) and len(data) > 100
    click.echo(json.dumps(data, indent=None if long else 2, default=str))


@click.group()
@click.option("--home", type=click.Path(file_okay=False, path_type=Path), envvar="VMMGR_HOME",
              help="State directory (default /var/lib/vmmgr, or $VMMGR_HOME).")
@click.option("--in-process", is_flag=True,
              help="Run operations here, not through the task API: the same bodies under the "
                   "same locks (for a fleet whose workers are down).")
@click.pass_context
def cli(ctx: click.Context, home: Path | None, in_process: bool) -> None:
    """vmmgr: resumable compute on QEMU/KVM."""
    ctx.obj = Paths(home) if home else default_paths()
    if in_process:
        os.environ["VMMGR_IN_PROCESS"] = "1"


def progress_printer(enabled: bool):
    """A callback that redraws one progress line on a terminal (one line per update otherwise),
    with the engine's actions and warnings printed once above it."""
    tty = sys.stderr.isatty()
    state = {"drawn": False, "warned": set()}

    def show(progress) -> None:
        if not enabled:
            return
        if progress is None:
            if state["drawn"] and tty:
                click.echo("", err=True)
            state["drawn"] = False
            return
        for note in display.progress_notes(progress, state["warned"]):
            click.echo(("\r\033[K" + note) if tty else note, err=True)
        if progress.warning:
            state["warned"].add(progress.warning)
        line = display.progress_line(progress)
        click.echo(("\r\033[K" + line) if tty else line, err=True, nl=not tty)
        state["drawn"] = True

    return show
