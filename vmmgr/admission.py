"""Admission: the checks a request passes before it is queued, so that a bad one is refused at
once with a clear error and nothing changes. The operation checks again when it runs (the fleet
may have changed meanwhile); these answer the caller without waiting for a worker.
"""

from .errors import Conflict, InvalidRequest, NotFound
from .fleet import Fleet, require_active, require_other_host
from .migration import require_live_migratable
from .placement import choose_host, refusal
from .spec import VMSpec, validate_name


def migration(fleet: Fleet, vm: str, target: str) -> str:
    """Returns the VM's host."""
    dest = fleet.host(target)
    guest = fleet.locate(vm)
    require_other_host(guest, target)
    require_live_migratable(guest)
    require_active(dest)
    reason = refusal(dest.capacity(), guest.memory_mib(), guest.vcpus())
    if reason:
        raise Conflict(f"host {target} has no room for {vm}: {reason}")
    return guest.host_name


def creation(fleet: Fleet, spec: VMSpec, host: str | None) -> None:
    room_for(fleet, spec.name, spec.memory_mib, spec.vcpus, host, spec.gpu_model, spec.gpu_count)


def room_for(fleet: Fleet, name: str, memory_mib: int, vcpus: int, host: str | None,
             gpu_model: str = "", gpu_count: int = 0) -> None:
    """A new VM of this size fits on `host` (or anywhere when None), and its name is free."""
    if fleet.find(name) is not None or fleet.is_suspended(name):
        raise Conflict(f"VM {name!r} already exists")
    if host:
        target = fleet.host(host)
        require_active(target)
        cap = target.capacity()
        if memory_mib > cap.memory_mib:
            raise InvalidRequest(f"{memory_mib} MiB is more than host {host} offers "
                                 f"({cap.memory_mib} MiB)")
        reason = refusal(cap, memory_mib, vcpus, gpu_model, gpu_count)
        if reason:
            raise Conflict(f"host {host} has no room for {name}: {reason}")
        return
    caps = fleet.active_capacities()
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
    validate_name(vm)
    if fleet.is_suspended(vm):
        raise Conflict(f"VM {vm!r} is already suspended")
    return fleet.locate(vm).host_name


def suspended_vm(fleet: Fleet, vm: str, host: str | None) -> None:
    validate_name(vm)
    if host:
        require_active(fleet.host(host))
    if not fleet.is_suspended(vm):
        guest = fleet.find(vm)
        if guest is None:
            raise NotFound(f"unknown VM {vm!r}")
        raise Conflict(f"VM {vm!r} is not suspended: it runs on {guest.host_name}")


def known_vm(fleet: Fleet, vm: str) -> None:
    validate_name(vm)
    if fleet.find(vm) is None and not fleet.is_suspended(vm):
        raise NotFound(f"unknown VM {vm!r}")


def known_host(fleet: Fleet, host: str) -> None:
    fleet.host(host)
