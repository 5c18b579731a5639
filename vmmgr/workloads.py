"""The built-in guest's workloads, turned into a kernel command line for `guest_image/init.sh`."""

import re

import netaddr

from .errors import InvalidRequest

# Kernel and init stay silent on the serial console: only the workload writes there.
# pti=on: under TCG, QEMU before 9.0 misses writes made through softmmu TLB entries that outlive a
# dirty-bitmap sync (see qemu_defects.py), and a guest kernel could arrive corrupted. With page-table
# isolation every kernel entry from user space reloads CR3, which flushes that TLB: the loss became
# rarer, not impossible (the lab takes a fixed QEMU). It costs a little on KVM, which is unaffected.
BASE_CMDLINE = "console=ttyS0 quiet loglevel=0 panic=-1 pti=on"

def whole(low: int, high: int):
    """A parser for a whole number from `low` to `high`, in ASCII digits only: no sign,
    exponent, superscript or 200-digit number reaches a guest's command line."""
    def parse(value: str) -> int:
        if not re.fullmatch(r"[0-9]{1,10}", value) or not low <= int(value) <= high:
            raise ValueError(f"is not a whole number from {low} to {high}")
        return int(value)
    return parse


def number(low: float, high: float):
    """A parser for a decimal number from `low` to `high` (no nan, inf or exponent)."""
    def parse(value: str) -> float:
        if not re.fullmatch(r"[0-9]{1,10}(\.[0-9]{1,6})?", value) or not low <= float(value) <= high:
            raise ValueError(f"is not a number from {low:g} to {high:g}")
        return float(value)
    return parse


def endpoint(value: str) -> str:
    """IP:PORT, checked (it goes on a kernel command line)."""
    host, sep, port = value.rpartition(":")
    try:
        if not sep or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
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
    "counter": {"interval": (number(0.01, 86400), 0.2), "count": (whole(0, 10**9), 0)},
    # rewrites `mib` MiB of memory at `rate` MiB/s (0: flat out), verifying every page it rewrites
    "dirtier": {"rate": (number(0, 100000), 8.0), "mib": (whole(1, 1 << 20), 32)},
    # serves `mib` MiB of the `stream` generator's output at `rate` MiB/s (0: flat out) on `port`
    "server": {"port": (whole(1, 65535), 8080), "mib": (whole(0, 1 << 30), 200),
               "rate": (number(0, 100000), 0.0)},
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
            why = err if str(err).startswith("is ") else f"is wrong: {err}"
            raise InvalidRequest(f"{workload} parameter {key}={value[:40]!r} {why}") from None
        words.append(f"vmmgr.{key}={parsed}")
    return " ".join(words)
