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
        click.echo(f"vmmgr: error: {err}", err=True)
        sys.exit(err.exit_code)


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
