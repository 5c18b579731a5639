"""A thin wrapper over one host's libvirt connection."""

from dataclasses import dataclass

import libvirt

from .errors import NotFound
from .guest import Guest
from .inventory import HostRecord
from .libvirt_errors import translated
from .libvirt_events import ensure_loop


@dataclass(frozen=True)
class Capacity:
    """What vmmgr may hand out on a host, and what its VMs already hold."""

    memory_mib: int
    vcpus: int
    used_memory_mib: int
    used_vcpus: int
    vms: tuple[str, ...]

    @property
    def free_memory_mib(self) -> int:
        return self.memory_mib - self.used_memory_mib

    @property
    def free_vcpus(self) -> int:
        return self.vcpus - self.used_vcpus


class Host:
    def __init__(self, record: HostRecord):
        self.record = record
        self._conn: libvirt.virConnect | None = None

    def __repr__(self) -> str:
        return f"<Host {self.name} {self.uri}>"

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def uri(self) -> str:
        return self.record.uri

    @property
    def accel(self) -> str:
        return self.record.accel

    @property
    def conn(self) -> libvirt.virConnect:
        if self._conn is None:
            ensure_loop()  # before the connection opens, or it delivers no events
            with translated(f"connect to host {self.name} ({self.uri})"):
                self._conn = libvirt.open(self.uri)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except libvirt.libvirtError:
                pass
            self._conn = None

    def guests(self) -> list[Guest]:
        with translated(f"list VMs on {self.name}"):
            return [Guest(d, self.name) for d in self.conn.listAllDomains()]

    def find_guest(self, name: str) -> Guest | None:
        try:
            with translated(f"look up {name} on {self.name}"):
                return Guest(self.conn.lookupByName(name), self.name)
        except NotFound:
            return None

    def define(self, xml: str) -> Guest:
        with translated(f"define VM on {self.name}"):
            return Guest(self.conn.defineXML(xml), self.name)

    def capacity(self) -> Capacity:
        with translated(f"host info of {self.name}"):
            _model, memory_mib, cpus, *_ = self.conn.getInfo()
        guests = self.guests()
        return Capacity(
            memory_mib=self.record.memory_mib or memory_mib,
            vcpus=self.record.vcpus or cpus,
            used_memory_mib=sum(g.memory_mib() for g in guests),
            used_vcpus=sum(g.vcpus() for g in guests),
            vms=tuple(sorted(g.name for g in guests)),
        )
