"""Disks on a host's own storage: a VM's qcow2 overlay kept on the host that runs it (local
NVMe in production; a host with no shared storage at all, as on another site), over a base
image on the site's storage that it never writes.

The overlays sit in a libvirt `dir` storage pool of each host (`POOL`, at the same path on every
host: the path in a VM's definition holds wherever it runs). Everything here goes through the
host's libvirt connection (volumes, upload and download streams over its TLS), never through
this process's file system: the worker acting on a VM need not be on the host that holds it.

A live migration moves such a disk with the memory (libvirt's non-shared-storage migration,
incremental: only the overlay travels, the base is on both hosts); a stopped VM's disk is
copied host to host; a suspended VM's is kept beside its save on the site's storage.

Its cloud-init seed (read-only, read at every boot) is a volume of the same pool, and goes
wherever the overlay goes: a host of another site has no storage in common with this one's.
A seed is never without its overlay on a host: laid or copied after it, removed before it.
"""

import contextlib
import hashlib
import os
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from xml.sax.saxutils import escape

import libvirt

from .errors import VmmgrError
from .libvirt_errors import translate, translated

POOL = "vmmgr-disks"
POOL_DIR = "/var/lib/libvirt/vmmgr-disks"
CHUNK = 1 << 20

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


def volume_name(vm: str) -> str:
    return f"{vm}.qcow2"


def seed_volume_name(vm: str) -> str:
    return f"{vm}-seed.iso"


def has_pool_seed(domain_xml: str) -> bool:
    """Whether a definition's seed is a volume of its host's pool, to go wherever its disk
    goes (a VM made before seeds were kept there has its seed on its site's storage)."""
    root = ET.fromstring(domain_xml)
    seed = f"{POOL_DIR}/{seed_volume_name(root.findtext('name') or '')}"
    return any(source.get("file") == seed
               for source in root.iterfind("./devices/disk/source"))


def disk_path(vm: str) -> str:
    """Where a VM's local disk is on every host (its definition names this path)."""
    return f"{POOL_DIR}/{volume_name(vm)}"


def is_local(path: str) -> bool:
    return path.startswith(POOL_DIR + "/")


def site_bound(domain_xml: str, storage: Path) -> list[str]:
    """The disks of a definition on its site's storage (a disk on shared storage, a guest's
    hibernation swap, the seed of a local-disk VM made before seeds moved with their disk): a
    VM with any moves and resumes only inside its site, as another site's storage lacks them
    (or holds another VM's of that name). Not a read-only OS image, which a site that lacks
    it receives (`site_images`)."""
    found = []
    for disk in ET.fromstring(domain_xml).iterfind("./devices/disk"):
        source = disk.find("source")
        path = source.get("file") if source is not None else None
        if path and Path(path).is_relative_to(storage) and not (
                disk.find("readonly") is not None and Path(path).is_relative_to(
                    storage / "images")):
            found.append(path)
    return found


def local_disks(domain_xml: str) -> list[str]:
    """The target devices (vda...) of a definition's writable disks on host-local storage: the
    disks a live migration must copy."""
    found = []
    for disk in ET.fromstring(domain_xml).iterfind("./devices/disk"):
        source, target = disk.find("source"), disk.find("target")
        if (source is not None and target is not None and disk.find("readonly") is None
                and is_local(source.get("file") or "")):
            found.append(target.get("dev"))
    return found


def pool_xml() -> str:
    # 0711: QEMU, running as its own user on a production host (libvirt hands it the disk file
    # itself), must get through the directory; only the files' 0600 keeps their data
    return (f"<pool type='dir'><name>{POOL}</name><target><path>{POOL_DIR}</path>"
            "<permissions><mode>0711</mode></permissions></target></pool>")


def overlay_xml(vm: str, capacity: int, base: str) -> str:
    """A qcow2 overlay of `capacity` bytes on the base image at `base` (0600: it is the VM's
    data)."""
    return (f"<volume><name>{escape(volume_name(vm))}</name>"
            f"<capacity unit='bytes'>{int(capacity)}</capacity>"
            "<target><format type='qcow2'/><permissions><mode>0600</mode></permissions></target>"
            f"<backingStore><path>{escape(base)}</path><format type='qcow2'/></backingStore>"
            "</volume>")


def copy_xml(vm: str, size: int, name: str = "") -> str:
    """A volume to receive a byte copy of an overlay (the qcow2 file as it is, backing path
    and all), or of a save image (`name`); written by an upload."""
    return (f"<volume><name>{escape(name or volume_name(vm))}</name>"
            f"<capacity unit='bytes'>{int(size)}</capacity><allocation>0</allocation>"
            "<target><format type='raw'/><permissions><mode>0600</mode></permissions></target>"
            "</volume>")


def ensure_pool(conn: libvirt.virConnect) -> libvirt.virStoragePool:
    """The host's pool, defined, built and started on first use (and started on every boot)."""
    return ensure_dir_pool(conn, POOL, pool_xml(), "the host's disk pool")


def ensure_dir_pool(conn: libvirt.virConnect, name: str, xml: str,
                    what: str) -> libvirt.virStoragePool:
    """A host's `dir` pool `name`, defined (`xml`), built (its folder, and any missing above
    it; one that exists is kept) and started on first use, and on every boot. Two first uses
    at once: the second finds the first's."""
    with translated(what):
        try:
            pool = conn.storagePoolLookupByName(name)
        except libvirt.libvirtError as err:
            if err.get_error_code() != libvirt.VIR_ERR_NO_STORAGE_POOL:
                raise
            try:
                pool = conn.storagePoolDefineXML(xml, 0)
            except libvirt.libvirtError:
                pool = conn.storagePoolLookupByName(name)  # defined meanwhile, or raise
            pool.build(0)
            pool.setAutostart(1)
        if not pool.isActive():
            with contextlib.suppress(libvirt.libvirtError):
                pool.create(0)
            if not pool.isActive():  # not started by someone else meanwhile either
                pool.create(0)
        return pool


def find(conn: libvirt.virConnect, vm: str, name: str = "") -> libvirt.virStorageVol | None:
    """The VM's overlay on this host (`name`: another of its volumes, its seed)."""
    pool, name = ensure_pool(conn), name or volume_name(vm)
    vol = _lookup(pool, name)
    if vol is None:  # a volume a migration made is not in libvirt's list until a refresh
        refresh(pool)
        vol = _lookup(pool, name)
    elif not _exists(vol):  # nor is one it removed gone from it
        refresh(pool)
        vol = _lookup(pool, name)
    return vol


def held(conn: libvirt.virConnect, suffix: str = "") -> set[str]:
    """The VMs with a disk in this host's pool, as libvirt lists them (no pool yet: none);
    with `suffix` ".save", those with a save image sent here."""
    with translated("the host's disk pool"):
        try:
            pool = conn.storagePoolLookupByName(POOL)
        except libvirt.libvirtError as err:
            if err.get_error_code() == libvirt.VIR_ERR_NO_STORAGE_POOL:
                return set()
            raise
        if not pool.isActive():
            return set()
        names = pool.listVolumes()
    suffix = suffix or volume_name("")
    return {n[:-len(suffix)] for n in names if n.endswith(suffix) and len(n) > len(suffix)}


def _lookup(pool: libvirt.virStoragePool, name: str) -> libvirt.virStorageVol | None:
    with translated("a local disk"):
        try:
            return pool.storageVolLookupByName(name)
        except libvirt.libvirtError as err:
            if err.get_error_code() == libvirt.VIR_ERR_NO_STORAGE_VOL:
                return None
            raise


def _exists(vol: libvirt.virStorageVol) -> bool:
    try:
        vol.info()  # stats the file
        return True
    except libvirt.libvirtError:
        return False


def refresh(pool: libvirt.virStoragePool, attempts: int = 20,
            what: str = "the host's disk pool") -> None:
    """libvirt refuses a refresh while a volume of the pool is being built or streamed (a
    reclaim moves several VMs to one host at once): wait for it, briefly."""
    for attempt in range(attempts):
        try:
            pool.refresh(0)
            return
        except libvirt.libvirtError as err:
            if "asynchronous jobs" not in str(err) or attempt == attempts - 1:
                raise translate(err, what) from err
            time.sleep(0.25)


def create_overlay(conn: libvirt.virConnect, vm: str, capacity: int, base: str) -> str:
    """The VM's overlay on `base`; returns its path. One left by a run cut short is replaced."""
    remove(conn, vm)
    with translated(f"{vm}'s local disk"):
        return ensure_pool(conn).createXML(overlay_xml(vm, capacity, base), 0).path()


def overlay_of(conn: libvirt.virConnect, vm: str) -> tuple[int, str]:
    """The capacity and base image path of the VM's overlay on this host."""
    vol = find(conn, vm)
    if vol is None:
        raise VmmgrError(f"{vm} has no local disk on this host")
    with translated(f"{vm}'s local disk"):
        root = ET.fromstring(vol.XMLDesc(0))
    return int(root.findtext("capacity")), root.findtext("./backingStore/path") or ""


def remove(conn: libvirt.virConnect, vm: str) -> bool:
    """Delete the VM's overlay on this host, and its seed first, if there is one; whether
    there was. Refused while the host defines the VM (running, stopped, or arriving): libvirt
    would delete a disk in use, and the one a VM runs on is never removed."""
    _delete(conn, vm, seed_volume_name(vm))
    return _delete(conn, vm)


def _delete(conn: libvirt.virConnect, vm: str, name: str = "") -> bool:
    """Delete one of the VM's volumes here (`name`; "": its overlay), refused where defined."""
    with translated(f"look up {vm}"):
        try:
            conn.lookupByName(vm)
            raise VmmgrError(f"{vm} is defined on this host: its local disk stays")
        except libvirt.libvirtError as err:
            if err.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                raise
    vol = find(conn, vm, name)
    if vol is None:
        return False
    with translated(f"{vm}'s local disk"):
        vol.delete(0)
    return True


def chunks_of(conn: libvirt.virConnect, vol: libvirt.virStorageVol, offset: int = 0,
              length: int = 0, what: str = "reading a local disk",
              chunk: int = 0) -> Iterator[bytes]:
    """The volume's bytes from `offset`, `length` of them (0: to its end), `chunk` (default
    CHUNK) at a time."""
    chunk = chunk or CHUNK
    with translated(what):
        stream = conn.newStream(0)
        try:
            vol.download(stream, offset, length, 0)
            while True:
                data = stream.recv(chunk)
                if data == b"":  # the end (a blocking stream never says -2, "try again")
                    break
                yield data
            stream.finish()
        except BaseException:
            with contextlib.suppress(libvirt.libvirtError):
                stream.abort()
            raise


def _receive(conn: libvirt.virConnect, vm: str, size: int, chunks: Iterator[bytes],
             progress: Progress | None, name: str = "") -> str:
    """Write `chunks` (`size` bytes) into a new volume for the VM's disk (`name`: its seed) on
    this host; returns their SHA-256. Anything short or failed leaves no volume behind. A new
    disk replaces the VM's volumes there (a run cut short left them)."""
    if name:
        _delete(conn, vm, name)
    else:
        remove(conn, vm)
    with translated(f"{vm}'s local disk"):
        vol = ensure_pool(conn).createXML(copy_xml(vm, size, name), 0)
    try:
        return upload(conn, vol, size, chunks, progress, f"{vm}'s {_what(name)}")
    except BaseException:
        _delete(conn, vm, name)
        raise


def _what(name: str) -> str:
    return "seed" if name.endswith(seed_volume_name("")) else "disk"


def upload(conn: libvirt.virConnect, vol: libvirt.virStorageVol, size: int,
           chunks: Iterator[bytes], progress: Progress | None, what: str) -> str:
    """Write `chunks` (`size` bytes in all) into `vol` from its start; their SHA-256. Raises if
    fewer arrived (the caller removes the volume)."""
    digest, done = hashlib.sha256(), 0
    stream = conn.newStream(0)
    try:
        with translated(f"writing {what}"):
            vol.upload(stream, 0, size, 0)
            for data in chunks:
                digest.update(data)
                while data:
                    sent = stream.send(data)
                    data = data[sent:]
                    done += sent
                if progress:
                    progress(done, size)
            stream.finish()
        if done != size:
            raise VmmgrError(f"{what}: {done} of {size} bytes arrived")
    except BaseException:
        with contextlib.suppress(libvirt.libvirtError):
            stream.abort()
        raise
    return digest.hexdigest()


def copy(source: libvirt.virConnect, target: libvirt.virConnect, vm: str,
         progress: Progress | None = None, *, seed: bool) -> str:
    """Copy the VM's disk, then (`seed`: its definition names one in the pool) its seed, from
    one host's pool to another's, byte for byte (each host's libvirtd over its own
    connection); returns the SHA-256 of the disk sent, checked against what the target then
    holds. Nothing is left there if either fails."""
    sent = _copy(source, target, vm, "", progress)
    if seed:
        try:
            copy_seed(source, target, vm)
        except BaseException:
            with contextlib.suppress(VmmgrError):  # (the first error is the one to tell)
                remove(target, vm)
            raise
    return sent


def copy_seed(source: libvirt.virConnect, target: libvirt.virConnect, vm: str) -> None:
    """Copy the VM's seed to the host it moves to, checked on arrival; refused if the source
    has none (the target's QEMU could not start)."""
    _copy(source, target, vm, seed_volume_name(vm))


def _copy(source: libvirt.virConnect, target: libvirt.virConnect, vm: str, name: str,
          progress: Progress | None = None) -> str:
    vol = find(source, vm, name)
    if vol is None:
        raise VmmgrError(f"{vm} has no local {_what(name)} to copy")
    size = size_of(vol)
    with contextlib.closing(chunks_of(source, vol)) as chunks:  # a failed write ends the read
        sent = _receive(target, vm, size, chunks, progress, name)
    held = checksum(target, vm, name)
    if held != sent:
        _delete(target, vm, name)
        raise VmmgrError(f"{vm}'s {_what(name)} arrived damaged (sha256 {held[:12]}, "
                         f"sent {sent[:12]})")
    return sent


def lay_seed(conn: libvirt.virConnect, vm: str, file: Path) -> str:
    """Put the seed made at `file` (on this node) in the host's pool, after the VM's overlay;
    returns its path there."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        _receive(conn, vm, size, iter(lambda: f.read(CHUNK), b""), None, seed_volume_name(vm))
    with translated(f"{vm}'s seed"):
        return find(conn, vm, seed_volume_name(vm)).path()


def save_to(conn: libvirt.virConnect, vm: str, file: Path,
            progress: Progress | None = None, name: str = "") -> str:
    """Write the VM's disk (`name`: another of its volumes) on this host into `file` (on the
    site's storage); its SHA-256."""
    vol = find(conn, vm, name)
    if vol is None:
        raise VmmgrError(f"{vm} has no local {_what(name)} on this host")
    size, digest, done = size_of(vol), hashlib.sha256(), 0
    partial = file.with_name(file.name + ".partial")
    try:
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
                       "wb") as out, contextlib.closing(chunks_of(conn, vol)) as chunks:
            for data in chunks:
                out.write(data)
                digest.update(data)
                done += len(data)
                if progress:
                    progress(done, size)
            out.flush()
            os.fsync(out.fileno())
        if done != size:
            raise VmmgrError(f"{vm}'s disk: {done} of {size} bytes read")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(file)
    return digest.hexdigest()


def load_from(conn: libvirt.virConnect, vm: str, file: Path, expected_sha256: str,
              progress: Progress | None = None, name: str = "") -> None:
    """Put the VM's disk (`name`: another of its volumes) kept in `file` into this host's
    pool; refused (that volume not left) unless what arrived has the SHA-256 recorded when it
    was kept."""
    size = file.stat().st_size

    def chunks() -> Iterator[bytes]:
        with open(file, "rb") as f:
            while data := f.read(CHUNK):
                yield data

    sent = _receive(conn, vm, size, chunks(), progress, name)
    if sent != expected_sha256 or checksum(conn, vm, name) != expected_sha256:
        _delete(conn, vm, name)
        raise VmmgrError(f"{vm}'s kept {_what(name)} {file} does not match its checksum: "
                         "not used")


def image_volume_name(vm: str) -> str:
    """A save image sent to this host from another site's storage, for the resume that restores
    it here (not a disk: `held` does not list it)."""
    return f"{vm}.save"


def receive_image(conn: libvirt.virConnect, vm: str, file: Path,
                  progress: Progress | None = None) -> str:
    """Send the save image `file` (on this node's site storage) into this host's pool; returns
    its path there. Checked as a kept disk is (the SHA-256 of what was sent against what the
    host then holds); anything short, failed or damaged leaves nothing behind."""
    name = image_volume_name(vm)
    size = file.stat().st_size
    remove_image(conn, vm)  # one a resume cut short left
    with translated(f"{vm}'s save image"):
        vol = ensure_pool(conn).createXML(copy_xml(vm, size, name), 0)
    try:
        with open(file, "rb") as f:
            sent = upload(conn, vol, size, iter(lambda: f.read(CHUNK), b""), progress,
                          f"{vm}'s save image")
        held = hashlib.sha256()
        for data in chunks_of(conn, vol, what=f"reading back {vm}'s save image"):
            held.update(data)
        if held.hexdigest() != sent:
            raise VmmgrError(f"{vm}'s save image arrived damaged (sha256 {held.hexdigest()[:12]},"
                             f" sent {sent[:12]})")
        with translated(f"{vm}'s save image"):
            return vol.path()
    except BaseException:
        remove_image(conn, vm)
        raise


def remove_image(conn: libvirt.virConnect, vm: str) -> bool:
    """Delete a save image sent to this host (`receive_image`); whether there was one."""
    with translated(f"{vm}'s save image"):
        try:
            pool = conn.storagePoolLookupByName(POOL)
        except libvirt.libvirtError as err:
            if err.get_error_code() == libvirt.VIR_ERR_NO_STORAGE_POOL:
                return False  # (a host that never held a disk: none was sent)
            raise
        try:
            vol = pool.storageVolLookupByName(image_volume_name(vm))
        except libvirt.libvirtError as err:
            if err.get_error_code() != libvirt.VIR_ERR_NO_STORAGE_VOL:
                raise
            refresh(pool)  # one written by a run this libvirtd has not listed yet
            try:
                vol = pool.storageVolLookupByName(image_volume_name(vm))
            except libvirt.libvirtError as again:
                if again.get_error_code() != libvirt.VIR_ERR_NO_STORAGE_VOL:
                    raise
                return False
        vol.delete(0)
    return True


def checksum(conn: libvirt.virConnect, vm: str, name: str = "") -> str:
    vol = find(conn, vm, name)
    if vol is None:
        raise VmmgrError(f"{vm} has no local {_what(name)} on this host")
    digest = hashlib.sha256()
    for data in chunks_of(conn, vol):
        digest.update(data)
    return digest.hexdigest()


def data_mib(guest) -> float:
    """The MiB a move of this VM copies for its local disk (0: it has none)."""
    if not local_disks(guest.xml()):
        return 0.0
    vol = find(guest.connection(), guest.name)
    return size_of(vol) / 2**20 if vol is not None else 0.0


def size_of(vol: libvirt.virStorageVol) -> int:
    """The volume's file size in bytes (its physical size; a qcow2's capacity is virtual)."""
    with translated("a local disk"):
        return int(ET.fromstring(vol.XMLDesc(0)).findtext("physical"))
