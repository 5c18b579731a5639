"""`vmmgr lab ...`: the local lab."""

import json
import os
import uuid

import click

from .. import display
from ..deadline import parse_duration
from ..errors import NotFound
from ..lab import Lab, status_dicts
from ..lab_wan import Wan
from ..paths import Paths, lab_paths
from .base import emit_json, log_line, cli

@cli.group()
@click.pass_context
def lab(ctx: click.Context) -> None:
    """The local lab: several hosts on this machine (home: /var/lib/vmmgr-lab unless --home or
    $VMMGR_HOME says otherwise)."""
    if ctx.find_root().params.get("home") is None:
        ctx.obj = lab_paths()


@lab.command("up")
@click.option("--hosts", default=3, show_default=True, type=click.IntRange(1, 9))
@click.option("--accel", type=click.Choice(["kvm", "tcg"]), help="Skip detection and use this.")
@click.option("--plain", is_flag=True,
              help="Plain, unauthenticated TCP between the hosts instead of TLS (opt-in).")
@click.option("--sites", type=click.IntRange(1, 9),
              help="Group the hosts into this many sites, a WAN between them (default: as the "
                   "lab was; 1 at first).")
@click.option("--wan-rtt", type=click.FloatRange(0), default=40.0, show_default=True,
              help="Round trip between sites, ms.")
@click.option("--wan-rate", type=click.FloatRange(0, min_open=True), default=200.0,
              show_default=True, help="Rate between sites, Mbit/s.")
@click.option("--wan-loss", type=click.FloatRange(0, 100, max_open=True), default=0.0,
              show_default=True, help="Packets lost between sites, %.")
@click.pass_obj
def lab_up(paths: Paths, hosts: int, accel: str | None, plain: bool, sites: int | None,
           wan_rtt: float, wan_rate: float, wan_loss: float) -> None:
    """Start (or repair) a lab of N hosts, talking and migrating over TLS."""
    wan = Wan(wan_rtt / 2, wan_rate, wan_loss) if sites and sites > 1 else None
    records = Lab(paths, log=log_line).up(hosts, accel, plain=plain, sites=sites, wan=wan)
    named = any(r.site for r in records)
    click.echo(display.table(["host", "uri", "accel"] + (["site"] if named else []),
                             [[r.name, r.uri, r.accel] + ([r.site] if named else [])
                              for r in records]))
    click.echo(f"\nthe lab's home: export VMMGR_HOME={paths.home}")


@lab.command("status")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def lab_status(paths: Paths, as_json: bool) -> None:
    """The lab's hosts and whether their daemons answer."""
    statuses = Lab(paths).status()
    if as_json:
        return emit_json({"accel": Lab(paths).accel(), "hosts": status_dicts(statuses)})
    if not statuses:
        click.echo("the lab is down")
        return
    rows = [[s.name, s.ip, s.libvirtd_pid or "-", "yes" if s.reachable else "NO", s.vms]
            for s in statuses]
    click.echo(display.table(["host", "address", "libvirtd", "answers", "vms"], rows))


@lab.command("down")
@click.pass_obj
def lab_down(paths: Paths) -> None:
    """Remove every namespace, daemon, VM and link of the lab."""
    removed = Lab(paths, log=log_line).down()
    click.echo(f"removed {len(removed)} namespaces and links" if removed else "nothing to remove")


@lab.command("notice")
@click.argument("host")
@click.option("--deadline", default="30s", show_default=True, metavar="DURATION",
              help="How long until the host is taken back (30s, 2m).")
@click.pass_obj
def lab_notice(paths: Paths, host: str, deadline: str) -> None:
    """Send a lab host a preemption notice, as a cloud would: its watcher reclaims it against
    the deadline."""
    seconds = parse_duration(deadline)
    lab = Lab(paths)
    if host not in {h.name for h in lab.running_hosts()}:
        raise NotFound(f"no running lab host {host!r}")
    path = lab.services().notice_file(host)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"deadline_s": seconds, "id": str(uuid.uuid4()),
                               "reason": f"lab notice: {host} is taken back in {deadline}"}))
    os.replace(tmp, path)  # whole: the watcher never reads half a notice
    click.echo(f"{host}: notice written ({path}); taken back in {seconds:.0f} s")
