"""`vmmgr host ...` and `vmmgr reconcile`: hosts, reclaim, drain, enable."""

from dataclasses import asdict

import click

from .. import devices, display, overview, requests, suspend as suspension
from ..deadline import parse_duration
from ..errors import Conflict, VmmgrError
from ..fleet import Fleet
from ..inventory import HostRecord
from ..paths import Paths
from ..spec import validate_name
from .base import emit_json, cli
from .dispatch import run_operation, run_request, wait_option

@cli.group()
def host() -> None:
    """Hosts in the inventory."""


@host.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def host_list(paths: Paths, as_json: bool) -> None:
    """Hosts with their capacity, free memory and VMs."""
    with Fleet(paths) as fleet:
        rows = overview.host_rows(fleet)
    if as_json:
        return emit_json(rows)
    named = any(r.get("site") for r in rows)  # a fleet that names no site shows none
    click.echo(display.table(
        ["host"] + (["site"] if named else []) + [
            "state", "accel", "memory (free/total MiB)", "vCPUs (free/total)",
            "devices (free/total)", "vms"],
        [[r["name"]] + ([r.get("site") or "-"] if named else []) + [
            r["state"], r["accel"],
            f"{r['free_memory_mib']}/{r['memory_mib']}" if r["reachable"] else "unreachable",
            f"{r['free_vcpus']}/{r['vcpus']}" if r["reachable"] else "-",
            _devices(r), ",".join(r.get("vms", ())) or "-"] for r in rows]))


def _devices(row: dict) -> str:
    models = sorted({d["model"] for d in row["devices"]})
    return ", ".join(f"{row.get('free_devices', []).count(m)}/"
                     f"{sum(d['model'] == m for d in row['devices'])} {m}" for m in models) or "-"


@host.command("add")
@click.argument("name")
@click.option("--uri", required=True, help="libvirt URI, e.g. qemu+tls://host4.example/system.")
@click.option("--accel", type=click.Choice(["kvm", "tcg"]), default="kvm", show_default=True)
@click.option("--memory", default=0, help="MiB vmmgr may hand out (default: all the host has).")
@click.option("--vcpus", default=0, help="vCPUs vmmgr may hand out (default: its CPU count).")
@click.option("--device", "device_specs", multiple=True, metavar="ADDRESS=MODEL[:KIND]",
              help="A passed-through device VMs may ask for, e.g. 0000:65:00.0=a100-80g "
                   "(KIND: vfio, the default, or standin in a lab).")
@click.option("--plain-migration", is_flag=True,
              help="Migrate to it over plain TCP (unencrypted): only for a host whose QEMU is "
                   "not set up for TLS. The kvm_host role sets up TLS.")
@click.option("--site", default="", metavar="NAME",
              help="Where it is (a region, a cloud, a cluster): moves stay inside a site while "
                   "it has room.")
@wait_option
@click.pass_obj
def host_add(paths: Paths, name: str, uri: str, accel: str, memory: int, vcpus: int,
             device_specs: tuple[str, ...], plain_migration: bool, site: str,
             wait: bool) -> None:
    """Add a host; it must answer first. Parked VMs resume on it if they fit."""
    validate_name(name, "host")
    if site:
        validate_name(site, "site")
    record = HostRecord(name, uri, accel, memory, vcpus,
                        devices=tuple(devices.parse(d) for d in device_specs),
                        tls=not plain_migration, site=site)
    with Fleet(paths) as fleet:
        if name in {r.name for r in fleet.inventory.records()}:
            raise Conflict(f"host {name!r} already exists")

    r = run_operation(paths, "add_host", {"record": asdict(record)}, host=None,
                      lock=("host", name, f"add of {name}"), wait=wait)
    if r:
        click.echo(f"{name} added; {len(r['resumed'])} parked VMs resumed")


@host.command("reclaim")
@click.argument("name")
@click.option("--deadline", metavar="DURATION",
              help="Everything must be safe (running elsewhere or saved) within this time, e.g. "
                   "30s or 2m: a plan that races it, said before it starts.")
@click.option("--json", "as_json", is_flag=True)
@wait_option
@click.pass_obj
def host_reclaim(paths: Paths, name: str, deadline: str | None, as_json: bool,
                 wait: bool) -> None:
    """Empty a host now: live-migrate what fits elsewhere, suspend the rest to disk."""
    _evacuate(paths, name, deadline=True, as_json=as_json, wait=wait,
              deadline_s=parse_duration(deadline) if deadline else None)


@host.command("drain")
@click.argument("name")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for room.")
@click.option("--json", "as_json", is_flag=True)
@wait_option
@click.pass_obj
def host_drain(paths: Paths, name: str, timeout: float, as_json: bool, wait: bool) -> None:
    """Empty a host by live migration only, waiting for room where there is none yet."""
    _evacuate(paths, name, deadline=False, as_json=as_json, wait=wait, wait_timeout=timeout)


def _evacuate(paths: Paths, name: str, deadline: bool, as_json: bool, wait: bool, **kw) -> None:
    with Fleet(paths) as fleet:
        req = requests.evacuate(fleet, name, deadline, kw.get("wait_timeout", 600.0),
                                kw.get("deadline_s"))
    report = run_request(paths, req, wait=wait, events=not as_json)
    if report is None:
        return
    if as_json:
        return emit_json(report)
    click.echo(f"{name}: {len(report['migrated'])} migrated, "
               f"{len(report.get('hibernated', []))} moved by guest hibernation, "
               f"{len(report['suspended'])} "
               f"suspended, {len(report['failed'])} failed in {report['seconds']} s")
    if "safe_at" in report:
        late = report["late"]
        click.echo(f"{len(report['safe_at']) - len(set(late) & set(report['safe_at']))} of "
                   f"{len(report['safe_at']) + len(set(late) - set(report['safe_at']))} VMs safe "
                   f"within the {report['deadline_s']:.0f} s deadline"
                   + (f"; late or not saved: {', '.join(late)}" if late else ""))
    if report["failed"]:
        raise VmmgrError(f"{len(report['failed'])} VMs could not be moved: "
                         + "; ".join(f"{vm}: {e}" for vm, e in report["failed"].items()))


@host.command("enable")
@click.argument("name")
@wait_option
@click.pass_obj
def host_enable(paths: Paths, name: str, wait: bool) -> None:
    """Put a host back in service; parked VMs resume on it (or anywhere with room)."""
    with Fleet(paths) as fleet:
        req = requests.enable(fleet, name)
    r = run_request(paths, req, wait=wait)
    if r:
        click.echo(f"{name} active; {len(r['resumed'])} parked VMs resumed")


@cli.command()
@wait_option
@click.pass_obj
def reconcile(paths: Paths, wait: bool) -> None:
    """Resume parked (suspended) VMs, oldest first, wherever there is room; with the task API,
    also repair fleet records that drifted from libvirt."""
    r = run_operation(paths, "reconcile", {}, host=None, lock=None, wait=wait)
    if r is None:
        return
    if "skipped" in r:
        click.echo(f"reconcile skipped: {r['skipped']}")
        return
    with Fleet(paths) as fleet:
        left = len(suspension.suspended(fleet))
    click.echo(f"{len(r['resumed'])} parked VMs resumed, {left} still parked, "
               f"{len(r['repaired'])} records repaired")
