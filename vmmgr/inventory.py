"""The hosts vmmgr manages: a JSON file on the control node.

A record says how to reach a host's libvirtd, which accelerator its VMs use and how much memory
and how many vCPUs vmmgr may hand out there (what placement counts against).
"""

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

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

    @classmethod
    def from_dict(cls, data: dict) -> "HostRecord":
        return cls(**data | {"devices": tuple(Device(**d) for d in data.get("devices", ()))})


class Inventory:
    def __init__(self, path: Path):
        self.path = path

    def records(self) -> list[HostRecord]:
        if not self.path.exists():
            return []
        data = json.loads(self.path.read_text())
        return [HostRecord.from_dict(h) for h in data.get("hosts", [])]

    def get(self, name: str) -> HostRecord:
        for record in self.records():
            if record.name == name:
                return record
        known = ", ".join(r.name for r in self.records()) or "none"
        raise NotFound(f"unknown host {name!r} (known hosts: {known})")

    def add(self, record: HostRecord, replace: bool = False) -> None:
        validate_name(record.name, "host")
        if record.accel not in ("kvm", "tcg"):
            raise InvalidRequest(f"accel must be 'kvm' or 'tcg', not {record.accel!r}")
        records = self.records()
        names = [r.name for r in records]
        if record.name in names:
            if not replace:
                raise Conflict(f"host {record.name!r} already exists")
            records[names.index(record.name)] = record  # in place: listings keep their order
        else:
            records.append(record)
        self._write(records)

    def set_state(self, name: str, state: str) -> None:
        if state not in HOST_STATES:
            raise InvalidRequest(f"host state must be one of {', '.join(HOST_STATES)}")
        record = self.get(name)
        self.add(replace(record, state=state), replace=True)

    def remove(self, names: set[str]) -> None:
        self._write([r for r in self.records() if r.name not in names])

    def _write(self, records: list[HostRecord]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"hosts": [asdict(r) for r in records]}, indent=2) + "\n")
        os.replace(tmp, self.path)
