"""Admission: the checks a request passes before it is queued, so that a bad one is refused at
once with a clear error and nothing changes. They read the fleet view in the store (no host is
asked: an API call costs the same on 3 hosts or 1,000); the operation checks again against
libvirt when it runs, the fleet having perhaps changed meanwhile.
"""

from .addresses import pool_for
from .errors import Conflict, InvalidRequest, NotFound
from .fleet import Fleet
from .host import Capacity
from .overview import capacities, host_rows
from .placement import choose_host, refusal
from .spec import VMSpec, validate_name


class _Seen:
    """One read of the view: the VMs' rows and the hosts' room."""

    def __init__(self, fleet: Fleet):
        rows = fleet.state.vm_views()
        self.vms = {r["name"]: r for r in rows}
        self.hosts = capacities(host_rows(fleet, rows))  # name -> (state, Capacity or None)

    def vm(self, name: str) -> dict:
        validate_name(name)
        if name not in self.vms:
            raise NotFound(f"unknown VM {name!r}")
        return self.vms[name]

    def running(self, name: str) -> dict:
        row = self.vm(name)
        if row["host"] == "-":
            raise Conflict(f"VM {name!r} is {row['state']}: resume it first")
        if row["state"] == "shutoff":
            raise Conflict(f"VM {name!r} is stopped on {row['host']}: `vm start` it first")
        return row

    def room(self, fleet: Fleet, host: str) -> Capacity:
        """The room on an active host; NotFound, Conflict or unreachable as the host is."""
        fleet.inventory.get(host)  # NotFound for an unknown host
        state, cap = self.hosts[host]
        if state != "active":
            raise Conflict(f"host {host} is {state}: it takes no new VMs")
        if cap is None:
            raise Conflict(f"host {host} is unreachable")
        return cap


def migration(fleet: Fleet, vm: str, target: str) -> str:
    """Returns the VM's host."""
    seen = _Seen(fleet)
    fleet.inventory.get(target)  # NotFound for an unknown host
    row = seen.running(vm)
    if row["host"] == target:
        raise InvalidRequest(f"VM {vm!r} already runs on {target}")
    if not row.get("live", True):
        raise Conflict(f"VM {vm!r} cannot be live-migrated: it {row.get('not_live_because')}. It "
                       "moves by guest hibernation: `vmmgr vm suspend --mode guest`, then "
                       "`vmmgr vm resume`")
    fleet.require_disk_reaches(vm, row.get("site_disk", ""), row["host"], target)
    reason = refusal(seen.room(fleet, target), row["memory_mib"], row["vcpus"])
    if reason:
        raise Conflict(f"host {target} has no room for {vm}: {reason}")
    return row["host"]


def creation(fleet: Fleet, spec: VMSpec, host: str | None) -> None:
    room_for(fleet, spec.name, spec.memory_mib, spec.vcpus, host, spec.gpu_model, spec.gpu_count)


def room_for(fleet: Fleet, name: str, memory_mib: int, vcpus: int, host: str | None,
             gpu_model: str = "", gpu_count: int = 0) -> None:
    """A new VM of this size fits on `host` (or anywhere when None), and its name is free."""
    seen = _Seen(fleet)
    if name in seen.vms:
        raise Conflict(f"VM {name!r} already exists")
    if host:
        cap = seen.room(fleet, host)
        if memory_mib > cap.memory_mib:
            raise InvalidRequest(f"{memory_mib} MiB is more than host {host} offers "
                                 f"({cap.memory_mib} MiB)")
        reason = refusal(cap, memory_mib, vcpus, gpu_model, gpu_count)
        if reason:
            raise Conflict(f"host {host} has no room for {name}: {reason}")
        return
    caps = {h: cap for h, (state, cap) in seen.hosts.items() if state == "active" and cap}
    largest = max((c.memory_mib for c in caps.values()), default=0)
    if caps and memory_mib > largest:
        raise InvalidRequest(f"{memory_mib} MiB is more than any host offers "
                             f"(the largest offers {largest} MiB)")
    target, refused = choose_host(caps, memory_mib, vcpus, gpu_model, gpu_count)
    if target is None:
        why = "; ".join(f"{h}: {r}" for h, r in refused.items()) or "no active hosts"
        raise Conflict(f"no host has room for {name}: {why}")


def running_vm(fleet: Fleet, vm: str) -> str:
    """Returns the VM's host."""
    row = _Seen(fleet).vm(vm)
    if row["host"] == "-":
        raise Conflict(f"VM {vm!r} is already suspended")
    if row["state"] == "shutoff":
        raise Conflict(f"VM {vm!r} is stopped on {row['host']}: there is nothing running to "
                       f"suspend or move")
    return row["host"]


POWER_STATES = {"stop": "running", "reboot": "running", "start": "shutoff"}  # what each needs


def power_change(fleet: Fleet, vm: str, verb: str) -> str:
    """Returns the VM's host; refuses a stop, start or reboot its state does not allow."""
    row = _Seen(fleet).vm(vm)
    if row["host"] == "-":
        raise Conflict(f"VM {vm!r} is suspended to disk: `vm resume` it first")
    if verb != "start" and row.get("workload"):
        raise Conflict(f"VM {vm!r} runs the built-in {row['workload']} guest, which has no OS to "
                       f"ask to {verb} (`vm destroy` removes it; `vm suspend` saves it)")
    if row["state"] != POWER_STATES[verb]:
        hint = " (`vm start` boots it)" if row["state"] == "shutoff" else ""
        raise Conflict(f"VM {vm!r} is {row['state']} on {row['host']}: {verb} needs it "
                       f"{POWER_STATES[verb]}{hint}")
    return row["host"]


def suspended_vm(fleet: Fleet, vm: str, host: str | None) -> None:
    seen = _Seen(fleet)
    row = seen.vm(vm)
    if host:
        seen.room(fleet, host)
    if row["host"] != "-":
        raise Conflict(f"VM {vm!r} is not suspended: it runs on {row['host']}")


def known_vm(fleet: Fleet, vm: str) -> None:
    _Seen(fleet).vm(vm)


def destroyable(fleet: Fleet, vm: str) -> None:
    """A VM in the view, or what a create or destroy cut short left of one (its files, its
    address): destroy removes them."""
    try:
        known_vm(fleet, vm)
    except NotFound:
        pool = pool_for(fleet.paths, fleet.state.r)
        if not fleet.has_leftovers(vm, pool.address_of(vm) if pool else None):
            raise


def known_host(fleet: Fleet, host: str) -> None:
    fleet.inventory.get(host)
