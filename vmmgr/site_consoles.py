"""Consoles on storage that sites keep apart: segments numbered in the fleet's store, their
files read and removed through the libvirt of a host that sees them.

A segment's file is on the storage of the host whose QEMU writes it: its site's, which every
host of the site sees at the same path (a fleet that names no site has one storage). So the
store says which segments a VM has and which host wrote each; the bytes come from that host, or
from another host of its site when it does not answer. Each host has one `dir` pool over its
consoles folder (`POOL`, defined on first use and started on every boot, as `local_disks`'s):
readers share it, and nothing here goes through this process's file system, so the CLI and the
web console need no storage of their own.
"""

import time
from collections.abc import Iterator
from pathlib import Path
from xml.sax.saxutils import escape

import libvirt
import redis

from . import local_disks
from .console import CHUNK, Segment, parse
from .errors import HostUnreachable, VmmgrError
from .libvirt_errors import translated
from .locks import HOUSEKEEPING
from .render import console_path_of

POOL = "vmmgr-consoles"


def pool_xml(folder: Path) -> str:
    return (f"<pool type='dir'><name>{POOL}</name><target><path>{escape(str(folder))}</path>"
            "<permissions><mode>0755</mode></permissions></target></pool>")


def ensure_pool(conn: libvirt.virConnect, folder: Path) -> libvirt.virStoragePool:
    """The host's consoles pool over `folder` (made if its storage lacks it)."""
    return local_disks.ensure_dir_pool(conn, POOL, pool_xml(folder), "the host's consoles folder")


def _volume(pool: libvirt.virStoragePool, name: str, fresh: bool = False
            ) -> libvirt.virStorageVol | None:
    """The segment's volume, or None where its file does not exist. A file QEMU made since
    the pool was last looked at is not in libvirt's list until a refresh (`fresh`: refresh
    first, to know it is not there)."""
    if fresh:
        local_disks.refresh(pool, what="the host's consoles folder")
    try:
        vol = pool.storageVolLookupByName(name)
    except libvirt.libvirtError as err:
        if err.get_error_code() != libvirt.VIR_ERR_NO_STORAGE_VOL:
            raise
        return None if fresh else _volume(pool, name, fresh=True)
    try:
        vol.info()  # stats the file: one removed since stays listed until a refresh
        return vol
    except libvirt.libvirtError:
        return None if fresh else _volume(pool, name, fresh=True)


class FleetConsoles:
    """The consoles of a fleet's VMs, wherever their segments are (`console.Consoles`). Keeps
    the volumes it found, and for a second what it found missing (a move aborted before its
    QEMU made the file: a follower would otherwise rescan the folder at every poll)."""

    MISSING_FOR = 1.0  # s
    # Bytes asked of libvirt at once: its client queues a stream's data as it arrives, however
    # slowly it is read, so a window bounds what a slow reader holds.
    WINDOW = 16 * CHUNK

    def __init__(self, fleet):
        self.fleet = fleet
        self._vols: dict[str, libvirt.virStorageVol] = {}
        self._missing: dict[str, float] = {}

    def segments(self, vm: str) -> list[Segment]:
        return [Segment(seq, vm, host) for seq, host in self.fleet.state.console_segments(vm)]

    def size(self, segment: Segment, fresh: bool = False) -> int:
        if fresh:
            self._missing.pop(segment.name, None)
        vol = self._volume(segment)
        if vol is None:
            return 0
        try:
            # the file's own size: a capacity would be what a guest-written header claims
            return int(vol.infoFlags(libvirt.VIR_STORAGE_VOL_GET_PHYSICAL)[2])
        except libvirt.libvirtError:
            self._vols.pop(segment.name, None)  # removed, or its host went: looked up anew
            vol = self._volume(segment)
            with translated(f"the console of {segment.vm}"):
                return int(vol.infoFlags(libvirt.VIR_STORAGE_VOL_GET_PHYSICAL)[2]) if vol else 0

    def chunks(self, segment: Segment, offset: int = 0, limit: int = 0) -> Iterator[bytes]:
        """Window by window, each one download (`WINDOW`), to the end or `limit`."""
        left = limit  # 0: no limit
        while True:
            want = min(left, self.WINDOW) if limit else self.WINDOW
            got = 0
            for data in self._window(segment, offset, want):
                got += len(data)
                offset += len(data)
                yield data
            if limit:
                left -= got
                if left <= 0:
                    return
            if got < want:  # its end, as it is now
                return

    def _window(self, segment: Segment, offset: int, length: int) -> Iterator[bytes]:
        cached = segment.name in self._vols
        vol = self._volume(segment)
        if vol is None:
            return
        got = 0
        try:
            for data in local_disks.chunks_of(vol.connect(), vol, offset, length,
                                              f"the console of {segment.vm}", CHUNK):
                got += len(data)
                yield data
        except VmmgrError:
            self._vols.pop(segment.name, None)
            if not cached or got:
                raise
            # A handle kept from a connection that broke since (its libvirtd restarted, the
            # file removed): looked up once more, through whichever host answers now.
            yield from self._window(segment, offset, length)

    def _volume(self, segment: Segment) -> libvirt.virStorageVol | None:
        """The segment's volume through the first host that sees its writer's storage and
        answers; None where that storage has no such file. HostUnreachable only when no such
        host answers; any other failure is said as it is."""
        if segment.name in self._vols:
            return self._vols[segment.name]
        if self._missing.get(segment.name, 0) > time.monotonic():
            return None
        silent, failure = [], None
        for host in readers(self.fleet, segment.host):
            try:
                with translated(f"the console of {segment.vm} on {host}"):
                    pool = ensure_pool(self.fleet.host(host).conn, self.fleet.paths.consoles)
                    vol = _volume(pool, segment.name)
            except HostUnreachable as err:
                silent.append(str(err))
                continue
            except VmmgrError as err:
                failure = failure or err
                continue
            if vol is None:
                self._missing[segment.name] = time.monotonic() + self.MISSING_FOR
            else:
                self._vols[segment.name] = vol
            return vol
        if failure is not None:
            raise failure
        raise HostUnreachable(f"no host that sees {segment.host}'s storage answers: its part "
                              f"of {segment.vm}'s console cannot be read now "
                              f"({'; '.join(silent) or 'no such host'})")


def readers(fleet, writer: str) -> list[str]:
    """The hosts that see what `writer` wrote to its storage, the writer first: its site's
    (a fleet that names no site shares one storage)."""
    sites = fleet.sites()
    if writer not in sites:  # it left the fleet: any host may share its storage
        return sorted(sites)
    return [writer] + sorted(h for h, s in sites.items() if s == sites[writer] and h != writer)


def new_segment(fleet, vm: str, host: str) -> Path:
    """A fresh segment of the VM's console for `host`'s QEMU, numbered in the store after every
    earlier one, on the host's storage (its consoles folder made there if it has none)."""
    with translated(f"the consoles folder of {host}"):
        pool = ensure_pool(fleet.host(host).conn, fleet.paths.consoles)
        while True:
            segment = Segment(fleet.state.next_console_number(vm), vm, host)
            if _volume(pool, segment.name, fresh=True) is None:
                break
            # A file by that name already (a count the store lost): never appended to, nor
            # ever shown as this VM's (recorded only once the name is known to be free).
    fleet.state.add_console_segment(vm, segment.seq, host)
    return fleet.paths.consoles / segment.name


def current_segment(fleet, vm: str, host: str) -> Path:
    """The newest segment `host` writes for `vm` (a migration resumed after a break goes on with
    the destination's QEMU, which already writes there); a fresh one if it has none."""
    mine = [seq for seq, h in fleet.state.console_segments(vm) if h == host]
    if mine:
        return fleet.paths.consoles / Segment(mine[-1], vm, host).name
    return new_segment(fleet, vm, host)


def drop_if_empty(fleet, vm: str, path: Path) -> None:
    """A move that failed before its guest ran on the target leaves the segment it made there:
    its file is removed if it holds nothing, and its number forgotten. One that holds output
    stays (readers pass an empty segment); one that no host of its site can tell about now is
    left to the reconcile (`retry_drops`). Best effort, for a failure's own handling: it never
    raises."""
    segment = parse(path.name)
    if segment is None or segment.vm != vm:
        return
    try:
        _give_back(fleet, segment)
    except Exception:  # noqa: BLE001 - the move's own error is what its caller reports
        try:
            fleet.state.console_drop_pending(vm, segment.seq)
        except Exception:  # noqa: BLE001 - (the store gone too: a numbered empty part stays)
            pass


def _give_back(fleet, segment: Segment) -> bool:
    """Remove the segment's file through a host of its site and forget its number, if it holds
    nothing (True); False where it holds output. Raises where no host of its site can tell."""
    consoles = FleetConsoles(fleet)
    vol = consoles._volume(segment)
    if vol is not None:
        if consoles.size(segment) > 0:
            return False
        with translated(f"the console of {segment.vm}"):
            vol.delete(0)
    fleet.state.forget_console_segments(segment.vm, [segment.seq])
    return True


def retry_drops(fleet, report) -> list[str]:
    """The reconcile's retry of the segments failed moves could not give back (their site did
    not answer): each, under its VM's lock, given back if it is empty and no host of its site
    defines the VM writing to it (running or at its next boot; no other site's QEMU can write
    that file). Nothing is decided while a host of its site does not answer, and the lock is
    taken only once they all have: a silent host holds the mark, never the VM. A mark is
    cleared only once decided. Returns the segments given back."""
    try:
        marked = fleet.state.console_drops()
    except redis.RedisError:
        return []  # the store away: the next pass
    dropped = []
    for vm, seq in marked:
        try:
            host = dict(fleet.state.console_segments(vm)).get(seq)
            if host is not None:
                _in_use(fleet, Segment(seq, vm, host))  # every host of its site answers
            with fleet.lock_vm(vm, f"{HOUSEKEEPING}drop of a part of {vm}'s console"):
                host = dict(fleet.state.console_segments(vm)).get(seq)
                segment = Segment(seq, vm, host or "")
                given = (host is not None and not _in_use(fleet, segment)
                         and _give_back(fleet, segment))
                fleet.state.console_drop_done(vm, seq)  # destroyed since, in use, or decided
        except (VmmgrError, redis.RedisError):
            continue  # the VM held, or a host (or the store) silent: the next pass
        except Exception as err:  # noqa: BLE001 - one VM's surprise must not end the pass
            report.event(f"{vm}: a part of its console not given back: {err}", vm=vm,
                         kind="error")
            continue
        if given:
            report.event(f"{vm}: the empty console part {segment.name} a failed move left "
                         "is given back", vm=vm, kind="repair")
            dropped.append(segment.name)
    return dropped


def _in_use(fleet, segment: Segment) -> bool:
    """Whether a copy of the VM on a host that shares the segment's storage writes to it;
    HostUnreachable where one of those hosts does not answer (it may)."""
    guests = fleet.find_all(segment.vm, strict=True, among=readers(fleet, segment.host))
    return any(_writes_to(g, segment.name) for g in guests)


def _writes_to(guest, name: str) -> bool:
    """Whether the guest's console is the segment `name`, now or at its next boot."""
    xmls = [guest.xml()] + ([guest.xml(inactive=True)] if guest.is_persistent() else [])
    return any((p := console_path_of(x)) is not None and p.name == name for x in xmls)


def remove(fleet, vm: str) -> bool:
    """Remove the VM's console: each segment's file through a host that sees it, and every
    number from the store. A file on a storage no host answers for stays there, never read
    again nor appended to (the count goes on); whether every file is gone."""
    known = fleet.state.console_segments(vm)
    consoles, whole = FleetConsoles(fleet), True
    for seq, host in known:
        segment = Segment(seq, vm, host)
        try:
            vol = consoles._volume(segment)
            if vol is not None:
                with translated(f"the console of {vm}"):
                    vol.delete(0)
        except VmmgrError:
            whole = False
    fleet.state.forget_console_segments(vm, [seq for seq, _ in known])
    return whole
