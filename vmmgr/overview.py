"""What the fleet looks like now, as plain data: the hosts with their room and the VMs with their
state, address and how each would move. The CLI's listings, the web console and the REST API
read this, and this reads only the fleet's store (the view, `view.py`): no host is asked, so a
page costs the same with 3 hosts or 1,000.
"""

import functools
from bisect import bisect_right
from operator import itemgetter

from .errors import NotFound
from .fleet import Fleet
from .host import Capacity
from .movability import MovesIndex
from .placement import target_choices
from . import view

def host_rows(fleet: Fleet, vms: list[dict] | None = None) -> list[dict]:
    vms = fleet.state.vm_views() if vms is None else vms
    return view.host_rows(fleet.inventory.records(), fleet.state.hosts(), vms)


def capacities(rows: list[dict]) -> dict[str, tuple[str, Capacity | None]]:
    """`host_rows` in the shape `placement.target_choices` takes."""
    return {r["name"]: (r["state"], Capacity(r["memory_mib"], r["vcpus"], r["used_memory_mib"],
                                             r["used_vcpus"], tuple(r["vms"]),
                                             tuple(r["free_devices"]))
                        if r["reachable"] else None) for r in rows}


def vm_rows(fleet: Fleet, rows: list[dict] | None = None,
            vms: list[dict] | None = None) -> list[dict]:
    """Running VMs and suspended ones, each with its address and how it would move."""
    return vm_page(fleet, rows, vms)[0]


def vm_page(fleet: Fleet, rows: list[dict] | None = None, vms: list[dict] | None = None,
            after: str = "", limit: int | None = None) -> tuple[list[dict], str | None]:
    """Up to `limit` rows of `vm_rows` (all if None), by name, from the first name after `after`;
    and the name to continue after, None on the last page. Room is worked out over the whole
    fleet; only the page's rows are completed, so a page costs little more than reading the view."""
    out = sorted(fleet.state.vm_views() if vms is None else vms, key=itemgetter("name"))
    moves = _mover(capacities(rows) if rows is not None else view.capacities(
        fleet.inventory.records(), fleet.state.hosts(), out), fleet)
    start = bisect_right(out, after, key=itemgetter("name")) if after else 0
    end = len(out) if limit is None else min(len(out), start + limit)
    page = out[start:end]
    for v in page:  # the view's rows, read just now: completed in place
        _row(v, moves)
    return page, (page[-1]["name"] if page and end < len(out) else None)


def _mover(hosts: dict, fleet: Fleet):
    """How a row's VM would move (`MovesIndex.moves`): over every host, or only its own site's
    for a VM whose disk is on its site's storage, in a fleet that names sites (it never leaves
    that site: `Fleet.require_site_holds`). The sites are read, and one index per site made,
    only when a row needs them."""
    every, by_site = MovesIndex(hosts), {}
    sites = functools.cache(fleet.sites)

    def moves(v: dict) -> dict:
        index = every
        if v.get("site_disk") and any(sites().values()):
            site = sites().get(v["host"], "")
            if site not in by_site:
                by_site[site] = MovesIndex({h: c for h, c in hosts.items()
                                            if sites().get(h, "") == site})
            index = by_site[site]
        return index.moves(v["host"], v["memory_mib"], v["vcpus"], v.get("device_model", ""),
                           v.get("device_count", 0), v.get("live", True),
                           v.get("not_live_because", ""))
    return moves


def _row(v: dict, moves) -> dict:
    """One view row with its address and how the VM would move (`_mover`)."""
    v["address"] = v.get("address") or "-"
    if v["host"] == "-":
        return _resume_row(v)
    v["moves_by"] = moves(v)
    return v


def _resume_row(v: dict) -> dict:
    parked = v["state"] == "parked"
    v.setdefault("suspended_from", "")
    v["moves_by"] = {"mode": "resume", "reason": (
        "stopped, its definition on storage: back on a host, still stopped, when one has room"
        if v["state"] == "stopped" else
        "parked: resumes by itself when a host has room"
        + (f" and a free {v['device_model']}" if v.get("device_count") else "")
        if parked else "waits for the operator's resume")}
    return v


def vm_row(fleet: Fleet, vm: str) -> dict:
    """One VM's row of `vm_rows`; NotFound for an unknown VM."""
    v = fleet.state.vm_view(vm)
    if v is None:
        raise NotFound(f"unknown VM {vm!r}")
    return _row(v, _mover(capacities(host_rows(fleet)), fleet))


def targets(fleet: Fleet, vm: str) -> list[dict]:
    """Where a running VM could be live-migrated to, and why each other host could not take it."""
    v = fleet.state.vm_view(vm)
    if v is None or v["host"] == "-":
        raise NotFound(f"unknown VM {vm!r}" if v is None else f"VM {vm!r} is not running")
    choices = target_choices(v["host"], v["memory_mib"], v["vcpus"], capacities(host_rows(fleet)))
    if v.get("site_disk"):  # it stays in its site (`Fleet.require_site_holds`)
        sites = fleet.sites()
        here = sites.get(v["host"], "")
        away = {"ok": False, "reason": f"another site: {v['site_disk']} is on its site's storage"}
        choices = [c if c["reason"] == "the VM runs here" or sites.get(c["host"], "") == here
                   else c | away for c in choices]
    if not v.get("live", True):  # no host can take it live, whatever its room
        return [c | {"ok": False, "reason": c["reason"] if c["reason"] == "the VM runs here"
                     else f"the VM cannot be live-migrated: it {v.get('not_live_because')}"}
                for c in choices]
    return choices
