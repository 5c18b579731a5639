"""A thin wrapper over one host's libvirt connection."""

import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import libvirt

from . import devices
from .devices import Device
from .errors import HostUnreachable, NotFound, VmmgrError
from .guest import Guest, read_each
from .inventory import HostRecord
from .libvirt_errors import translated
from .libvirt_events import ensure_loop

# virsh's own keepalive: a peer silent for 5 s x 6 closes the connection and fails its calls.
KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 5, 6
# libvirt's open has no timeout of its own: a wedged libvirtd (it accepts, answers nothing) would
# hold whoever connects for ever, the reconcile's pass over every host included.
CONNECT_TIMEOUT_S = 30.0


_given_up: dict[str, threading.Thread] = {}  # uri -> an open a caller gave up on, still waiting
_given_up_lock = threading.Lock()


def _open(uri: str, what: str) -> libvirt.virConnect:
    """libvirt.open, given up after CONNECT_TIMEOUT_S (HostUnreachable). Opens in flight run side
    by side (a slow TLS handshake is no reason to refuse a second caller); but while an open
    that was given up on still waits, the next one to that URI is refused at once: one thread and
    one socket per silent daemon, not one per caller. An open that completes late is closed."""
    box: dict = {}

    def run() -> None:
        try:
            conn = libvirt.open(uri)
        except Exception as err:  # noqa: BLE001 - libvirt's or not, handed to the caller
            conn, box["error"] = None, err
        with _given_up_lock:
            if _given_up.get(uri) is threading.current_thread():
                del _given_up[uri]
            if conn is not None and box.get("abandoned"):
                conn.close()
            elif conn is not None:
                box["conn"] = conn

    with _given_up_lock:
        silent = _given_up.get(uri)
        if silent is not None and silent.is_alive():
            raise HostUnreachable(f"cannot connect to {what}: an earlier connection has had "
                                  f"no answer for {CONNECT_TIMEOUT_S:.0f} s or more")
    opener = threading.Thread(target=run, name=f"connect {uri}", daemon=True)
    opener.start()
    opener.join(CONNECT_TIMEOUT_S)
    with _given_up_lock:
        if "conn" in box:
            return box["conn"]
        if "error" in box:
            raise box["error"]
        box["abandoned"] = True
        _given_up[uri] = opener
    raise HostUnreachable(f"cannot connect to {what}: no answer in {CONNECT_TIMEOUT_S:.0f} s")


@dataclass(frozen=True)
class Capacity:
    """What vmmgr may hand out on a host, and what its VMs already hold."""

    memory_mib: int
    vcpus: int
    used_memory_mib: int
    used_vcpus: int
    vms: tuple[str, ...]
    free_devices: tuple[str, ...] = ()  # the model of each free passed-through device

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
        # libvirt takes one lifecycle callback per connection: it fans out to the listeners.
        self._listeners: dict[int, tuple[str, Callable]] = {}
        self._listener_ids = itertools.count()
        self._lifecycle_cb: int | None = None
        self._listen_lock = threading.Lock()
        self._open_lock = threading.Lock()  # one connection per Host, however many threads ask

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
    def connected(self) -> bool:
        return self._conn is not None

    @property
    def conn(self) -> libvirt.virConnect:
        if self._conn is not None and not self._listeners and not self.alive():
            self.close()  # its libvirtd restarted: a long-lived process opens a new connection
        conn = self._conn
        if conn is None:
            with self._open_lock:
                if self._conn is None:
                    self._conn = self._connect()
                conn = self._conn
        return conn

    def _connect(self) -> libvirt.virConnect:
        ensure_loop()  # before the connection opens, or it delivers no events
        with translated(f"connect to host {self.name} ({self.uri})"):
            conn = _open(self.uri, f"host {self.name} ({self.uri})")
        try:  # as virsh does: a peer that stops answering fails the call, not hangs it
            conn.setKeepAlive(KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT)
        except libvirt.libvirtError:
            pass  # a driver without keepalive (a local or test connection)
        return conn

    @contextmanager
    def connection_apart(self) -> Iterator[libvirt.virConnect]:
        """A connection of its own, for one call that lasts long (a migration's): sharing the
        Host's, it can hold up another thread's call on it for KEEPALIVE_INTERVAL_S (libvirt's
        RPC client loses that caller's wake-up until the next keepalive comes in: seen on the
        lab, a poll of the job 5 s late right after a switch to post-copy)."""
        conn = self._connect()
        try:
            yield conn
        finally:
            try:
                conn.close()
            except libvirt.libvirtError:
                pass

    def watch_lifecycle(self, vm: str | None, callback: Callable[..., None]) -> int:
        """Call `callback(event, detail)` on each lifecycle event of `vm` here (of every VM,
        as `callback(name, event, detail)`, when `vm` is None); returns a token for `unwatch`.
        Runs in libvirt's event thread: keep it short."""
        with self._listen_lock:
            if self._lifecycle_cb is None:
                with translated(f"watch events on {self.name}"):
                    self._lifecycle_cb = self.conn.domainEventRegisterAny(
                        None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, self._dispatch, None)
            token = next(self._listener_ids)
            self._listeners[token] = (vm, callback)
            return token

    def unwatch(self, token: int) -> None:
        with self._listen_lock:
            self._listeners.pop(token, None)

    def _dispatch(self, conn, dom, event: int, detail: int, opaque) -> None:
        name = dom.name()
        with self._listen_lock:
            wanted = [cb for vm, cb in self._listeners.values() if vm == name]
            everything = [cb for vm, cb in self._listeners.values() if vm is None]
        for callback in wanted:
            callback(event, detail)
        for callback in everything:
            callback(name, event, detail)

    def alive(self) -> bool:
        """Whether the connection still answers (a restarted libvirtd drops it)."""
        try:
            return self._conn is not None and bool(self._conn.isAlive())
        except libvirt.libvirtError:
            return False

    def close(self) -> None:
        self._lifecycle_cb = None
        self._listeners.clear()
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

    def restore(self, image: Path, xml: str) -> None:
        """Restore a saved guest from `image` with definition `xml`, running; on a connection
        of its own (it lasts seconds, and a reclaim polls other moves on this host meanwhile)."""
        what = f"restore {image} on {self.name}"
        try:
            apart = self.connection_apart()
            conn = apart.__enter__()
        except VmmgrError as err:
            # Not HostUnreachable: nothing was asked of libvirt, so nothing can have been
            # restored, and the caller may undo at once (that error means "it may have").
            raise VmmgrError(f"{what}: not started, no connection of its own ({err})") from err
        try:
            with translated(what):
                conn.restoreFlags(str(image), xml, libvirt.VIR_DOMAIN_SAVE_RUNNING)
        finally:
            apart.__exit__(None, None, None)

    def save_image_xml(self, image: Path) -> str:
        """The definition a save image holds."""
        with translated(f"read save image {image}"):
            return self.conn.saveImageGetXMLDesc(str(image),
                                                 libvirt.VIR_DOMAIN_SAVE_IMAGE_XML_SECURE)

    def capacity(self) -> Capacity:
        with translated(f"host info of {self.name}"):
            _model, memory_mib, cpus, *_ = self.conn.getInfo()
        # An incoming migration's twin counts: its room is taken until the migration ends.
        sizes = read_each(self.guests(), self._size)
        held = {address for s in sizes for address in s.held}
        return Capacity(
            memory_mib=self.record.memory_mib or memory_mib,
            vcpus=self.record.vcpus or cpus,
            used_memory_mib=sum(s.memory_mib for s in sizes),
            used_vcpus=sum(s.vcpus for s in sizes),
            vms=tuple(sorted(s.name for s in sizes)),
            free_devices=tuple(d.model for d in devices.free(self.record.devices, held)),
        )

    def free_devices(self, model: str) -> list[Device]:
        """This host's devices of `model` that no VM defined here holds."""
        held = {a for h in read_each(self.guests(), self._held) for a in h}
        return [d for d in devices.free(self.record.devices, held) if d.model == model]

    def _size(self, g: Guest) -> "_GuestSize":
        return _GuestSize(g.name, g.memory_mib(), g.vcpus(), self._held(g))

    def _held(self, g: Guest) -> list[str]:
        return devices.held(g.xml()) if self.record.devices else []


class _GuestSize(NamedTuple):
    """What one guest takes of its host, read once for `Host.capacity`."""
    name: str
    memory_mib: int
    vcpus: int
    held: list[str]
