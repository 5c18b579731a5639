"""Placement decisions: pure functions over capacities, testable without a hypervisor."""

from .host import Capacity


def refusal(capacity: Capacity, memory_mib: int, vcpus: int, device_model: str = "",
            device_count: int = 0) -> str | None:
    """Why a VM of this size cannot go on a host with this capacity, or None if it fits.

    Memory is never overcommitted; a host's vCPU budget (which may include an overcommit the
    operator chose) is a hard limit too.
    """
    if memory_mib > capacity.free_memory_mib:
        return (
            f"needs {memory_mib} MiB, {capacity.free_memory_mib} MiB free "
            f"of {capacity.memory_mib} MiB"
        )
    if vcpus > capacity.free_vcpus:
        return f"needs {vcpus} vCPUs, {capacity.free_vcpus} free of {capacity.vcpus}"
    free = capacity.free_devices.count(device_model) if device_count else 0
    if device_count and free < device_count:
        return f"needs {device_count} {device_model} device{'s' if device_count > 1 else ''}, {free} free"
    return None


def choose_host(
    capacities: dict[str, Capacity], memory_mib: int, vcpus: int, device_model: str = "",
    device_count: int = 0, site_of: dict[str, str] | None = None, near: str | None = None,
) -> tuple[str | None, dict[str, str]]:
    """The host with the most free memory among those with room, and why each other was refused.

    With `near` (a site) and `site_of` (host -> site), a host in that site comes first: a move
    inside a site crosses a LAN, one between sites a WAN (slower, dearer, and the VM's disk
    may have to follow)."""
    refused = {}
    fitting = []
    for name, cap in capacities.items():
        reason = refusal(cap, memory_mib, vcpus, device_model, device_count)
        if reason:
            refused[name] = reason
        else:
            away = near is not None and (site_of or {}).get(name, "") != near
            fitting.append((away, -cap.free_memory_mib, name))
    return (min(fitting)[2] if fitting else None), refused


def target_choices(own_host: str | None, memory_mib: int, vcpus: int,
                   hosts: dict[str, tuple[str, Capacity | None]], device_model: str = "",
                   device_count: int = 0) -> list[dict]:
    """Every host as a destination for a VM on `own_host`: whether it can take it and, if not, why.

    `hosts` maps a name to (inventory state, capacity or None when unreachable). Hosts with room
    come first, most free memory first.
    """
    choices = []
    for name, (state, cap) in hosts.items():
        if name == own_host:
            reason = "the VM runs here"
        elif state != "active":
            reason = f"host is {state}"
        elif cap is None:
            reason = "host unreachable"
        else:
            reason = refusal(cap, memory_mib, vcpus, device_model, device_count)
        choices.append({"host": name, "ok": reason is None, "reason": reason or "",
                        "free_memory_mib": cap.free_memory_mib if cap else None})
    return sorted(choices, key=lambda c: (not c["ok"], -(c["free_memory_mib"] or 0), c["host"]))
