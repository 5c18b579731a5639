"""Placement decisions: pure functions over capacities, testable without a hypervisor."""

from .host import Capacity


def refusal(capacity: Capacity, memory_mib: int, vcpus: int) -> str | None:
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
    return None


def choose_host(
    capacities: dict[str, Capacity], memory_mib: int, vcpus: int
) -> tuple[str | None, dict[str, str]]:
    """The host with the most free memory among those with room, and why each other was refused."""
    refused = {}
    fitting = []
    for name, cap in capacities.items():
        reason = refusal(cap, memory_mib, vcpus)
        if reason:
            refused[name] = reason
        else:
            fitting.append((-cap.free_memory_mib, name))
    return (min(fitting)[1] if fitting else None), refused
