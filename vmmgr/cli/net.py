"""`vmmgr net status`: the edge's tunnels and the routes to every VM's stable address."""

import click

from .. import display
from ..addresses import pool_for
from ..edge import Edge
from ..errors import InvalidRequest
from ..paths import Paths
from .base import emit_json, cli


@cli.group()
def net() -> None:
    """Stable addresses and the WireGuard edge."""


@net.command("status")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def net_status(paths: Paths, as_json: bool) -> None:
    """Peers (host, endpoint, last handshake) and which host each VM's address is routed to."""
    edge, pool = Edge.load(paths, None), pool_for(paths)  # reads only: no lock
    if edge is None or pool is None:
        raise InvalidRequest("no edge configured (`vmmgr lab up` sets one up)")
    peers = edge.peers()
    routes = edge.routes()
    rows = [{"address": ip, "vm": vm, "host": routes.get(ip, "")}
            for ip, vm in sorted(pool.in_use().items())]
    if as_json:
        return emit_json({"peers": peers, "routes": rows})
    click.echo(display.table(["host", "endpoint", "tunnel address", "last handshake", "VM addresses"],
                             [[p["host"], p["endpoint"], p["tunnel_ip"], p["handshake"],
                               ", ".join(p["addresses"]) or "-"] for p in peers]))
    click.echo()
    click.echo(display.table(["address", "vm", "routed to"],
                             [[r["address"], r["vm"], r["host"] or "NOT ROUTED"] for r in rows]))
