"""A base image copied to another site's storage, once, before the first move that needs it.

A local-disk VM's overlay names its base by path (`<images>/os/<name>/disk.qcow2`), so a host
can take the VM only where its own site's storage holds that image at that path. A site that
lacks it receives it host to host, over the two libvirtd's TLS connections (never this
process's file system: the worker need not be on either site), through a storage pool over the
image's folder that lives only for the copy.

The disk goes first and `image.json` last: the record is what makes a copy whole. An image
without it is not listed, a move never lays a disk over it (a copy cut short has a valid qcow2
header over a missing tail), and the next copy makes it again from the start. What was sent
must have the SHA-256 the image was recorded with at its import or build; anything else is
removed. (No read-back: it would come from the target's page cache, and cross the WAN a second
time.) A copy that fails leaves nothing on the target: its files, and the folder if the copy
made it.
"""

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import PurePosixPath
from xml.sax.saxutils import escape

import libvirt
import redis

from . import local_disks
from .errors import Conflict, NotFound, VmmgrError
from .libvirt_errors import translated
from .locks import Lease
from .os_images import DISK, META

COPY_WAIT = 1800.0  # s a move waits for another's copy of its image to the same storage


class NoFolder(VmmgrError):
    """The host's storage has no folder for the image."""


def is_image_disk(base: str) -> bool:
    path = PurePosixPath(base)
    return path.name == DISK and path.parent.parent.name == "os"


def image_name(base: str) -> str:
    """The OS image a base path is the disk of (`<images>/os/<name>/disk.qcow2`)."""
    if not is_image_disk(base):
        raise VmmgrError(f"{base} is not the disk of an OS image: it cannot be sent to a site")
    return PurePosixPath(base).parent.name


def pool_xml(name: str, folder: str) -> str:
    return (f"<pool type='dir'><name>{escape(name)}</name><target><path>{escape(folder)}</path>"
            "<permissions><mode>0755</mode></permissions></target></pool>")


def volume_xml(name: str, size: int) -> str:
    # 0644: an OS image is no secret, and QEMU reads it as its own user on a production host
    return (f"<volume><name>{escape(name)}</name>"
            f"<capacity unit='bytes'>{int(size)}</capacity><allocation>0</allocation>"
            "<target><format type='raw'/><permissions><mode>0644</mode></permissions></target>"
            "</volume>")


@contextlib.contextmanager
def _folder(conn: libvirt.virConnect, base: str, make: bool) -> Iterator[libvirt.virStoragePool]:
    """A pool over the image's folder on this host, for as long as the block runs; only under
    the folder's lock (`_lock`): libvirt allows one pool per path on a host, so one of the same
    name found here was left by a holder that died. `make`: build the folder if the host's
    storage lacks it (libvirt makes any missing folder above it too), and take it away again if
    the block fails (it holds nothing then)."""
    folder = str(PurePosixPath(base).parent)
    name = f"vmmgr-image-{image_name(base)}"
    with translated("the image's folder"):
        with contextlib.suppress(libvirt.libvirtError):  # one a copy cut short left
            stale = conn.storagePoolLookupByName(name)
            if stale.isActive():
                stale.destroy()
            stale.undefine()
        pool = conn.storagePoolDefineXML(pool_xml(name, folder), 0)
    made = False
    try:
        with translated(f"{folder} on this host"):
            try:
                pool.create(0)
            except libvirt.libvirtError as err:
                if not make:
                    raise NoFolder(f"{folder} on this host: {err}") from err
                pool.build(0)  # the folder (and any missing above it)
                made = True
                pool.create(0)
        yield pool
    except BaseException:
        if made:
            with contextlib.suppress(libvirt.libvirtError):
                pool.destroy()
            with contextlib.suppress(libvirt.libvirtError):
                pool.delete(0)  # the folder, empty by now
        raise
    finally:
        with contextlib.suppress(libvirt.libvirtError):
            if pool.isActive():
                pool.destroy()
            pool.undefine()


def _volume(pool: libvirt.virStoragePool, name: str) -> libvirt.virStorageVol | None:
    try:
        return pool.storageVolLookupByName(name)
    except libvirt.libvirtError as err:
        if err.get_error_code() == libvirt.VIR_ERR_NO_STORAGE_VOL:
            return None
        raise


def record(conn: libvirt.virConnect, base: str) -> dict | None:
    """The image's record (`image.json`) on this host's storage when the storage holds it whole:
    its disk, and its record written last; None when it does not. Only under the folder's
    lock. Raises when that cannot be told (a host that does not answer is not one that lacks
    it)."""
    try:
        with _folder(conn, base, make=False) as pool, translated("the image's folder"):
            if _volume(pool, DISK) is None or (meta := _volume(pool, META)) is None:
                return None
            data = b"".join(local_disks.chunks_of(conn, meta))
    except NoFolder:
        return None
    try:
        return dict(json.loads(data))
    except (ValueError, TypeError) as err:
        raise VmmgrError(f"the record of the image at {base} is unreadable") from err


def held(conn: libvirt.virConnect, base: str) -> bool:
    """Whether this host's storage holds the image whole (see `record`)."""
    return record(conn, base) is not None


def ensure(fleet, target: str, base: str, sources: list[str], progress=None,
           say=lambda message: None,
           should_stop: Callable[[], None] = lambda: None) -> tuple[int, str] | None:
    """Make the target host's storage hold the OS image at `base`, sent from the first of
    `sources` that holds it whole, unless the target holds the same image (its record's SHA-256
    that of the source's; a different build under the name is refused, never used). Asked
    under the folder's lock, so a second move that needs it waits for the first one's copy
    (calling `should_stop`, which may raise, while it waits), then finds it there; and each
    time, as a copy cut short leaves a disk no overlay may be laid on. Known in the store from
    the copy's start until it ends well (`sweep`). Returns the size and SHA-256 sent, or None
    if nothing had to be; a base that is no OS image's: None."""
    if not is_image_disk(base):
        return None  # laying the disk says whether the target sees it
    image = image_name(base)
    with _lock(fleet, image, target, f"copy of image {image} to {target}", COPY_WAIT,
               should_stop) as copying:
        dest = fleet.host(target).conn
        there = record(dest, base)
        for source in sources:
            if storage_of(fleet, source) == storage_of(fleet, target):
                continue  # the same storage: the same answer
            # readers wait for each other; a copy to that storage is given up at once
            with _lock_or_none(fleet, image, source, f"read of image {image} on {source}",
                               COPY_WAIT, should_stop, unless_copying=True) as reading:
                if reading is None:
                    continue

                def check() -> None:  # both locks still ours, or nothing more is written
                    copying.check()
                    reading.check()

                check()
                theirs = _record_or_none(fleet, source, base)
                if theirs is None:
                    continue
                if there is not None:
                    if there.get("sha256") != theirs.get("sha256"):
                        raise VmmgrError(
                            f"{target}'s storage holds another image {image} (sha256 "
                            f"{str(there.get('sha256'))[:12]}) than {source}'s (sha256 "
                            f"{str(theirs.get('sha256'))[:12]}): not used")
                    return None
                say(f"{target}'s storage lacks the base image {image}: sending it from {source}")
                fleet.state.image_copy_started(image, target, base)
                sent = send(fleet.host(source).conn, dest, base, progress, check)
                with contextlib.suppress(redis.RedisError):  # the sweep finds it whole, then
                    fleet.state.image_copy_ended(image, target)
                return sent
        if there is not None:
            return None  # no host to compare it with: the target's own stands
        raise VmmgrError(f"no host that answers holds the image {image} whole to send it")


def storage_of(fleet, host: str) -> str:
    """What a host's images are on: its site's storage, shared by the site's hosts (a host of
    no named site: its own)."""
    site = fleet.sites().get(host, "")
    return f"site {site}" if site else f"host {host}"


@contextlib.contextmanager
def _lock(fleet, image: str, host: str, what: str, wait: float,
          should_stop: Callable[[], None] = lambda: None,
          unless_copying: bool = False) -> Iterator[Lease]:
    """The lock over the image's folder on the host's storage, held for every pool made over
    it (a probe, a copy, a sweep). Its owner is this call's alone: two moves of one task (a
    reclaim's threads) must not share it as a nested lease. `unless_copying`: given up at once
    while a copy to that storage holds it (two copies crossing each other would wait on each
    other)."""
    key = f"{image}@{storage_of(fleet, host)}"
    lease = Lease(fleet.state, "image-copy", key, f"{fleet.owner}/{uuid.uuid4().hex[:8]}", what)
    deadline = time.monotonic() + wait
    while True:
        try:
            lease.__enter__()
            break
        except Conflict:
            holder = (fleet.state.holder("image-copy", key) or "").partition(" ")[2]
            if time.monotonic() >= deadline or (unless_copying
                                                and holder.startswith("copy of image")):
                raise
            should_stop()
            time.sleep(0.5)
    try:
        yield lease
    finally:
        lease.__exit__(None, None, None)


@contextlib.contextmanager
def _lock_or_none(fleet, *args, **kwargs) -> Iterator[Lease | None]:
    """`_lock`, or None where it is not to be had: a Conflict raised in the block itself (a
    lease lost) is no refusal of the lock and goes on up."""
    lock = _lock(fleet, *args, **kwargs)
    try:
        lease = lock.__enter__()
    except Conflict:
        yield None
        return
    try:
        yield lease
    finally:
        lock.__exit__(None, None, None)


def holds(fleet, host: str, base: str) -> bool | None:
    """Whether the host's storage holds the image, asked at once under the folder's lock;
    None when that cannot be told now (a copy to it runs, or it does not answer)."""
    image = image_name(base)
    try:
        with _lock(fleet, image, host, f"look for image {image} on {host}", 0):
            return held(fleet.host(host).conn, base)
    except (VmmgrError, redis.RedisError):
        return None


def sweep(fleet, image: str, host: str, base: str) -> bool | None:
    """Remove what a copy to the host cut short left there, and forget the copy, unless a copy
    to that storage runs (None: not now); whether there was something."""
    with _lock_or_none(fleet, image, host, f"sweep of a copy of {image} to {host}",
                       0) as lease:
        if lease is None:
            return None
        lease.check()
        try:
            found = discard_partial(fleet.host(host).conn, base)
        except NotFound:  # the host left the fleet, and its storage with it
            found = False
        lease.check()
        fleet.state.image_copy_ended(image, host)  # under the lock: not a copy begun since
        return found


def _record_or_none(fleet, host: str, base: str) -> dict | None:
    try:
        return record(fleet.host(host).conn, base)
    except VmmgrError:  # a host that left the fleet, or does not answer
        return None


def discard_partial(conn: libvirt.virConnect, base: str) -> bool:
    """Remove what a copy cut short left on this host's storage (the disk, without the record
    that would make it an image); whether there was such a thing."""
    try:
        with _folder(conn, base, make=False) as pool, translated("a copy cut short"):
            vol = _volume(pool, DISK)
            if vol is None or _volume(pool, META) is not None:
                return False
            vol.delete(0)
            return True
    except NoFolder:
        return False


def send(source: libvirt.virConnect, target: libvirt.virConnect, base: str,
         progress: local_disks.Progress | None = None,
         check: Callable[[], None] = lambda: None) -> tuple[int, str]:
    """Copy the image at `base` from the source host's storage to the target host's (under
    both folders' locks, which `check` raises once lost: from then on nothing more is written
    or removed, as another copy may own the folder); returns its size and SHA-256, checked
    against the image's record. An image already whole on the target is never touched."""
    what = f"base image {image_name(base)}"
    with _folder(source, base, make=False) as src:
        with translated(f"reading the {what}"):
            disk, meta_vol = src.storageVolLookupByName(DISK), src.storageVolLookupByName(META)
            meta = b"".join(local_disks.chunks_of(source, meta_vol))
        try:
            recorded = json.loads(meta)["sha256"]
        except (ValueError, KeyError, TypeError) as err:
            raise VmmgrError(f"the {what}'s record is unreadable: not sent") from err
        size = local_disks.size_of(disk)
        with _folder(target, base, make=True) as dst:
            with translated(f"an earlier copy of the {what}"):
                if _volume(dst, META) is not None:
                    return size, recorded  # whole already: never taken away here
                if (old := _volume(dst, DISK)) is not None:
                    check()
                    old.delete(0)  # a copy cut short: made again, from the start
            try:
                def checked(done: int, total: int) -> None:
                    check()
                    if progress:
                        progress(done, total)

                # closed on a failed write: that ends the read on the source too
                with contextlib.closing(local_disks.chunks_of(source, disk)) as chunks:
                    sent = _write(target, dst, DISK, size, chunks, checked, what)
                if sent != recorded:
                    raise VmmgrError(f"the {what} sent does not match its record (sha256 "
                                     f"{sent[:12]}, recorded {recorded[:12]}): the source's "
                                     "copy is damaged")
                check()
                _write(target, dst, META, len(meta), iter([meta]), None, what)
            except BaseException:
                if _still_ours(check):  # else they may be another copy's by now
                    for name in (META, DISK):  # both this copy's own
                        with contextlib.suppress(libvirt.libvirtError):
                            if (vol := _volume(dst, name)) is not None:
                                vol.delete(0)
                raise
    return size, recorded


def _still_ours(check: Callable[[], None]) -> bool:
    try:
        check()
        return True
    except VmmgrError:
        return False


def _write(conn: libvirt.virConnect, pool: libvirt.virStoragePool, name: str, size: int,
           chunks: Iterator[bytes], progress, what: str) -> str:
    """A new volume `name` holding `chunks`; their SHA-256."""
    with translated(f"the {what} on this host"):
        vol = pool.createXML(volume_xml(name, size), 0)
    return local_disks.upload(conn, vol, size, chunks, progress, f"the {what}")
