"""`vmmgr host ...` and `vmmgr reconcile`: hosts, reclaim, drain, enable."""

from dataclasses import asdict

import click

from .. import display, reclaim, suspend as suspension
from ..errors import VmmgrError
from ..fleet import Fleet
from ..paths import Paths
from .base import emit_json, log_line, cli

@cli.group()
def host() -> None:
    """Hosts in the inventory."""


@host.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def host_list(paths: Paths, as_json: bool) -> None:
    """Hosts with their capacity, free memory and VMs."""
    rows = []
    with Fleet(paths) as fleet:
        for h in fleet.hosts():
            try:
                cap = h.capacity()
                rows.append({"name": h.name, "uri": h.uri, "accel": h.accel, "reachable": True,
                             "state": h.record.state,
                             **asdict(cap), "free_memory_mib": cap.free_memory_mib,
                             "free_vcpus": cap.free_vcpus})
            except VmmgrError as err:
                rows.append({"name": h.name, "uri": h.uri, "accel": h.accel, "reachable": False,
                             "state": h.record.state, "error": str(err)})
    if as_json:
        return emit_json(rows)
    click.echo(display.table(
        ["host", "state", "accel", "memory (free/total MiB)", "vCPUs (free/total)", "vms"],
        [[r["name"], r["state"], r["accel"],
          f"{r['free_memory_mib']}/{r['memory_mib']}" if r["reachable"] else "unreachable",
          f"{r['free_vcpus']}/{r['vcpus']}" if r["reachable"] else "-",
          ",".join(r.get("vms", ())) or "-"] for r in rows]))


@host.command("reclaim")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def host_reclaim(paths: Paths, name: str, as_json: bool) -> None:
    """Empty a host now: live-migrate what fits elsewhere, suspend the rest to disk."""
    _evacuate(paths, name, deadline=True, as_json=as_json)


@host.command("drain")
@click.argument("name")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for room.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def host_drain(paths: Paths, name: str, timeout: float, as_json: bool) -> None:
    """Empty a host by live migration only, waiting for room where there is none yet."""
    _evacuate(paths, name, deadline=False, as_json=as_json, wait_timeout=timeout)


def _evacuate(paths: Paths, name: str, deadline: bool, as_json: bool, **kw) -> None:
    with Fleet(paths) as fleet:
        report = reclaim.evacuate(fleet, name, deadline,
                                  on_event=(lambda m: None) if as_json else log_line, **kw)
    if as_json:
        return emit_json(asdict(report))
    click.echo(f"{name}: {len(report.migrated)} migrated, {len(report.suspended)} suspended, "
               f"{len(report.failed)} failed in {report.seconds} s")
    if report.failed:
        raise VmmgrError(f"{len(report.failed)} VMs could not be moved: "
                         + "; ".join(f"{vm}: {e}" for vm, e in report.failed.items()))


@host.command("enable")
@click.argument("name")
@click.pass_obj
def host_enable(paths: Paths, name: str) -> None:
    """Put a host back in service; parked VMs resume on it (or anywhere with room)."""
    with Fleet(paths) as fleet:
        resumed = reclaim.enable(fleet, name, on_event=log_line)
    click.echo(f"{name} active; {len(resumed)} parked VMs resumed")


@cli.command()
@click.pass_obj
def reconcile(paths: Paths) -> None:
    """Resume parked (suspended) VMs, oldest first, wherever there is room."""
    with Fleet(paths) as fleet:
        resumed = reclaim.resume_parked(fleet, on_event=log_line)
        left = len(suspension.suspended(fleet))
    click.echo(f"{len(resumed)} parked VMs resumed, {left} still parked")
