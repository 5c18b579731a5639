"""SSH to a VM's stable address, as its user does (`seed.USER`, the key given at create).

The address is reachable only through the edge: from outside the fleet, not from the hosts'
management network. On the lab "outside" is the client namespace (`lab_net.CLIENT_NS`); a real
control node has a route to the pool through its edge, so the prefix is empty.

A VM's host keys are new with every VM. cloud-init prints them on the serial console at first
boot, which only the fleet reads, so `vm ssh` pins them from there (`host_keys`) instead of
trusting whatever answers on the address the first time.
"""

import re
import subprocess
from pathlib import Path

from . import seed

BASE = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR"]
UNPINNED = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
_KEYS_BLOCK = re.compile(r"-----BEGIN SSH HOST KEY KEYS-----\r?\n(.*?)-----END SSH HOST KEY KEYS-----",
                         re.S)
_KEY_LINE = re.compile(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(?:256|384|521)) ([A-Za-z0-9+/=]+)")


def host_keys(console_text: str) -> list[str]:
    """`TYPE BASE64` of each host key in the last block cloud-init printed (pure)."""
    blocks = _KEYS_BLOCK.findall(console_text)
    if not blocks:
        return []
    keys = []
    for line in blocks[-1].splitlines():
        if m := _KEY_LINE.match(line.strip()):
            keys.append(f"{m.group(1)} {m.group(2)}")
    return keys


def known_hosts(address: str, keys: list[str]) -> str:
    return "".join(f"{address} {k}\n" for k in keys)


def argv(key: Path | None, address: str, command: str = "", prefix: list[str] = (),
         known_hosts_file: Path | None = None, tty: bool = False) -> list[str]:
    """The ssh command line (pure). With `known_hosts_file` the VM must show a pinned key;
    without, any host key is taken (for a VM the caller just made and watches)."""
    pinning = (["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts_file}"]
               if known_hosts_file else UNPINNED)
    return [*prefix, "ssh", *(["-i", str(key)] if key else []), *BASE, *pinning,
            *(["-t"] if tty else []), f"{seed.USER}@{address}", *([command] if command else [])]


def run(key: Path, address: str, command: str, prefix: list[str] = (), timeout: float = 60,
        stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv(key, address, command, prefix), input=stdin,
                          capture_output=True, timeout=timeout)


def lab_prefix() -> list[str]:
    from .lab_net import CLIENT_NS
    return ["ip", "netns", "exec", CLIENT_NS]
