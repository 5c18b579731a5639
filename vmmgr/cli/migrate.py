"""`vmmgr migrate ...`: live migration, cancel, policies."""

from dataclasses import asdict

import click

from .. import display
from ..fleet import Fleet
from ..migration import cancel as cancel_migration, migrate as run_migration
from ..paths import Paths
from ..policy import DEFAULT_POLICY, POLICIES, get_policy
from .base import emit_json, progress_printer, cli

class _StartByDefault(click.Group):
    """`vmmgr migrate NAME --to HOST` means `vmmgr migrate start NAME --to HOST`."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["start", *args]
        return super().parse_args(ctx, args)


@cli.group(cls=_StartByDefault)
def migrate() -> None:
    """Live-migrate VMs: `migrate NAME --to HOST`, `migrate cancel NAME`, `migrate policies`."""


@migrate.command("start")
@click.argument("name")
@click.option("--to", "target", required=True, help="Destination host.")
@click.option("--policy", "policy_name", help=f"Migration policy (default {DEFAULT_POLICY}).")
@click.option("--bandwidth", type=int, help="Cap in MiB/s (default: unlimited).")
@click.option("--json", "as_json", is_flag=True, help="Print the result record as JSON.")
@click.pass_obj
def migrate_start(paths: Paths, name: str, target: str, policy_name: str | None,
                  bandwidth: int | None, as_json: bool) -> None:
    """Live-migrate a VM to another host, with a progress bar."""
    policy = get_policy(policy_name, bandwidth)
    show = progress_printer(enabled=not as_json)
    with Fleet(paths) as fleet:
        try:
            result = run_migration(fleet, name, target, policy=policy, on_progress=show)
        finally:
            show(None)
    if as_json:
        return emit_json(result.as_dict())
    click.echo(f"{name}: {result.source} -> {result.target}  total {result.total_ms} ms  "
               f"blackout {'n/a' if result.downtime_ms is None else f'{result.downtime_ms} ms'}  sent {result.bytes_transferred / display.MiB:.1f} MiB"
               f"  iterations {result.memory_iterations}"
               + ("  (post-copy)" if result.postcopy else ""))


@migrate.command("cancel")
@click.argument("name")
@click.pass_obj
def migrate_cancel(paths: Paths, name: str) -> None:
    """Abort a VM's running migration; it keeps running where it was."""
    with Fleet(paths) as fleet:
        source = cancel_migration(fleet, name)
    click.echo(f"cancelled the migration of {name}; it keeps running on {source}")


@migrate.command("policies")
@click.option("--json", "as_json", is_flag=True)
def migrate_policies(as_json: bool) -> None:
    """The named migration policies and what each guarantees."""
    if as_json:
        return emit_json([asdict(p) for p in POLICIES.values()])
    for p in POLICIES.values():
        default = " (default)" if p.name == DEFAULT_POLICY else ""
        click.echo(f"{p.name}{default}\n  {p.description}\n")
