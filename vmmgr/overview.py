"""What the fleet looks like now, as plain data: the hosts with their room and the VMs with their
state, address and how each would move. The CLI's listings and the web console read this.
"""

from dataclasses import asdict

from . import suspend as suspension
from .addresses import pool_for
from .errors import NotFound, VmmgrError
from .fleet import Fleet
from .host import Capacity
from .movability import how_it_moves
from .placement import target_choices


def host_rows(fleet: Fleet) -> list[dict]:
    rows = []
    for h in fleet.hosts():
        row = {"name": h.name, "uri": h.uri, "accel": h.accel, "state": h.record.state,
               "devices": [asdict(d) for d in h.record.devices]}
        try:
            cap = h.capacity()
        except VmmgrError as err:
            rows.append(row | {"reachable": False, "error": str(err)})
            continue
        rows.append(row | {"reachable": True, **asdict(cap), "vms": list(cap.vms),
                           "free_memory_mib": cap.free_memory_mib, "free_vcpus": cap.free_vcpus})
    return rows


def capacities(rows: list[dict]) -> dict[str, tuple[str, Capacity | None]]:
    """`host_rows` in the shape `placement.target_choices` takes."""
    return {r["name"]: (r["state"], Capacity(r["memory_mib"], r["vcpus"], r["used_memory_mib"],
                                             r["used_vcpus"], tuple(r["vms"]),
                                             tuple(r["free_devices"]))
                        if r["reachable"] else None) for r in rows}


def vm_rows(fleet: Fleet, rows: list[dict] | None = None) -> list[dict]:
    """Running VMs and suspended ones, each with its address and how it would move."""
    hosts = capacities(rows if rows is not None else host_rows(fleet))
    pool = pool_for(fleet.paths)
    out = []
    for i in fleet.vms():
        choices = target_choices(i.host, i.memory_mib, i.vcpus, hosts, i.device_model,
                                 i.device_count)
        out.append(asdict(i) | {"moves_by": how_it_moves(choices, i.live, i.not_live_because)})
    for s in suspension.suspended(fleet):
        out.append({"name": s.vm, "host": "-", "state": "parked" if s.parked else "suspended",
                    "memory_mib": s.memory_mib, "vcpus": s.vcpus, "workload": "",
                    "suspended_from": s.from_host,
                    "device_model": s.device_model, "device_count": s.device_count,
                    "moves_by": {"mode": "resume", "reason": (
                        "parked: resumes by itself when a host has room"
                        + (f" and a free {s.device_model}" if s.device_count else "")
                        if s.parked else "waits for the operator's resume")}})
    for row in out:
        row["address"] = (pool.address_of(row["name"]) if pool else None) or "-"
    return sorted(out, key=lambda r: r["name"])


def vm_row(fleet: Fleet, vm: str) -> dict:
    """One VM's row of `vm_rows`; NotFound for an unknown VM."""
    row = next((r for r in vm_rows(fleet) if r["name"] == vm), None)
    if row is None:
        raise NotFound(f"unknown VM {vm!r}")
    return row


def targets(fleet: Fleet, vm: str) -> list[dict]:
    """Where a running VM could be live-migrated to, and why each other host could not take it."""
    guest = fleet.locate(vm)
    choices = target_choices(guest.host_name, guest.memory_mib(), guest.vcpus(),
                             capacities(host_rows(fleet)))
    live, why = guest.live_migratable()
    if not live:  # no host can take it live, whatever its room
        return [c | {"ok": False, "reason": c["reason"] if c["reason"] == "the VM runs here"
                     else f"the VM cannot be live-migrated: it {why}"} for c in choices]
    return choices
