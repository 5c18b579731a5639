"""Stable guest addresses: one per VM from a pool, kept across moves and suspensions.

An allocation is a file `storage/addresses/<ip>` holding the VM's name, created with O_EXCL: on
storage every host and worker shares, two concurrent creates can never get the same address, and
nothing else (no database) has to be up for it. The pool and the gateway every host serves come
from `$VMMGR_HOME/network.json` (`lab up` writes it); without it VMs get no network.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import netaddr

from .errors import Conflict, InvalidRequest
from .paths import Paths


@dataclass(frozen=True)
class NetworkConfig:
    pool: str  # CIDR the guests' addresses come from
    gateway: str  # served by every host on its guest bridge, with the same MAC
    bridge: str = "br-guest"

    @classmethod
    def load(cls, paths: Paths) -> "NetworkConfig | None":
        try:
            return cls(**json.loads(paths.network_config.read_text()))
        except FileNotFoundError:
            return None

    def save(self, paths: Paths) -> None:
        paths.network_config.parent.mkdir(parents=True, exist_ok=True)
        paths.network_config.write_text(json.dumps(self.__dict__, indent=2) + "\n")


class AddressPool:
    def __init__(self, root: Path, pool: str, gateway: str):
        try:
            self.network = netaddr.IPNetwork(pool)
            self.gateway = netaddr.IPAddress(gateway)
        except (netaddr.AddrFormatError, ValueError) as err:
            raise InvalidRequest(f"bad address pool {pool!r} or gateway {gateway!r}: {err}") from None
        self.root = root

    def allocate(self, vm: str) -> str:
        """The VM's address: the one it has, or the lowest free one."""
        mine = self.address_of(vm)
        if mine:
            return mine
        self.root.mkdir(parents=True, exist_ok=True)
        for ip in self.network.iter_hosts():
            if ip == self.gateway:
                continue
            try:
                fd = os.open(self.root / str(ip), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as f:
                f.write(vm + "\n")
            return str(ip)
        raise Conflict(f"address pool {self.network} is exhausted: all "
                       f"{len(list(self.network.iter_hosts())) - 1} addresses are in use")

    def release(self, vm: str) -> str | None:
        ip = self.address_of(vm)
        if ip:
            (self.root / ip).unlink(missing_ok=True)
        return ip

    def address_of(self, vm: str) -> str | None:
        return next((ip for ip, owner in self.in_use().items() if owner == vm), None)

    def in_use(self) -> dict[str, str]:
        """address -> VM. A file whose name is not an address of the pool is no allocation:
        it is skipped, never passed on (the names end up in commands run at the edge)."""
        if not self.root.is_dir():
            return {}
        used = {}
        for f in self.root.iterdir():
            if self._in_pool(f.name):
                used[f.name] = f.read_text().strip()
        return used

    def _in_pool(self, name: str) -> bool:
        try:
            ip = netaddr.IPAddress(name, version=4, flags=netaddr.INET_PTON)
        except (netaddr.AddrFormatError, ValueError):
            return False
        return str(ip) == name and ip in self.network and ip != self.gateway


def pool_for(paths: Paths) -> AddressPool | None:
    config = NetworkConfig.load(paths)
    if config is None:
        return None
    return AddressPool(paths.storage / "addresses", config.pool, config.gateway)


def mac_for(ip: str) -> str:
    """A locally administered MAC derived from the address: stable, and unique within a /8."""
    a = netaddr.IPAddress(ip).words
    return f"52:54:00:{a[1]:02x}:{a[2]:02x}:{a[3]:02x}"
