"""The root command, the shared helpers and the error boundary of the CLI."""

import importlib
import json
import logging
import os
import sys
import threading
from pathlib import Path

import click

from ..errors import VmmgrError
from ..paths import Paths, default_paths

def main() -> None:
    try:
        result = cli(standalone_mode=False)
        code = result if isinstance(result, int) else 0  # an int: `--help` and the like
    except click.exceptions.Abort:
        code = 130
    except click.ClickException as err:
        err.show()
        code = err.exit_code
    except VmmgrError as err:
        _audit_refusal(sys.argv[1:], err)
        click.echo(f"vmmgr: error: {err}", err=True)
        code = err.exit_code
    exit_now(code)


def exit_now(code: int) -> None:
    """Exit without Python's teardown of the ~400 modules Celery, kombu, redis and libvirt bring:
    it takes 40-90 ms (bench/hop.py's `result` phase) and does nothing a finished command needs
    once its output is flushed. A normal exit when a non-daemon thread still runs, which Python
    would wait for."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (`vmmgr vm list | head -1`): nobody to tell
            pass
    logging.shutdown()
    if any(t.is_alive() and not t.daemon and t is not threading.main_thread()
           for t in threading.enumerate()):
        sys.exit(code)
    os._exit(code)


# Commands that change nothing: their failures are not requests refused.
READ_ONLY = {"tasks", "events", "demo", "lab", "web", "usage", "audit", "net status",
             "host list", "migrate policies", "user list", "user tokens", "vm list", "vm show",
             "vm console"}
SECRET = {"password"}


def _audit_refusal(argv: list[str], err: VmmgrError) -> None:
    """A mutating command refused before it was handed to a task or run (nothing changed):
    into the audit trail, if there is one. After that, the task's run records its outcome."""
    from . import dispatch

    if dispatch.handed_over:
        return
    path, params = _command_of(argv)
    action = " ".join(path)
    if not path or path[0] in READ_ONLY or action in READ_ONLY:
        return
    home = params.pop("home", None)
    target = next((str(params[k]) for k in ("name", "vm", "host") if params.get(k)), "")
    audit_cli(Paths(Path(home)) if home else default_paths(), action, target, f"refused: {err}",
              {k: v for k, v in params.items() if k not in SECRET and v is not None})


def _command_of(argv: list[str]) -> tuple[list[str], dict]:
    """The command path and its parameters, parsed as click parsed them (without running
    anything): `vm create NAME --memory 256` -> (["vm", "create"], {"name": ..., ...})."""
    try:
        ctx = cli.make_context("vmmgr", list(argv), resilient_parsing=True)
        params, cmd, path = dict(ctx.params), cli, []
        rest = _rest(ctx)
        while isinstance(cmd, click.Group) and rest:
            name, cmd, rest = cmd.resolve_command(ctx, rest)
            if cmd is None:
                break
            path.append(name)
            ctx = cmd.make_context(name, rest, parent=ctx, resilient_parsing=True)
            params |= ctx.params
            rest = _rest(ctx)
        return path, params
    except (click.ClickException, click.exceptions.Exit, IndexError):
        return [], {}


def _rest(ctx: click.Context) -> list[str]:
    # A group's subcommand and its words: click 8.2+ keeps them apart (and deprecates reading
    # `protected_args`; from click 9 `args` alone holds them).
    return [*getattr(ctx, "_protected_args", ()), *ctx.args]


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


# Each top-level command and the module that defines it: a command's module is imported only when
# it runs (or help lists it), so `vmmgr migrate` does not pay for `vmmgr lab`'s imports. The CLI's
# start-up is part of every hop an operator waits for (bench/hop.py).
COMMAND_MODULES = {"audit": "activity", "demo": "demo", "events": "activity", "host": "hosts",
                   "image": "images", "lab": "lab", "migrate": "migrate", "net": "net",
                   "notice": "notices", "reconcile": "hosts", "tasks": "activity",
                   "usage": "usage", "user": "users", "vm": "vms", "web": "users"}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMAND_MODULES))

    def get_command(self, ctx: click.Context, name: str):
        if name not in self.commands and name in COMMAND_MODULES:
            importlib.import_module(f"{__package__}.{COMMAND_MODULES[name]}")  # registers it
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup)
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
    from .. import display

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
