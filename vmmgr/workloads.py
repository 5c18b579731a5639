"""The built-in guest's workloads, turned into a kernel command line for `guest_image/init.sh`."""

import netaddr

from .errors import InvalidRequest

# Kernel and init stay silent on the serial console: only the workload writes there.
# pti=on: under TCG, QEMU before 9.0 misses writes made through softmmu TLB entries that outlive a
# dirty-bitmap sync (see qemu_defects.py), and a guest kernel could arrive corrupted. With page-table
# isolation every kernel entry from user space reloads CR3, which flushes that TLB: the loss became
# rarer, not impossible (the lab takes a fixed QEMU). It costs a little on KVM, which is unaffected.
BASE_CMDLINE = "console=ttyS0 quiet loglevel=0 panic=-1 pti=on"

def endpoint(value: str) -> str:
    """IP:PORT, checked (it goes on a kernel command line)."""
    host, sep, port = value.rpartition(":")
    try:
        if not sep or not 0 < int(port) < 65536:
            raise ValueError
        netaddr.IPAddress(host, version=4)
    except (ValueError, netaddr.AddrFormatError):
        raise ValueError(f"{value!r} is not IP:PORT") from None
    return f"{host}:{int(port)}"


def address(value: str) -> str:
    """One IPv4 address, checked."""
    try:
        return str(netaddr.IPAddress(value, version=4, flags=netaddr.INET_PTON))
    except (ValueError, netaddr.AddrFormatError):
        raise ValueError(f"{value!r} is not an IPv4 address") from None


def endpoints(value: str) -> str:
    """IP:PORT+IP:PORT+..., each checked."""
    return "+".join(endpoint(v) for v in value.split("+"))


WORKLOADS = {
    # name: {parameter: (type, default)}
    "counter": {"interval": (float, 0.2), "count": (int, 0)},
    # rewrites `mib` MiB of memory at `rate` MiB/s (0: flat out), verifying every page it rewrites
    "dirtier": {"rate": (float, 8.0), "mib": (int, 32)},
    # serves `mib` MiB of the `stream` generator's output at `rate` MiB/s (0: flat out) on `port`
    "server": {"port": (int, 8080), "mib": (int, 200), "rate": (float, 0.0)},
    # downloads once from `from` (IP:PORT) and prints the SHA-256 of what arrived
    "fetch": {"from": (endpoint, "")},
    # tries a TCP connection to each IP:PORT (joined by +) and prints "reach IP:PORT open|closed";
    # with `spoof`, then pings each of them from that address too (an anti-spoofing check)
    "reach": {"to": (endpoints, ""), "spoof": (address, "")},
    "idle": {},
}


def on_off(value: str) -> str:
    if value not in ("on", "off"):
        raise ValueError(f"{value!r} is not on or off")
    return value


# Taken by every workload: whether the guest agent runs (off: a guest that cannot hibernate).
COMMON = {"agent": (on_off, "on")}


def cmdline(workload: str, params: dict[str, str] | None = None) -> str:
    """The command line for a built-in workload, parameters checked against their types."""
    if workload not in WORKLOADS:
        raise InvalidRequest(
            f"unknown workload {workload!r} (built-in: {', '.join(sorted(WORKLOADS))})"
        )
    known = WORKLOADS[workload] | COMMON
    words = [BASE_CMDLINE, f"vmmgr.workload={workload}"]
    for key, value in (params or {}).items():
        if key not in known:
            raise InvalidRequest(f"workload {workload} takes no parameter {key!r}")
        kind, _default = known[key]
        try:
            parsed = kind(value)
        except ValueError as err:
            why = f"is not a {kind.__name__}" if kind in (int, float) else f"is wrong: {err}"
            raise InvalidRequest(f"{workload} parameter {key}={value!r} {why}") from None
        if isinstance(parsed, (int, float)) and parsed < 0:
            raise InvalidRequest(f"{workload} parameter {key} must not be negative")
        words.append(f"vmmgr.{key}={parsed}")
    return " ".join(words)
