"""Suspend to disk and resume elsewhere: the path when no host has room.

`suspend` saves the running VM's memory and device state to its site's storage (libvirt's save: a
migration into a file) and removes it from its host; `resume` restores it on any host, exactly where
it stopped, and defines it there again: a host of the save's site reads the image from the storage
they share, a host of another site is sent it first. While suspended a VM lives only in
`storage/saves/<vm>/` on its site's storage: the save image, the persistent definition and a small
record. Only that site's nodes act on the folder (`Fleet.sees_save`; the task API queues the work
there). The image is
written next to its final name and renamed only once complete, so a half image is never mistaken
for a good one.

Every step can be cut short (a worker killed, a node lost) while libvirt carries on without its
client: a save goes on to the end and stops the domain. So each change is announced on storage
before it starts: `intent.json` before a save or hibernation, and a resume first renames
`record.json` to `claim.json` (one rename wins: two resumes never restore one image). `recover`
reads what was left, with libvirt's view of the VM, and finishes the step or undoes it.

The store keeps a copy of each folder (`sync_record`, under the VM's lock after each step, and
the reconcile's `sync_records`): listings, the web console and the reclaim read the saves there,
on any node, while the folder decides what a resume may take.
"""

import contextlib
import json
import os
import shutil
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

import redis

from . import console, devices, local_disks, os_images, site_consoles, site_images
from .errors import (Conflict, HibernationFailed, HostUnreachable, InvalidRequest, NotFound,
                     VmmgrError)
from .fleet import Fleet, require_active
from .locks import HOUSEKEEPING
from .placement import choose_host, refusal
from .render import address_of, group_of, set_console_path, workload_of
from .spec import validate_name
from .state import stored


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
    # "stopped": a stopped VM's definition, kept here while no host has room to hold it (there
    # was nothing to save: it was not running); its resume defines it on a host, still stopped.
    mode: str = "save"
    device_model: str = ""
    device_count: int = 0
    group: str = ""  # its job's VMs resume together
    # The site whose storage holds the save ("": a fleet that names none): its site's workers
    # act on it; a resume on another site's host sends that host the image
    # (`local_disks.receive_image`).
    site: str = ""


@dataclass(frozen=True)
class Resumed:
    vm: str
    host: str
    restore_ms: int
    suspended_for_s: float
    state: str = "running"  # "shutoff": a stopped VM's definition, back on a host
    # A guest hibernation only: whether the guest came back from its image (False: it booted
    # afresh, what it had in memory is lost); None where that cannot be told.
    restored: bool | None = None


# The built-in guest's /init prints this as its first line when it goes on booting past the
# resume from its swap disk: no hibernation image was restored (vmmgr/guest_image/init.sh).
FRESH_BOOT_LINE = "vmmgr: fresh boot"
RESTORE_WAIT = 120  # s for a guest booted from its hibernation image to say which it did (TCG)
AGENT_GRACE_S = 3  # s for a line still in the guest's UART to reach the file


def save_dir(fleet: Fleet, vm: str) -> Path:
    return fleet.paths.saves / vm


def saving_groups(fleet: Fleet) -> set[str]:
    """The jobs (groups) with a VM whose save has begun and not ended: until it ends, none of
    the job's parked VMs resume (a job resumes whole, or not at all). From the store's copies,
    and the folders where this node sees them: a copy not written yet must not let a job
    resume in part."""
    saves = list(fleet.state.saves().values())
    root = fleet.paths.saves
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            saves.append(folder_save(d))
        except (OSError, ValueError):
            continue  # unreadable now: the next pass
    return {s["intent"].get("group", "") for s in saves
            if s and s["state"] == "saving" and s["record"] is None} - {""}


def suspended(fleet: Fleet) -> list[Suspended]:
    """The VMs saved and not claimed by a resume, from the store (any node can list them)."""
    records = [Suspended(**s["record"]) for s in fleet.state.saves().values()
               if s["record"] is not None and s["state"] != "claimed"]
    return sorted(records, key=lambda r: r.suspended_at)  # oldest first: the resume order


def find_suspended(fleet: Fleet, vm: str) -> Suspended | None:
    """From the folder itself: what a suspend or resume holding the VM's lock decides on (on a
    node of the save's site: see `Fleet.sees_save`)."""
    d = save_dir(fleet, vm)
    return _record(d) if (d / RECORD).is_file() else None


def folder_save(d: Path) -> dict | None:
    """What a save folder holds, in the store's shape (its "record" None until written); None
    where it holds no save. "saving" while a suspend's intent is there (with its record, if
    cut short after writing it), "claimed" while a resume holds it, else "saved". A file that
    cannot be read raises: a save is never forgotten for an error of the storage."""
    claim, record, intent = (_json_or_none(d / name) for name in (CLAIM, RECORD, INTENT))
    if claim is None and record is None and intent is None:
        return None
    try:
        address = address_of((d / "domain.xml").read_text()) or ""
    except (FileNotFoundError, ET.ParseError):  # a save cut short as it wrote its definition
        address = ""
    return {"state": "claimed" if claim is not None else "saving" if intent is not None
            else "saved",
            "intent": intent or {}, "record": claim if claim is not None else record,
            "address": address,
            "disk": (d / DISK_SUM).is_file()}


def sync_record(fleet: Fleet, vm: str) -> None:
    """Write the VM's save folder to the store (for the caller holding the VM's lock). Nothing
    where this node does not see the storage the save is on (another site's): it cannot tell."""
    if not fleet.sees_save(vm):
        return
    save = folder_save(save_dir(fleet, vm))
    if save is None:
        fleet.state.forget_save(vm)
    else:
        fleet.state.put_save(vm, save)


def _sync_quietly(fleet: Fleet, vm: str) -> None:
    """After a step, whatever it ended in: a write that fails leaves the store's copy behind
    the folder until the reconcile's pass (`sync_records`), never the step undone or its own
    error hidden."""
    try:
        sync_record(fleet, vm)
    except Exception:  # noqa: BLE001 - a copy; the step's outcome is what is reported
        pass


def _sync_begun(fleet: Fleet, vm: str, d: Path) -> None:
    """The copy of a save just begun, before anything starts: its job's parked VMs wait for it
    (`saving_groups`). One the store does not take ends the suspend here, with nothing done."""
    try:
        sync_record(fleet, vm)
    except Exception:
        shutil.rmtree(d, ignore_errors=True)
        _sync_quietly(fleet, vm)
        raise


def sync_records(fleet: Fleet, report=None) -> list[str]:
    """The reconcile's pass: every save folder whose copy in the store differs (a worker killed
    between a step and its write, a store restored from an old copy), and every copy whose
    folder is gone, written again under the VM's lock. A VM an operation holds is left to it:
    it writes its own when it ends. Returns the VMs whose copy changed (each an event); nothing
    on a node that does not see the storage. Only this node's site's saves: another site's
    copies are never taken for gone here, where their folders cannot be seen."""
    root = fleet.paths.saves
    if not root.is_dir():
        return []
    stored = fleet.state.saves()
    own = fleet.own_site()
    mine = {vm for vm, save in stored.items() if fleet.save_site(save) == own}
    changed = []
    for vm in sorted({d.name for d in root.iterdir() if d.is_dir()} | mine):
        try:
            found = folder_save(save_dir(fleet, vm))
            unnamed = own and found is not None and fleet.save_site(found) == ""
            if found == stored.get(vm) and not unnamed:
                continue
            with fleet.lock_vm(vm, f"{HOUSEKEEPING}copy of {vm}'s save"):
                before = fleet.state.save_of(vm)  # (an operation may have ended since)
                if unnamed:
                    if fleet.save_site(before) not in (None, ""):
                        continue  # the store names its site: a same-named folder is not it
                    _name_site(fleet, vm, own)
                sync_record(fleet, vm)
                if fleet.state.save_of(vm) == before:
                    continue
        except (VmmgrError, OSError, ValueError):
            continue  # held by an operation, or unreadable now: the next pass
        except Exception as err:  # noqa: BLE001 - one folder's surprise must not end the pass
            if report is not None:
                report.event(f"{vm}: its save not copied to the store: {err}", vm=vm,
                             kind="error")
            continue
        changed.append(vm)
        if report is not None:
            report.event(f"{vm}: its save, made before saves named their site, is site {own}'s "
                         "(it is on that site's storage)" if unnamed else
                         f"{vm}: the store's copy of its save written again from storage",
                         vm=vm, kind="repair")
    return changed


def _name_site(fleet: Fleet, vm: str, site: str) -> None:
    """A save made before saves named their site, found on this site's storage (a fleet that
    has named its sites since): it is this site's, and now says so, in its folder and in the
    store, so that this site's nodes resume it (no other sees it)."""
    d = save_dir(fleet, vm)
    for name in (INTENT, RECORD, CLAIM):
        data = _json_or_none(d / name)
        if data is not None and not data.get("site"):
            _write_json(d / name, data | {"site": site})
    fleet.state.put_save(vm, folder_save(d))


MODES = ("save", "guest")
INTENT, RECORD, CLAIM = "intent.json", "record.json", "claim.json"
DISK, DISK_SUM = "disk.qcow2", "disk.json"  # a local disk kept while the VM is suspended
SEED = "seed.iso"  # and its seed (`local_disks`), whose SHA-256 is in DISK_SUM too
SENT = "sent.json"  # the host of another site a resume sends the image to
# libvirt writes this magic at the head of a save image only once the image is complete
# ("LibvirtQemudPart" while it is being written): src/qemu/qemu_saveimage.h
COMPLETE_MAGIC = b"LibvirtQemudSave"
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
        try:
            return _suspend_held(fleet, vm, parked, mode, lease)
        finally:
            _sync_quietly(fleet, vm)


def _suspend_held(fleet: Fleet, vm: str, parked: bool, mode: str | None, lease) -> Suspended:
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
    fleet.require_own_site(guest.host_name, f"the suspend of {vm}")
    lease.check()
    if mode == "guest":
        return _hibernate(fleet, guest, parked)
    host = fleet.host(guest.host_name)  # before anything starts: nothing to undo if it fails
    d = _begin(guest, parked, "save", inactive_xml=guest.xml(inactive=True, migratable=True),
               d=save_dir(fleet, vm), site=fleet.sites().get(guest.host_name, ""))
    _sync_begun(fleet, vm, d)
    partial = d / "image.partial"
    t0 = time.monotonic()
    try:
        # on a connection of its own: a reclaim's moves poll this host meanwhile, and a call
        # that lasts seconds on theirs can hold one of their polls up (`connection_apart`)
        with host.connection_apart() as conn:
            guest.save(partial, via=conn)
    except VmmgrError:
        # A failed save leaves the guest running: nothing to undo but the files. An error
        # that only says the answer was lost (the connection broke) may hide a save libvirt
        # finishes on its own: then the intent stays, for `recover` to settle.
        if _running_idle(guest):
            shutil.rmtree(d, ignore_errors=True)
        raise
    try:
        return _saved(d, guest, int((time.monotonic() - t0) * 1000))
    except (VmmgrError, OSError) as err:
        if (d / RECORD).is_file() or not (d / "image.partial").is_file():
            raise  # suspended after all, or not this step's failure: recover settles it
        # Its local disk could not be kept: the VM goes back to running on its host from
        # the image just saved (its disk is still there), as if never suspended.
        host.restore(partial, host.save_image_xml(partial))
        shutil.rmtree(d, ignore_errors=True)
        raise VmmgrError(f"{vm} could not be suspended ({err}); it runs on "
                         f"{guest.host_name} again, restored from its save") from err


def park_stopped(fleet: Fleet, vm: str) -> Suspended:
    """Keep a stopped VM's definition on storage and take it off its host: the host is going
    (reclaimed) and no other has room to hold the VM. Nothing is lost with the host; room
    returning brings it back to one, stopped (`resume`). For the caller holding the VM's lock."""
    guest = fleet.locate(vm)
    if guest.is_active():
        raise Conflict(f"VM {vm!r} is {guest.state()}: only a stopped VM's definition is parked")
    fleet.require_own_site(guest.host_name, f"the parking of {vm}")
    try:
        d = _begin(guest, True, "stopped", guest.xml(inactive=True, migratable=True),
                   save_dir(fleet, vm), fleet.sites().get(guest.host_name, ""))
        _sync_begun(fleet, vm, d)  # in the store before the host lets the VM go
        return _suspended(d, guest, json.loads((d / INTENT).read_text()), 0, 0)
    finally:
        _sync_quietly(fleet, vm)


def _hibernate(fleet: Fleet, guest, parked: bool) -> Suspended:
    """Ask the guest, through its agent, to hibernate (ACPI S4 written to its swap disk on shared
    storage, then power off). Its drivers put its devices in a state they can restore, which is
    why this works where a host-level save cannot. If the guest does not go, it keeps running."""
    vm, host = guest.name, guest.host_name
    d = _begin(guest, parked, "guest", inactive_xml=guest.xml(inactive=True),
               d=save_dir(fleet, vm), site=fleet.sites().get(host, ""))
    _sync_begun(fleet, vm, d)
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
    return _hibernated(d, guest, fleet.swap_disk_path(vm), int((time.monotonic() - t0) * 1000))


def _begin(guest, parked: bool, mode: str, inactive_xml: str, d: Path, site: str) -> Path:
    """The save directory with the VM's definition and the intent: what `recover` needs to
    finish or undo the suspend if this process does not live to."""
    model, count = guest.device_needs() if mode == "guest" else ("", 0)
    d.mkdir(parents=True, exist_ok=True)
    for stale in (DISK, SEED, DISK_SUM):  # a directory an earlier run left half removed
        (d / stale).unlink(missing_ok=True)
    (d / "domain.xml").write_text(inactive_xml)
    _write_json(d / INTENT, {"vm": guest.name, "from_host": guest.host_name,
                             "memory_mib": guest.memory_mib(), "vcpus": guest.vcpus(),
                             "parked": parked, "mode": mode, "device_model": model,
                             "device_count": count, "group": group_of(inactive_xml),
                             "site": site, "started_at": time.time()})
    return d


def _saved(d: Path, guest, save_ms: int) -> Suspended:
    """libvirt's save is complete: its local disk (if any) is kept beside it, the image takes
    its name, the record is written, and the VM now lives on storage only. The image keeps its
    partial name until the disk is kept: a run cut short in between is finished by `recover`,
    which finds a complete image.partial and keeps the disk again."""
    intent = json.loads((d / INTENT).read_text())
    _keep_local_disk(d, guest)
    if (d / "image.partial").exists():
        os.replace(d / "image.partial", d / "image")
    return _suspended(d, guest, intent, save_ms, (d / "image").stat().st_size)


def _hibernated(d: Path, guest, disk: Path, save_ms: int) -> Suspended:
    """The guest powered itself off with its image on its swap disk (shared storage)."""
    intent = json.loads((d / INTENT).read_text())
    return _suspended(d, guest, intent, save_ms,
                      disk.stat().st_blocks * 512 if disk.exists() else 0)


def _keep_local_disk(d: Path, guest) -> bool:
    """A VM whose disk is on its host's own storage (`local_disks`) is suspended with it: the
    disk is copied beside its save, checksummed, before the record says it is suspended, and
    put on whichever host resumes it. Whether it has one."""
    if not local_disks.local_disks((d / "domain.xml").read_text()):
        return False
    if (d / DISK_SUM).is_file():
        return True  # kept by a run cut short after it
    if guest is None:
        raise VmmgrError(f"{d.name}'s local disk is not on storage and its host no longer "
                         "defines it")
    sums = {"sha256": local_disks.save_to(guest.connection(), d.name, d / DISK)}
    if local_disks.has_pool_seed((d / "domain.xml").read_text()):  # refused if it is not there
        sums["seed_sha256"] = local_disks.save_to(guest.connection(), d.name, d / SEED,
                                                  name=local_disks.seed_volume_name(d.name))
    _write_json(d / DISK_SUM, sums)  # last: what makes the kept disk whole
    return True


def load_local_disk(fleet: Fleet, d: Path, target, from_host: str) -> bool:
    """Put a suspended VM's kept disk on `target`'s own storage (checked against its sum),
    its base image sent there first if that storage lacks it (from the host it left, or any
    other that holds it); whether it has one."""
    if not (d / DISK_SUM).is_file():
        return False
    base = os_images.backing_file(d / DISK)
    if base:
        others = sorted(h.name for h in fleet.hosts() if h.name != from_host)
        try:
            site_images.ensure(fleet, target.name, base, [from_host, *others])
        except VmmgrError as err:
            raise VmmgrError(f"{d.name} not resumed on {target.name}: its storage lacks the "
                             f"base image {base} and could not receive it ({err}); "
                             f"{d.name} stays suspended") from err
    sums = json.loads((d / DISK_SUM).read_text())
    local_disks.load_from(target.conn, d.name, d / DISK, sums["sha256"])
    if "seed_sha256" in sums:
        try:
            local_disks.load_from(target.conn, d.name, d / SEED, sums["seed_sha256"],
                                  name=local_disks.seed_volume_name(d.name))
        except BaseException:
            with contextlib.suppress(VmmgrError):  # (the first error is the one to tell)
                local_disks.remove(target.conn, d.name)  # no overlay left without its seed
            raise
    return True


def _suspended(d: Path, guest, intent: dict, save_ms: int, size: int) -> Suspended:
    local = _keep_local_disk(d, guest)
    record = Suspended(intent["vm"], intent["from_host"], intent["memory_mib"], intent["vcpus"],
                       time.time(), save_ms, size, intent["parked"], intent["mode"],
                       intent["device_model"], intent["device_count"],
                       intent.get("group", ""), intent.get("site", ""))
    _write_json(d / RECORD, asdict(record))
    if guest is not None:
        guest.undefine()
        if local:
            local_disks.remove(guest.connection(), d.name)  # its copy is on storage now
    (d / INTENT).unlink()
    return record


def resume(fleet: Fleet, vm: str, host: str | None = None) -> Resumed:
    validate_name(vm)
    try:
        return _resume(fleet, vm, host)
    finally:
        fleet.publish(vm)  # running again, or still suspended


def _resume(fleet: Fleet, vm: str, host: str | None) -> Resumed:
    with fleet.lock_vm(vm, f"resume of {vm}") as lease:
        try:
            return _resume_held(fleet, vm, host, lease)
        finally:
            _sync_quietly(fleet, vm)


def _resume_held(fleet: Fleet, vm: str, host: str | None, lease) -> Resumed:
    fleet.require_save_here(vm, "resume")
    record = find_suspended(fleet, vm)
    if record is None:
        if fleet.find(vm):
            raise Conflict(f"VM {vm!r} is not suspended: it runs on {fleet.locate(vm).host_name}")
        raise NotFound(f"unknown VM {vm!r}")
    d = save_dir(fleet, vm)
    needs = (record.memory_mib, record.vcpus, record.device_model, record.device_count)
    sites = fleet.sites()
    home = record.site  # ("": a fleet's that named no site when it was saved)
    bound = local_disks.site_bound((d / "domain.xml").read_text(), fleet.paths.storage)
    if host is None:
        caps = fleet.active_capacities()  # back in the site it left, while that has room
        if bound:
            caps = {h: c for h, c in caps.items() if sites.get(h, "") == home}
        host, refused = choose_host(caps, *needs, sites, home)
        if host is None:
            why = "; ".join(f"{h}: {r}" for h, r in refused.items()) or "no hosts"
            raise Conflict(f"no host has room to resume {vm}" + (
                f" in its site {home or '-'}" if bound else "") + f": {why}")
    if bound and sites.get(host, "") != home:
        raise Conflict(f"{vm} resumes only in its site ({home or '-'}), not on {host}: "
                       f"{bound[0]} is on that site's storage")
    target = fleet.host(host)
    require_active(target)
    reason = refusal(target.capacity(), *needs)
    if reason:
        raise Conflict(f"host {host} has no room to resume {vm}: {reason}")
    segment = site_consoles.new_segment(fleet, vm, host)
    lease.check()
    _claim(d, vm)
    _sync_quietly(fleet, vm)  # claimed: its row comes from the host it runs on from here
    try:
        load_local_disk(fleet, d, target, record.from_host)
        image = d / "image"
        if record.mode == "save" and sites.get(host, "") != home:
            # a host of another site reads its own storage, not this one's: the image goes
            # there (where to is noted first: `recover` takes it back from there)
            _write_json(d / SENT, {"host": host})
            try:
                image = Path(local_disks.receive_image(target.conn, vm, d / "image"))
            except VmmgrError as err:  # (of its kind: a host that does not answer exits 5)
                said = type(err)(f"{vm} not resumed on {host}: it could not receive the save "
                                 f"image ({err}); {vm} stays suspended on site {home or '-'}")
                said.detail = err.detail
                raise said from err
    except Exception:
        _drop_loaded_disk(d, target)
        # (what reached the target and could not be taken back then is the sweep's: `recover`
        # has nothing to undo once the claim is given back)
        (d / SENT).unlink(missing_ok=True)
        _unclaim(d)  # its kept disk and image stay on storage, the VM stays suspended
        site_consoles.drop_if_empty(fleet, vm, segment)
        raise
    if record.mode == "guest":
        return _boot_from_hibernation(fleet, record, target, segment, lease)
    if record.mode == "stopped":
        t0 = time.monotonic()
        _resumed_on(fleet, target, d, segment, lease)  # defined there, not started
        return Resumed(vm, host, int((time.monotonic() - t0) * 1000),
                       round(time.time() - record.suspended_at, 1), state="shutoff")
    t0 = time.monotonic()
    try:
        lease.check()  # (the image sent is swept where no resume holds the VM)
        target.restore(image, set_console_path(target.save_image_xml(image), segment))
    except HostUnreachable:
        # It may have restored there before the answer was lost: the claim stays, and
        # `recover` (which waits for the host to answer) finishes or undoes the resume.
        raise
    except VmmgrError:
        _drop_loaded_disk(d, target)
        _drop_images_sent(fleet, vm, d)
        _unclaim(d)  # nothing runs: the image stays, the VM stays suspended
        site_consoles.drop_if_empty(fleet, vm, segment)
        raise
    # It runs on the target from here: whatever fails now is finished forward (`recover`),
    # never undone, or the image could be restored a second time.
    restore_ms = int((time.monotonic() - t0) * 1000)
    _drop_images_sent(fleet, vm, d)  # restored: QEMU holds what it needed of it
    _resumed_on(fleet, target, d, segment, lease)
    return Resumed(vm, host, restore_ms, round(time.time() - record.suspended_at, 1))


def _drop_loaded_disk(d: Path, target) -> None:
    """A resume that failed on `target` takes back the disk it put there (storage keeps
    the VM's copy)."""
    if (d / DISK_SUM).is_file():
        try:
            local_disks.remove(target.conn, d.name)  # refused where the VM is defined
        except VmmgrError:
            pass  # one in use, or a host away: the reconcile's sweep takes it back later


def _claim(d: Path, vm: str) -> None:
    """Take the image for this resume: of two resumes, only one rename succeeds."""
    try:
        os.rename(d / RECORD, d / CLAIM)
    except FileNotFoundError:
        raise Conflict(f"VM {vm!r} is being resumed by another request") from None


def _unclaim(d: Path) -> None:
    os.replace(d / CLAIM, d / RECORD)


def _resumed_on(fleet: Fleet, host, d: Path, segment: Path | None, lease=None) -> None:
    """The VM runs on `host`: defined there for good, its address routed, its save removed."""
    definition = (d / "domain.xml").read_text()
    if segment is not None:
        host.define(set_console_path(definition, segment))
    # It runs (or is defined) there already: a store out of reach delays the route, and the
    # task's answer, until it is back, rather than fail a resume that has happened (seen on the
    # lab: Redis killed mid-resume, the VM running on its target, its task "failed"). An edge
    # that refuses the route (its lock busy, `wg` failing) fails it no more: the reconcile's
    # `repair_edge` routes the address to where the VM runs.
    try:
        stored(lambda: fleet.route_address(address_of(definition), host.name))
    except VmmgrError as err:
        with contextlib.suppress(redis.RedisError):
            fleet.state.event(f"{d.name}: resumed on {host.name}, but its address is not routed "
                              f"there yet ({err}); the reconcile routes it", kind="error",
                              vm=d.name, host=host.name)
    if lease is not None:  # a lock lost meanwhile: its new holder's `recover` finishes this
        stored(lease.confirm)
    shutil.rmtree(d)


def _boot_from_hibernation(fleet: Fleet, record: Suspended, target, segment: Path,
                           lease=None) -> Resumed:
    """Define the VM on `target` with that host's free devices and start it: its kernel finds
    the hibernation image on the swap disk and restores the guest exactly where it stopped."""
    d = save_dir(fleet, record.vm)
    held = target.free_devices(record.device_model)[:record.device_count]
    definition = set_console_path((d / "domain.xml").read_text(), segment)
    if record.device_count:
        definition = devices.assign(definition, held, target.name)
    t0 = time.monotonic()
    try:
        guest = target.define(definition)
        try:
            guest.start()
        except HostUnreachable:
            raise
        except VmmgrError:
            guest.undefine()
            raise
    except HostUnreachable:
        raise  # it may have started there: the claim stays for `recover`, as after a restore
    except VmmgrError:
        _drop_loaded_disk(d, target)
        _unclaim(d)  # the image stays on the swap disk, the VM stays suspended
        raise
    _resumed_on(fleet, target, d, None, lease)
    # The kernel restores the image, or finds none it can use and boots afresh: only the guest
    # can tell, and the built-in one does on its console (a real image's kernel is quiet).
    restored = (came_back(fleet.consoles, segment, guest, RESTORE_WAIT)
                if workload_of(definition) else None)
    return Resumed(record.vm, target.name, int((time.monotonic() - t0) * 1000),
                   round(time.time() - record.suspended_at, 1), restored=restored)


def came_back(consoles: console.Consoles, segment: Path, guest, timeout: float,
              poll: float = 0.5) -> bool | None:
    """Whether a built-in guest booted from its hibernation image restored it. Booting afresh,
    its /init writes FRESH_BOOT_LINE first, before its agent opens its port; restored, it goes
    on printing what it printed, and its agent (running all along) opens the port again. So:
    the first whole line of its new console segment (read from its host's site: `consoles`)
    decides, else a connected agent with no line a moment later means restored. None: neither
    within `timeout`."""
    part = console.parse(segment.name)

    def first_line() -> str | None:
        if part is None:  # not a segment vmmgr named: nothing to read
            return None
        try:  # the head only: a chatty guest's log grows fast
            head = b"".join(consoles.chunks(part, 0, 4096))
        except VmmgrError:  # its host's site does not answer now: asked again
            return None
        text = head.decode(errors="replace").replace("\r", "")
        return text.split("\n", 1)[0].strip() if "\n" in text else None

    deadline = time.monotonic() + timeout
    connected_at = None
    while True:
        line = first_line()
        if line is not None:
            return line != FRESH_BOOT_LINE
        if connected_at is None and _agent_connected(guest):
            connected_at = time.monotonic()
        if connected_at is not None and time.monotonic() - connected_at > AGENT_GRACE_S:
            return True  # (the fresh boot's line would be out: the UART sends it first)
        if time.monotonic() > deadline:
            return None
        time.sleep(poll)


def _agent_connected(guest) -> bool:
    try:
        return guest.agent_connected()
    except VmmgrError:
        return False


# ---- what a step cut short left ------------------------------------------------------------

def cut_short(fleet: Fleet) -> list[str]:
    """The VMs whose suspend or resume was cut short (what `recover` is for)."""
    root = fleet.paths.saves
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if (d / INTENT).is_file() or (d / CLAIM).is_file())


def recover(fleet: Fleet, vm: str, wait: float = 0) -> str | None:
    """Finish or undo a suspend or resume of `vm` that was cut short; says what it did (None:
    nothing was left half done). For the caller holding the VM's lock. Nothing is decided
    without the hosts concerned: one that does not answer raises HostUnreachable, and a job
    libvirt still runs is waited for up to `wait` seconds, then left (Conflict)."""
    d = save_dir(fleet, vm)
    try:
        if (d / CLAIM).is_file():
            return _recover_resume(fleet, vm, d, wait)
        if (d / INTENT).is_file():
            return _recover_suspend(fleet, vm, d, wait)
        return None
    finally:
        _sync_quietly(fleet, vm)


def _recover_suspend(fleet: Fleet, vm: str, d: Path, wait: float) -> str:
    intent = json.loads((d / INTENT).read_text())
    host = fleet.host(intent["from_host"])
    guest = host.find_guest(vm)
    what = {"guest": "hibernation", "stopped": "parking"}.get(intent["mode"], "save")
    if (d / RECORD).is_file():  # cut short after the record: only the host's copy is left
        if guest is not None and not guest.is_active():
            guest.undefine()
        if (d / DISK_SUM).is_file() and host.find_guest(vm) is None:
            local_disks.remove(host.conn, vm)  # its kept copy is on storage
        (d / INTENT).unlink()
        return f"the {what} cut short had finished: suspended"
    if guest is None:
        # Gone from the host it was saved from. Running on another, it was moved there since
        # (its save had failed, and the intent outlived it): the intent is stale, and booting
        # or parking the VM from it would run it twice.
        elsewhere = fleet.find_all(vm, strict=True)
        if elsewhere:
            shutil.rmtree(d)
            return (f"the {what} cut short had left it running: it has moved to "
                    f"{elsewhere[0].host_name} since")
    if intent["mode"] == "stopped":
        if guest is not None and guest.is_active():  # started behind vmmgr's back meanwhile
            shutil.rmtree(d)
            return f"the parking of its definition was cut short: it runs on {host.name}"
        _suspended(d, guest, intent, 0, 0)
        return "the parking of its definition cut short was finished: parked, stopped"
    deadline = time.monotonic() + wait
    while guest is not None and guest.is_active() and (
            guest.has_job() if intent["mode"] == "save"
            else time.time() < intent["started_at"] + HIBERNATE_TIMEOUT):
        if time.monotonic() >= deadline:
            raise Conflict(f"VM {vm!r}: the {what} is still under way on {host.name}")
        time.sleep(0.5)
    active = guest is not None and guest.is_active()
    if not active and intent["mode"] == "guest":
        _hibernated(d, guest, fleet.swap_disk_path(vm), 0)
        return "the hibernation cut short had completed (the guest powered off): suspended"
    image = d / "image.partial" if (d / "image.partial").exists() else d / "image"
    if not active and _complete(image):
        written = image.stat().st_mtime
        _saved(d, guest, max(0, int((written - intent["started_at"]) * 1000)))
        return f"the save cut short had completed on {host.name}: suspended"
    if active:
        shutil.rmtree(d)
        return f"the {what} cut short never completed: it runs on {host.name} as before"
    # Shut off without a complete image (its QEMU or host died mid-save): the memory is gone.
    # A VM never stays stopped: it boots again from its definition.
    if guest is None:
        guest = host.define((d / "domain.xml").read_text())
    guest.start()
    shutil.rmtree(d)
    return (f"the save cut short left it shut off with no complete image (its memory is "
            f"lost): booted again on {host.name}")


def _recover_resume(fleet: Fleet, vm: str, d: Path, wait: float) -> str:
    deadline = time.monotonic() + wait
    while True:
        found = fleet.find_all(vm, strict=True)  # the one that does not answer may hold it
        guest = next((g for g in found if g.state() == "running"), None) or (
            found[0] if found else None)
        if guest is None:
            _drop_images_sent(fleet, vm, d)
            _unclaim(d)
            return "the resume cut short had not restored it: suspended again"
        if guest.state() == "running" or not guest.has_job():
            break
        if time.monotonic() >= deadline:
            raise Conflict(f"VM {vm!r}: its restore is still under way on {guest.host_name}")
        time.sleep(0.5)
    stopped = _record_at(d / CLAIM).mode == "stopped"
    if not guest.is_active() and not stopped:
        guest.start()  # defined but never started (a hibernated guest boots into its image)
    elif guest.state() == "paused":
        guest.resume()
    host = fleet.host(guest.host_name)
    _drop_images_sent(fleet, vm, d)
    _resumed_on(fleet, host, d, None if guest.is_persistent() else guest.console_path())
    return f"the resume cut short had restored it on {host.name}: finished"


def _drop_images_sent(fleet: Fleet, vm: str, d: Path) -> None:
    """Remove the save image a resume cut short may have sent to a host of another site (the
    one `SENT` names). A copy there is never restored by anyone (a resume sends its own), so
    one on a host that does not answer now is only space: the reconcile's sweep takes it back
    once it answers (`sweep_sent_images`)."""
    sent = _json_or_none(d / SENT)
    if sent is None:
        return
    try:
        local_disks.remove_image(fleet.host(sent["host"]).conn, vm)
        (d / SENT).unlink(missing_ok=True)
    except (VmmgrError, redis.RedisError):
        pass  # (the store out of reach: its inventory is)


def _running_idle(guest) -> bool:
    try:
        return guest.state() == "running" and not guest.has_job()
    except VmmgrError:
        return False


def _complete(image: Path) -> bool:
    try:
        with open(image, "rb") as f:
            return f.read(len(COMPLETE_MAGIC)) == COMPLETE_MAGIC
    except OSError:
        return False


def _record(d: Path) -> Suspended:
    return _record_at(d / RECORD)


def _record_at(path: Path) -> Suspended:
    return Suspended(**json.loads(path.read_text()))


def _json_or_none(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)

