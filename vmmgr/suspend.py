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
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import console, devices
from .errors import Conflict, HibernationFailed, InvalidRequest, NotFound, VmmgrError
from .fleet import Fleet, require_active
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
    # "save": libvirt saved memory and device state to `image`. "guest": the guest hibernated
    # itself into its swap disk (a VM with passed-through devices, which cannot be saved) and
    # needs `device_count` free devices of `device_model` where it resumes.
    mode: str = "save"
    device_model: str = ""
    device_count: int = 0


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


MODES = ("save", "guest")
HIBERNATE_TIMEOUT = 180  # s for the guest to write its image and power off (TCG: ~10 s)
AGENT_TIMEOUT = 30  # s for the guest agent to answer libvirt


def suspend(fleet: Fleet, vm: str, parked: bool = False, mode: str | None = None) -> Suspended:
    """Suspend to shared storage. `mode` None: "save" unless a device blocks it, then "guest"."""
    validate_name(vm)
    if mode is not None and mode not in MODES:
        raise InvalidRequest(f"suspend mode must be one of {', '.join(MODES)}, not {mode!r}")
    try:
        return _suspend(fleet, vm, parked, mode)
    finally:
        fleet.publish(vm)  # saved, or still running where it was


def _suspend(fleet: Fleet, vm: str, parked: bool, mode: str | None) -> Suspended:
    with fleet.lock_vm(vm, f"suspend of {vm}") as lease:
        if find_suspended(fleet, vm):
            raise Conflict(f"VM {vm!r} is already suspended")
        guest = fleet.locate(vm)
        if guest.state() != "running":
            raise Conflict(f"VM {vm!r} is {guest.state()}: only a running VM is suspended")
        live, why = guest.live_migratable()
        mode = mode or ("save" if live else "guest")
        if mode == "save" and not live:
            raise Conflict(f"VM {vm!r} cannot be saved by its host: it {why}; it can hibernate "
                           "(--mode guest)")
        lease.check()
        if mode == "guest":
            return _hibernate(fleet, guest, parked)
        d = save_dir(fleet, vm)
        d.mkdir(parents=True, exist_ok=True)
        (d / "domain.xml").write_text(guest.xml(inactive=True, migratable=True))
        partial = d / "image.partial"
        t0 = time.monotonic()
        try:
            guest.save(partial)
        except VmmgrError:
            # libvirt leaves the guest running: nothing to undo but the partial file.
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, d / "image")
        record = Suspended(vm, guest.host_name, guest.memory_mib(), guest.vcpus(), time.time(),
                           int((time.monotonic() - t0) * 1000), (d / "image").stat().st_size,
                           parked)
        _write_json(d / "record.json", asdict(record))
        guest.undefine()  # the image is complete: the VM now lives on storage only
        return record


def _hibernate(fleet: Fleet, guest, parked: bool) -> Suspended:
    """Ask the guest, through its agent, to hibernate (ACPI S4 written to its swap disk on shared
    storage, then power off). Its drivers put its devices in a state they can restore, which is
    why this works where a host-level save cannot. If the guest does not go, it keeps running."""
    vm, host = guest.name, guest.host_name
    model, count = guest.device_needs()
    d = save_dir(fleet, vm)
    d.mkdir(parents=True, exist_ok=True)
    (d / "domain.xml").write_text(guest.xml(inactive=True))
    t0 = time.monotonic()
    refused = None
    try:
        # A guest that neither answers nor goes down must not hang the operation.
        guest.hibernate(AGENT_TIMEOUT)
    except VmmgrError as err:
        refused = err  # the guest may still be going down: its power state decides
    deadline = time.monotonic() + (10 if refused else HIBERNATE_TIMEOUT)
    while guest.is_active():
        if time.monotonic() > deadline:
            shutil.rmtree(d, ignore_errors=True)
            why = refused or f"still running {HIBERNATE_TIMEOUT} s after it was asked"
            raise HibernationFailed(f"{vm} did not hibernate ({why}); it keeps running on {host}")
        time.sleep(0.25)
    disk = fleet.swap_disk_path(vm)
    record = Suspended(vm, host, guest.memory_mib(), guest.vcpus(), time.time(),
                       int((time.monotonic() - t0) * 1000),
                       disk.stat().st_blocks * 512 if disk.exists() else 0, parked,
                       "guest", model, count)
    _write_json(d / "record.json", asdict(record))
    guest.undefine()  # powered off with its image on shared storage: it lives there now
    return record


def resume(fleet: Fleet, vm: str, host: str | None = None) -> Resumed:
    validate_name(vm)
    try:
        return _resume(fleet, vm, host)
    finally:
        fleet.publish(vm)  # running again, or still suspended


def _resume(fleet: Fleet, vm: str, host: str | None) -> Resumed:
    with fleet.lock_vm(vm, f"resume of {vm}") as lease:
        record = find_suspended(fleet, vm)
        if record is None:
            if fleet.find(vm):
                raise Conflict(f"VM {vm!r} is not suspended: it runs on {fleet.locate(vm).host_name}")
            raise NotFound(f"unknown VM {vm!r}")
        needs = (record.memory_mib, record.vcpus, record.device_model, record.device_count)
        if host is None:
            host, refused = choose_host(fleet.active_capacities(), *needs)
            if host is None:
                why = "; ".join(f"{h}: {r}" for h, r in refused.items()) or "no hosts"
                raise Conflict(f"no host has room to resume {vm}: {why}")
        target = fleet.host(host)
        require_active(target)
        reason = refusal(target.capacity(), *needs)
        if reason:
            raise Conflict(f"host {host} has no room to resume {vm}: {reason}")
        d = save_dir(fleet, vm)
        lease.check()
        segment = console.next_segment(fleet.paths.consoles, vm, host)
        if record.mode == "guest":
            return _boot_from_hibernation(fleet, record, target, segment)
        image_xml = target.save_image_xml(d / "image")
        t0 = time.monotonic()
        target.restore(d / "image", set_console_path(image_xml, segment))
        restore_ms = int((time.monotonic() - t0) * 1000)
        definition = (d / "domain.xml").read_text()
        target.define(set_console_path(definition, segment))
        fleet.route_address(address_of(definition), host)
        for name in ("image", "domain.xml", "record.json"):
            (d / name).unlink(missing_ok=True)
        d.rmdir()
        return Resumed(vm, host, restore_ms, round(time.time() - record.suspended_at, 1))


def _boot_from_hibernation(fleet: Fleet, record: Suspended, target, segment: Path) -> Resumed:
    """Define the VM on `target` with that host's free devices and start it: its kernel finds
    the hibernation image on the swap disk and restores the guest exactly where it stopped."""
    d = save_dir(fleet, record.vm)
    held = target.free_devices(record.device_model)[:record.device_count]
    definition = set_console_path((d / "domain.xml").read_text(), segment)
    if record.device_count:
        definition = devices.assign(definition, held, target.name)
    t0 = time.monotonic()
    guest = target.define(definition)
    try:
        guest.start()
    except VmmgrError:
        guest.undefine()  # the image stays on storage, the VM stays suspended
        raise
    fleet.route_address(address_of(definition), target.name)
    shutil.rmtree(d)
    return Resumed(record.vm, target.name, int((time.monotonic() - t0) * 1000),
                   round(time.time() - record.suspended_at, 1))


def _record(d: Path) -> Suspended:
    return Suspended(**json.loads((d / "record.json").read_text()))


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)

