"""The hosts vmmgr manages, in the fleet's store (Redis) that every node shares.

A record says how to reach a host's libvirtd, which accelerator its VMs use and how much memory
and how many vCPUs vmmgr may hand out there (what placement counts against).
"""

import json
import re
from dataclasses import asdict, dataclass

from .devices import Device
from .errors import Conflict, InvalidRequest, NotFound
from .spec import validate_name


HOST_STATES = ("active", "draining", "reclaimed")


@dataclass(frozen=True)
class HostRecord:
    name: str
    uri: str
    accel: str = "kvm"
    memory_mib: int = 0  # 0: everything the host reports
    vcpus: int = 0  # 0: the host's CPU count
    lab: bool = False  # made by `vmmgr lab up`, removed by `lab down`
    state: str = "active"  # "draining": takes no new VMs; "reclaimed": empty, out of service
    devices: tuple[Device, ...] = ()  # passed-through devices (GPUs) VMs may ask for
    # Its QEMU migrates over TLS (the kvm_host role forces it); False only by explicit opt-in.
    tls: bool = True
    # Where it is (a region, a cloud, a cluster): placement keeps a VM's moves inside its site
    # while that has room. "": the one site of a fleet that names none.
    site: str = ""

    @classmethod
    def from_dict(cls, data: dict) -> "HostRecord":
        return cls(**data | {"devices": tuple(Device(**d) for d in data.get("devices", ()))})


class Inventory:
    """Host records and host states in the fleet's store (Redis): every node sees the same hosts.

    A record and its state are kept apart so that each change is one Redis command: two nodes
    changing two hosts (or one host's state) at once never lose an update.
    """

    RECORDS = "vmmgr:inventory"
    STATES = "vmmgr:host-state"

    def __init__(self, r):
        self.r = r  # a redis.Redis with decode_responses

    def records(self) -> list[HostRecord]:
        pipe = self.r.pipeline()
        pipe.hgetall(self.RECORDS)
        pipe.hgetall(self.STATES)
        records, states = pipe.execute()
        out = [HostRecord.from_dict(json.loads(data) | {"state": states.get(name, "active")})
               for name, data in records.items()]
        return sorted(out, key=lambda r: _natural(r.name))

    def get(self, name: str) -> HostRecord:
        pipe = self.r.pipeline()
        pipe.hget(self.RECORDS, name)
        pipe.hget(self.STATES, name)
        data, state = pipe.execute()
        if data is None:
            known = ", ".join(r.name for r in self.records()) or "none"
            raise NotFound(f"unknown host {name!r} (known hosts: {known})")
        return HostRecord.from_dict(json.loads(data) | {"state": state or "active"})

    def add(self, record: HostRecord, replace: bool = False) -> None:
        validate_name(record.name, "host")
        if record.accel not in ("kvm", "tcg"):
            raise InvalidRequest(f"accel must be 'kvm' or 'tcg', not {record.accel!r}")
        if record.state not in HOST_STATES:
            raise InvalidRequest(f"host state must be one of {', '.join(HOST_STATES)}")
        if not replace:
            self._require_sites_named_alike(record)
        data = json.dumps({k: v for k, v in asdict(record).items() if k != "state"})
        if replace:
            self.r.hset(self.RECORDS, record.name, data)
        elif not self.r.hsetnx(self.RECORDS, record.name, data):
            raise Conflict(f"host {record.name!r} already exists")
        self.r.hset(self.STATES, record.name, record.state)

    def _require_sites_named_alike(self, record: HostRecord) -> None:
        """A fleet names a site for every host or for none: a save or a reclaim goes to the
        workers of its host's site, and "no site" is no site's workers in a fleet of named ones."""
        others = [r for r in self.records() if r.name != record.name]
        named = [r.name for r in others if r.site]
        if others and bool(record.site) != bool(named):
            raise InvalidRequest(
                f"host {record.name}: the fleet's hosts name their sites ({', '.join(named[:3])}"
                f"{', ...' if len(named) > 3 else ''}): give it one with --site"
                if named else
                f"host {record.name}: the fleet's hosts name no site: a fleet names a site for "
                "every host or for none")

    def set_state(self, name: str, state: str) -> None:
        if state not in HOST_STATES:
            raise InvalidRequest(f"host state must be one of {', '.join(HOST_STATES)}")
        self.get(name)  # NotFound for an unknown host
        self.r.hset(self.STATES, name, state)

    def remove(self, names: set[str]) -> None:
        if names:
            self.r.hdel(self.RECORDS, *names)
            self.r.hdel(self.STATES, *names)


def _natural(name: str) -> list:
    """host2 before host10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
