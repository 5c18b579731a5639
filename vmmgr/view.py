"""The fleet view: one row per VM in the fleet's store, what listings, pages and the API read.

Asking every host's libvirtd per request does not scale (1,000 hosts are 1,000 connections
per page view), so reads come from rows that are written from libvirt instead: by each operation
on the VM it changed (create, migrate, suspend, resume, destroy), and whole by every reconcile,
which also catches what changed behind vmmgr's back. Host rows are computed from the inventory,
the reconcile's host snapshot (reachability, what a host reports) and the VM rows on it.
"""

import time
from dataclasses import asdict
from operator import itemgetter

from .host import Capacity


# Left out of a row where they hold these (most VMs): a listing parses 20,000 rows, and a reader
# takes a missing one as its default.
DEFAULTS = {"device_model": "", "device_count": 0, "live": True, "not_live_because": "",
            "held": [], "site_disk": ""}


def guest_row(info) -> dict:
    """A running (or defined) VM's row, from `Fleet._info`."""
    return _slim(asdict(info) | {"held": list(info.held)})


def _slim(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in DEFAULTS or DEFAULTS[k] != v}


def suspended_row(save: dict | None) -> dict | None:
    """A suspended VM's row, from the store's copy of its save (`suspend.folder_save`); None
    where it has no record, or a resume has claimed it (its host tells then)."""
    if save is None or save["record"] is None or save["state"] == "claimed":
        return None
    record, address = save["record"], save["address"]
    return _slim({"name": record["vm"], "host": "-",
                  "state": ("stopped" if record.get("mode") == "stopped"  # its definition
                            else "parked" if record.get("parked") else "suspended"),
                  "memory_mib": record["memory_mib"], "vcpus": record["vcpus"], "workload": "",
                  "device_model": record.get("device_model", ""),
                  "device_count": record.get("device_count", 0), "address": address,
                  "suspended_from": record["from_host"], "suspended_at": record["suspended_at"]})


def capacities(records, snapshot: dict[str, dict], rows: list[dict]
               ) -> dict[str, tuple[str, Capacity | None]]:
    """Each host's state and room (None: unreachable or never seen), from the VM rows on it,
    in the shape `placement.target_choices` takes: what a listing of VMs needs of the hosts,
    without building their rows."""
    used: dict[str, list] = {}
    for row in rows:
        u = used.get(row["host"])
        if u is None:
            u = used[row["host"]] = [0, 0, []]
        u[0] += row["memory_mib"]
        u[1] += row["vcpus"]
        if "held" in row:
            u[2] += row["held"]
    out = {}
    for r in records:
        snap = snapshot.get(r.name, {})
        memory = r.memory_mib or snap.get("memory_mib", 0)
        vcpus = r.vcpus or snap.get("vcpus", 0)
        if not snap.get("reachable", True) or not (memory and vcpus):
            out[r.name] = (r.state, None)
            continue
        mem, cpu, held = used.get(r.name, (0, 0, ()))
        out[r.name] = (r.state, Capacity(memory, vcpus, mem, cpu, (), tuple(
            d.model for d in r.devices if d.address not in held)))
    return out


def host_rows(records, snapshot: dict[str, dict], rows: list[dict]) -> list[dict]:
    """Each host (inventory record) with its room, from the VM rows on it: pure."""
    on_host: dict[str, list[dict]] = {}
    for row in sorted(rows, key=itemgetter("name")):
        on_host.setdefault(row["host"], []).append(row)
    out = []
    for r in records:
        base = {"name": r.name, "uri": r.uri, "accel": r.accel, "state": r.state,
                "site": r.site, "devices": [asdict(d) for d in r.devices]}
        snap = snapshot.get(r.name, {})
        memory = r.memory_mib or snap.get("memory_mib", 0)
        vcpus = r.vcpus or snap.get("vcpus", 0)
        if not snap.get("reachable", True) or not (memory and vcpus):
            out.append(base | {"reachable": False,
                               "error": snap.get("error", "not seen by a reconcile yet")})
            continue
        mine = on_host.get(r.name, ())
        held = {a for v in mine for a in v.get("held", ())} if r.devices else set()
        used_memory, used_vcpus = sum(v["memory_mib"] for v in mine), sum(v["vcpus"] for v in mine)
        out.append(base | {"reachable": True, "memory_mib": memory, "vcpus": vcpus,
                           "used_memory_mib": used_memory, "used_vcpus": used_vcpus,
                           "vms": [v["name"] for v in mine],
                           "free_devices": [d.model for d in r.devices if d.address not in held],
                           "free_memory_mib": memory - used_memory,
                           "free_vcpus": vcpus - used_vcpus})
    return out


RELOOK = 2.0  # s between looks at a VM an operation holds (it writes its own row as it ends)


def follow_host(paths, host: str, stop, log=lambda m: None) -> None:
    """Keep the view's rows of the VMs on `host` in step with its libvirt lifecycle events (a
    guest that powers itself off, crashes, or is changed behind vmmgr's back), until `stop` is
    set: one per host, in its worker. Reconnects when the host's libvirtd restarts."""
    import queue
    import threading

    from .fleet import Fleet

    changed: queue.Queue = queue.Queue()

    def publish() -> None:
        later: dict[str, float] = {}  # VMs an operation held: looked at again when it is over
        while not stop.is_set():
            try:
                names = {changed.get(timeout=1)}
            except queue.Empty:
                names = set()
            time.sleep(0.2)  # a burst of events (a migration's) settles into one look
            while not changed.empty():
                names.add(changed.get_nowait())
            now = time.monotonic()
            names |= {n for n, due in later.items() if due <= now}
            if not names:
                continue
            try:  # fresh connections each time: a host's libvirtd may have restarted meanwhile
                with Fleet(paths, f"view-{host}") as fleet:
                    left = fleet.observe(names)
                later = {n: due for n, due in later.items() if n not in names}
                later.update((n, now + RELOOK) for n in left)
            except Exception as err:  # the reconcile covers what this missed
                log(f"view rows of {', '.join(sorted(names))}: {err}")

    threading.Thread(target=publish, name=f"view-{host}", daemon=True).start()
    while not stop.is_set():
        try:
            with Fleet(paths, f"view-{host}") as fleet:
                h = fleet.host(host)
                h.watch_lifecycle(None, lambda name, event, detail: changed.put(name))
                while h.alive() and not stop.wait(5):
                    pass
        except Exception as err:  # never let the listener die: the reconcile covers meanwhile
            log(f"view events of {host}: {err}")
        stop.wait(5)
