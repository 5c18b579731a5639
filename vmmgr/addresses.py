"""Stable guest addresses: one per VM from a pool, kept across moves, suspensions and sites.

The allocations live in the fleet's store (Redis hash `vmmgr:addresses`, address -> VM), not on
storage: a fleet spread over sites has no storage every host shares, but every node reaches the
store. An address is taken with HSETNX, so two concurrent creates can never get the same one. The
pool and the gateway every host serves come from `$VMMGR_HOME/network.json` (`lab up` writes it);
without it VMs get no network. Allocations an older vmmgr kept as files
(`storage/addresses/<ip>`) are moved into the store the first time a pool is opened.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import netaddr
import redis

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


KEY = "vmmgr:addresses"
# Give an address back only if it is still the VM's: a late release never frees another's.
_RELEASE = ("if redis.call('hget', KEYS[1], ARGV[1]) == ARGV[2] then "
            "return redis.call('hdel', KEYS[1], ARGV[1]) else return 0 end")
# Record an address for a VM unless another holds it; returns its holder, in one step.
_CLAIM = "redis.call('hsetnx', KEYS[1], ARGV[1], ARGV[2]) return redis.call('hget', KEYS[1], ARGV[1])"


class AddressPool:
    def __init__(self, r: redis.Redis, pool: str, gateway: str):
        """`r`: the fleet store's client, replies decoded (FleetState.r)."""
        try:
            self.network = netaddr.IPNetwork(pool)
            self.gateway = netaddr.IPAddress(gateway)
        except (netaddr.AddrFormatError, ValueError) as err:
            raise InvalidRequest(f"bad address pool {pool!r} or gateway {gateway!r}: {err}") from None
        self.r = r

    def allocate(self, vm: str) -> str:
        """The VM's address: the one it has, or the lowest free one."""
        used = self.in_use()
        mine = next((ip for ip, owner in used.items() if owner == vm), None)
        if mine:
            return mine
        for ip in self.network.iter_hosts():
            if ip == self.gateway or str(ip) in used:
                continue
            if self.r.hsetnx(KEY, str(ip), vm):  # taken since `used` was read: the next one
                return str(ip)
        raise Conflict(f"address pool {self.network} is exhausted: all "
                       f"{len(list(self.network.iter_hosts())) - 1} addresses are in use")

    def claim(self, ip: str, vm: str) -> str | None:
        """Record that `vm` holds `ip` (a running VM carries its address in its definition).
        Returns the VM that holds it instead, if another does; None when it is `vm`'s."""
        if not self.contains(ip):
            raise InvalidRequest(f"{ip!r} is not an address of the pool {self.network}")
        owner = self.r.eval(_CLAIM, 1, KEY, ip, vm)
        return None if owner == vm else owner

    def release(self, vm: str) -> str | None:
        """Free the VM's address (every one, should it hold more); returns the one it had."""
        mine = [ip for ip, owner in self.in_use().items() if owner == vm]
        for ip in mine:
            self.r.eval(_RELEASE, 1, KEY, ip, vm)
        return min(mine, key=netaddr.IPAddress) if mine else None

    def address_of(self, vm: str) -> str | None:
        return next((ip for ip, owner in self.in_use().items() if owner == vm), None)

    def in_use(self) -> dict[str, str]:
        """address -> VM. An entry whose key is not an address of the pool is no allocation:
        it is skipped, never passed on (the names end up in commands run at the edge)."""
        return {ip: vm for ip, vm in self.r.hgetall(KEY).items() if self.contains(ip)}

    def import_files(self, root: Path) -> int:
        """Move the allocations an older vmmgr kept as files under `root` into the store; returns
        how many were recorded. A file goes once its address is recorded for its VM. One whose
        address the store gives to another VM stays, renamed `<ip>.conflict`, for the operator;
        an empty one (its writer had not written the name yet) stays for the next open."""
        if not root.is_dir():
            return 0
        moved = 0
        for f in root.iterdir():
            try:
                if not self.contains(f.name):
                    continue
                vm = f.read_text().strip()
                if not vm:
                    continue
                holder = self.r.eval(_CLAIM, 1, KEY, f.name, vm)
                if holder == vm:
                    f.unlink()
                    moved += 1
                else:
                    f.rename(f.with_name(f.name + ".conflict"))
            except OSError:
                continue
        try:
            root.rmdir()
        except OSError:
            pass  # not empty: a conflict, or a file the next open tries again
        return moved

    def conflicts(self, root: Path) -> dict[str, str]:
        """The files `import_files` left because the store gives their address to another VM:
        address -> the VM the older vmmgr gave it to."""
        found = {}
        for f in root.glob("*.conflict") if root.is_dir() else ():
            ip = f.name.removesuffix(".conflict")
            if self.contains(ip):
                try:
                    found[ip] = f.read_text().strip()
                except OSError:
                    continue
        return found

    def contains(self, name: str) -> bool:
        """Whether `name` is, exactly, an address of the pool that a VM may hold."""
        try:
            ip = netaddr.IPAddress(name, version=4, flags=netaddr.INET_PTON)
        except (netaddr.AddrFormatError, ValueError):
            return False
        return str(ip) == name and ip in self.network and ip != self.gateway


def pool_for(paths: Paths, r: redis.Redis | None = None) -> AddressPool | None:
    """The fleet's pool, or None without a network (network.json). `r`: the store's client
    the caller has (FleetState.r), else one from the configured URL."""
    config = NetworkConfig.load(paths)
    if config is None:
        return None
    if r is None:
        url = paths.redis_url()
        if url is None:
            raise InvalidRequest("the address pool lives in the fleet's store: set "
                                 "$VMMGR_REDIS_URL (or write it to <home>/redis.url; `vmmgr lab "
                                 "up` does)")
        r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=10)
    pool = AddressPool(r, config.pool, config.gateway)
    pool.import_files(paths.storage / "addresses")
    return pool


def mac_for(ip: str) -> str:
    """A locally administered MAC derived from the address: stable, and unique within a /8."""
    a = netaddr.IPAddress(ip).words
    return f"52:54:00:{a[1]:02x}:{a[2]:02x}:{a[3]:02x}"
