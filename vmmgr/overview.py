"""What the fleet looks like now, as plain data: the hosts with their room and the VMs with their
state, address and how each would move. The CLI's listings, the web console and the REST API
read this, and this reads only the fleet's store (the view, `view.py`): no host is asked, so a
page costs the same with 3 hosts or 1,000.
"""

from .errors import NotFound
from .fleet import Fleet
from .host import Capacity
from .movability import MovesIndex
from .placement import target_choices
from . import view

ROW_KEYS = ("name", "host", "state", "memory_mib", "vcpus", "workload", "device_model",
            "device_count", "live", "not_live_because", "address")


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
    vms = fleet.state.vm_views() if vms is None else vms
    index = MovesIndex(capacities(rows if rows is not None else host_rows(fleet, vms)))
    return sorted((_row(v, index) for v in vms), key=lambda r: r["name"])


def _row(v: dict, index: MovesIndex) -> dict:
    row = {k: v.get(k) for k in ROW_KEYS}
    row["address"] = row["address"] or "-"
    if v["host"] != "-":
        row["moves_by"] = index.moves(v["host"], v["memory_mib"], v["vcpus"], v["device_model"],
                                      v["device_count"], v["live"], v["not_live_because"])
        return row
    parked = v["state"] == "parked"
    row["suspended_from"] = v.get("suspended_from", "")
    row["moves_by"] = {"mode": "resume", "reason": (
        "parked: resumes by itself when a host has room"
        + (f" and a free {v['device_model']}" if v["device_count"] else "")
        if parked else "waits for the operator's resume")}
    return row


def vm_row(fleet: Fleet, vm: str) -> dict:
    """One VM's row of `vm_rows`; NotFound for an unknown VM."""
    v = fleet.state.vm_view(vm)
    if v is None:
        raise NotFound(f"unknown VM {vm!r}")
    return _row(v, MovesIndex(capacities(host_rows(fleet))))


def targets(fleet: Fleet, vm: str) -> list[dict]:
    """Where a running VM could be live-migrated to, and why each other host could not take it."""
    v = fleet.state.vm_view(vm)
    if v is None or v["host"] == "-":
        raise NotFound(f"unknown VM {vm!r}" if v is None else f"VM {vm!r} is not running")
    choices = target_choices(v["host"], v["memory_mib"], v["vcpus"], capacities(host_rows(fleet)))
    if not v["live"]:  # no host can take it live, whatever its room
        return [c | {"ok": False, "reason": c["reason"] if c["reason"] == "the VM runs here"
                     else f"the VM cannot be live-migrated: it {v['not_live_because']}"}
                for c in choices]
    return choices
