"""`vmmgr migrate ...`: live migration, cancel, policies."""

from dataclasses import asdict

import click

from .. import display, requests
from ..fleet import Fleet
from ..paths import Paths
from ..policy import DEFAULT_POLICY, POLICIES, get_policy
from .base import emit_json, cli
from .dispatch import run_request, wait_option

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
@wait_option
@click.pass_obj
def migrate_start(paths: Paths, name: str, target: str, policy_name: str | None,
                  bandwidth: int | None, as_json: bool, wait: bool) -> None:
    """Live-migrate a VM to another host, with a progress bar."""
    get_policy(policy_name, bandwidth)  # InvalidRequest for an unknown policy
    with Fleet(paths) as fleet:
        req = requests.migrate(fleet, name, target, policy_name, bandwidth)
    r = run_request(paths, req, wait=wait, progress=not as_json, events=not as_json)
    if r is None:
        return
    if as_json:
        return emit_json(r)
    if r.get("already_done"):
        click.echo(f"{name}: already on {target}")
        return
    blackout = "n/a" if r["downtime_ms"] is None else f"{r['downtime_ms']} ms"
    click.echo(f"{name}: {r['source']} -> {r['target']}  total {r['total_ms']} ms  "
               f"blackout {blackout}  sent {r['bytes_transferred'] / display.MiB:.1f} MiB"
               f"  iterations {r['memory_iterations']}"
               + ("  (post-copy)" if r["postcopy"] else ""))


@migrate.command("cancel")
@click.argument("name")
@wait_option
@click.pass_obj
def migrate_cancel(paths: Paths, name: str, wait: bool) -> None:
    """Abort a VM's running migration; it keeps running where it was."""
    with Fleet(paths) as fleet:
        req = requests.cancel(fleet, name)
    r = run_request(paths, req, wait=wait)
    if r:
        click.echo(f"cancelled the migration of {name}; it keeps running on {r['host']}")


@migrate.command("policies")
@click.option("--json", "as_json", is_flag=True)
def migrate_policies(as_json: bool) -> None:
    """The named migration policies and what each guarantees."""
    if as_json:
        return emit_json([asdict(p) for p in POLICIES.values()])
    for p in POLICIES.values():
        default = " (default)" if p.name == DEFAULT_POLICY else ""
        click.echo(f"{p.name}{default}\n  {p.description}\n")
