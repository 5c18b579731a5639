"""Suspend to disk and resume elsewhere: the path when no host has room.

`suspend` saves the running VM's memory and device state to shared storage (libvirt's save: a
migration into a file) and removes it from its host; `resume` restores it on any host that sees the
storage, exactly where it stopped, and defines it there again. While suspended a VM lives only in
`storage/saves/<vm>/`: the save image, the persistent definition and a small record. The image is
written next to its final name and renamed only once complete, so a crash mid-save leaves the VM
running and no half image that could be mistaken for a good one.
"""

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import libvirt

from . import console
from .errors import Conflict, NotFound
from .fleet import Fleet, require_active
from .libvirt_errors import translated
from .locks import vm_operation
from .placement import choose_host, refusal
from .render import address_of, set_console_path
from .spec import validate_name


@dataclass(frozen=True)
class Suspended:
    vm: str
    from_host: str
    memory_mib: int
    vcpus: int
    suspended_at: float
    save_ms: int
    image_bytes: int
    # Parked: suspended by vmmgr for want of room, resumed by itself when room returns. An
    # operator's own suspend is not parked: it waits for the operator's resume.
    parked: bool = False


@dataclass(frozen=True)
class Resumed:
    vm: str
    host: str
    restore_ms: int
    suspended_for_s: float


def save_dir(fleet: Fleet, vm: str) -> Path:
    return fleet.paths.saves / vm


def suspended(fleet: Fleet) -> list[Suspended]:
    root = fleet.paths.saves
    if not root.is_dir():
        return []
    records = [_record(d) for d in sorted(root.iterdir()) if (d / "record.json").is_file()]
    return sorted(records, key=lambda r: r.suspended_at)  # oldest first: the resume order


def find_suspended(fleet: Fleet, vm: str) -> Suspended | None:
    d = save_dir(fleet, vm)
    return _record(d) if (d / "record.json").is_file() else None


def suspend(fleet: Fleet, vm: str, parked: bool = False) -> Suspended:
    validate_name(vm)
    with vm_operation(fleet.paths.locks, vm, "suspend"):
        if find_suspended(fleet, vm):
            raise Conflict(f"VM {vm!r} is already suspended")
        guest = fleet.locate(vm)
        if guest.state() != "running":
            raise Conflict(f"VM {vm!r} is {guest.state()}: only a running VM is suspended")
        d = save_dir(fleet, vm)
        d.mkdir(parents=True, exist_ok=True)
        with translated(f"XML of {vm}"):
            persistent = guest.domain.XMLDesc(
                libvirt.VIR_DOMAIN_XML_INACTIVE | libvirt.VIR_DOMAIN_XML_MIGRATABLE)
        (d / "domain.xml").write_text(persistent)
        partial = d / "image.partial"
        t0 = time.monotonic()
        with translated(f"save {vm} on {guest.host_name}"):
            # On failure libvirt leaves the guest running: nothing to undo but the partial file.
            try:
                guest.domain.saveFlags(str(partial), None, libvirt.VIR_DOMAIN_SAVE_RUNNING)
            except libvirt.libvirtError:
                partial.unlink(missing_ok=True)
                raise
        os.replace(partial, d / "image")
        record = Suspended(vm, guest.host_name, guest.memory_mib(), guest.vcpus(), time.time(),
                           int((time.monotonic() - t0) * 1000), (d / "image").stat().st_size,
                           parked)
        _write_json(d / "record.json", asdict(record))
        guest.undefine()  # the image is complete: the VM now lives on storage only
        return record


def resume(fleet: Fleet, vm: str, host: str | None = None) -> Resumed:
    validate_name(vm)
    with vm_operation(fleet.paths.locks, vm, "resume"):
        record = find_suspended(fleet, vm)
        if record is None:
            if fleet.find(vm):
                raise Conflict(f"VM {vm!r} is not suspended: it runs on {fleet.locate(vm).host_name}")
            raise NotFound(f"unknown VM {vm!r}")
        if host is None:
            host, refused = choose_host(fleet.active_capacities(), record.memory_mib, record.vcpus)
            if host is None:
                why = "; ".join(f"{h}: {r}" for h, r in refused.items()) or "no hosts"
                raise Conflict(f"no host has room to resume {vm}: {why}")
        target = fleet.host(host)
        require_active(target)
        reason = refusal(target.capacity(), record.memory_mib, record.vcpus)
        if reason:
            raise Conflict(f"host {host} has no room to resume {vm}: {reason}")
        d = save_dir(fleet, vm)
        segment = console.next_segment(fleet.paths.consoles, vm, host)
        image_xml = _image_xml(target, d / "image")
        t0 = time.monotonic()
        with translated(f"restore {vm} on {host}"):
            target.conn.restoreFlags(str(d / "image"), set_console_path(image_xml, segment),
                                     libvirt.VIR_DOMAIN_SAVE_RUNNING)
        restore_ms = int((time.monotonic() - t0) * 1000)
        definition = (d / "domain.xml").read_text()
        target.define(set_console_path(definition, segment))
        fleet.route_address(address_of(definition), host)
        for name in ("image", "domain.xml", "record.json"):
            (d / name).unlink(missing_ok=True)
        d.rmdir()
        return Resumed(vm, host, restore_ms, round(time.time() - record.suspended_at, 1))


def _image_xml(host, image: Path) -> str:
    with translated(f"read save image {image}"):
        return host.conn.saveImageGetXMLDesc(str(image), libvirt.VIR_DOMAIN_SAVE_IMAGE_XML_SECURE)


def _record(d: Path) -> Suspended:
    return Suspended(**json.loads((d / "record.json").read_text()))


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)

