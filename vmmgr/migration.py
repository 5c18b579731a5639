"""Live migration of one VM between two hosts, steered by a policy.

Peer-to-peer (the source libvirtd drives the destination), persistent on the destination, and the
source definition removed only once the destination runs the VM: if anything fails before that,
libvirt leaves the VM running on the source and we say so. While libvirt's call runs in a thread,
the monitor loop here polls the job stats, asks `policy.decide` what to do, applies it, and hands
each poll's `JobProgress` to the caller. The destination's serial console goes to the next console
segment (see `console`).
"""

import contextlib
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import libvirt
import redis

from . import local_disks, policy as pol, site_consoles, site_images
from .edge import Edge
from .errors import Conflict, JobAborted, MigrationFailed, NotFound, PostcopyPaused, VmmgrError
from .fleet import Fleet, require_active, require_other_host
from .guest import Guest
from .locks import Lease
from .placement import refusal
from .policy import Policy
from .render import address_of, set_console_path
from .spec import validate_name
from .state import stored

BASE_FLAGS = (
    libvirt.VIR_MIGRATE_LIVE
    | libvirt.VIR_MIGRATE_PEER2PEER
    | libvirt.VIR_MIGRATE_PERSIST_DEST
    | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE
)
POSTCOPY_RECOVERY_ATTEMPTS = 5
# A post-copy resume that moves no data for this long is given up (paused again, to be tried
# on the next pass): libvirt's call may wait on a peer that never answers, and a call that never
# returns would hold the VM's lock for ever.
RESUME_STALL_S = 60.0
# How long the monitor waits for a query of the job while the VM is paused for its switch-over:
# a source QEMU stuck sending the rest answers nothing (`pol.decide_unanswered`).
PAUSED_QUERY_S = 2.0
NO_ANSWER = object()


class MigrationCancelled(MigrationFailed):
    """An operator cancelled the migration; the VM runs on the source as before."""


@dataclass(frozen=True)
class JobProgress:
    """A snapshot of a running migration job, built from libvirt's job stats.

    This one record is what every progress report carries: the CLI bar, task state, the web page.
    """

    elapsed_ms: int
    processed_bytes: int
    remaining_bytes: int
    total_bytes: int
    speed_bps: int  # bytes per second on the wire
    dirty_rate_bps: int  # bytes per second the guest dirties
    iteration: int  # pre-copy pass over memory, from 1
    downtime_limit_ms: int | None = None
    throttle_pct: int = 0  # auto-converge's vCPU throttle
    phase: str = "precopy"  # or "base" (a base image sent first), "disk" (local disks), "postcopy"
    warning: str | None = None  # e.g. the guest outpaces the link
    event: str | None = None  # what the engine did at this poll
    disk_processed_bytes: int = 0  # local disks copied so far (libvirt's mirror)
    disk_total_bytes: int = 0

    @classmethod
    def from_stats(cls, stats: dict, downtime_limit_ms: int | None = None, **extra) -> "JobProgress":
        page = stats.get("memory_page_size", 4096)
        return cls(
            elapsed_ms=stats.get("time_elapsed", 0),
            processed_bytes=stats.get("data_processed", 0),
            remaining_bytes=stats.get("data_remaining", 0),
            total_bytes=stats.get("data_total", 0),
            speed_bps=stats.get("memory_bps", 0),
            dirty_rate_bps=stats.get("memory_dirty_rate", 0) * page,
            iteration=stats.get("memory_iteration", 0),
            downtime_limit_ms=downtime_limit_ms,
            throttle_pct=stats.get("auto_converge_throttle", 0),
            disk_processed_bytes=stats.get("disk_processed", 0),
            disk_total_bytes=stats.get("disk_total", 0),
            **extra,
        )

    @property
    def fraction(self) -> float:
        """How much of the first pass is done; later passes only resend dirtied pages. In
        the disk phase: how much of the disks."""
        if self.phase in ("base", "disk"):
            return min(1.0, self.disk_processed_bytes / max(1, self.disk_total_bytes))
        if not self.total_bytes:
            return 0.0
        return min(1.0, max(0.0, 1 - self.remaining_bytes / self.total_bytes))

    def as_dict(self) -> dict:
        return asdict(self) | {"fraction": round(self.fraction, 4)}


@dataclass(frozen=True)
class MigrationResult:
    vm: str
    source: str
    target: str
    total_ms: int  # QEMU's time from start to the guest running on the target
    downtime_ms: int | None  # the blackout (None after post-copy: libvirt does not report it)
    bytes_transferred: int
    memory_iterations: int
    wall_ms: int  # what the caller waited, setup and teardown included
    started_at: float  # unix time
    policy: str = ""
    postcopy: bool = False
    events: tuple[str, ...] = ()
    streams: int = 1  # multifd streams, or the one stream
    link_mibps: float = 0.0  # what QEMU measured on the wire over the copy (0: not reported)
    disk_bytes: int = 0  # local disks copied (in bytes_transferred too)
    base_ms: int = 0  # sending the base image to a site that lacked it first (in wall_ms too)

    @property
    def outside_copy_s(self) -> float:
        """The move's time outside QEMU's copy (setup, switch-over, records): what the next
        move pays again. A base image sent first is not: it is sent once per site, and the
        planner costs it by its size (`deadline.Candidate.base_mib`)."""
        return max(0.0, (self.wall_ms - self.total_ms - self.base_ms) / 1000)

    @classmethod
    def from_completed_stats(
        cls, vm: str, source: str, target: str, stats: dict, wall_ms: int, started_at: float,
        **extra,
    ) -> "MigrationResult":
        return cls(
            vm=vm,
            source=source,
            target=target,
            total_ms=stats.get("time_elapsed", wall_ms),
            downtime_ms=stats.get("downtime"),
            bytes_transferred=stats.get("data_processed", stats.get("memory_processed", 0)),
            memory_iterations=stats.get("memory_iteration", 0),
            wall_ms=wall_ms,
            link_mibps=round(stats.get("memory_bps", 0) / 2**20, 1),
            disk_bytes=stats.get("disk_processed", 0),
            started_at=started_at,
            **extra,
        )

    def as_dict(self) -> dict:
        return asdict(self)


def flags_and_params(policy: Policy) -> tuple[int, dict]:
    """libvirt's migration flags and typed parameters for a policy (apart from the XML)."""
    flags, params = BASE_FLAGS, {}
    if policy.auto_converge:
        flags |= libvirt.VIR_MIGRATE_AUTO_CONVERGE
        params[libvirt.VIR_MIGRATE_PARAM_AUTO_CONVERGE_INITIAL] = policy.auto_converge_initial
        params[libvirt.VIR_MIGRATE_PARAM_AUTO_CONVERGE_INCREMENT] = policy.auto_converge_increment
    if policy.postcopy:
        flags |= libvirt.VIR_MIGRATE_POSTCOPY
    if policy.compression:
        flags |= libvirt.VIR_MIGRATE_COMPRESSED
        params[libvirt.VIR_MIGRATE_PARAM_COMPRESSION] = policy.compression
    if policy.parallel_connections >= 2:
        flags |= libvirt.VIR_MIGRATE_PARALLEL
        params[libvirt.VIR_MIGRATE_PARAM_PARALLEL_CONNECTIONS] = policy.parallel_connections
    if policy.bandwidth_mibps:
        params[libvirt.VIR_MIGRATE_PARAM_BANDWIDTH] = policy.bandwidth_mibps
        if policy.postcopy:
            params[libvirt.VIR_MIGRATE_PARAM_BANDWIDTH_POSTCOPY] = policy.bandwidth_mibps
    return flags, params


def peer_uri(uri: str) -> str:
    """The destination as the source's libvirtd dials it (peer to peer): with the source host's
    own client certificate, so without the `pkipath` that points this process at its own."""
    parts = urlsplit(uri)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "pkipath"]
    return urlunsplit(parts._replace(query=urlencode(query)))


def migrate(
    fleet: Fleet,
    vm: str,
    target: str,
    policy: Policy | None = None,
    on_progress: Callable[[JobProgress], None] | None = None,
    poll_interval: float = 0.2,
) -> MigrationResult:
    """Live-migrate `vm` to host `target`; raises before touching anything on bad input."""
    policy = policy or pol.get_policy(None)
    validate_name(vm)
    dest = fleet.host(target)  # NotFound for an unknown host
    with fleet.lock_vm(vm, f"migration of {vm} to {target}") as lease:
        guest = fleet.locate(vm)
        require_other_host(guest, target)
        require_active(dest)
        if guest.state() != "running":
            raise Conflict(f"VM {vm!r} is {guest.state()}: only a running VM is live-migrated")
        require_live_migratable(guest)
        fleet.require_site_holds(vm, guest.xml(), guest.host_name, target)
        memory_mib = guest.memory_mib()
        reason = refusal(dest.capacity(), memory_mib, guest.vcpus())
        if reason:
            raise Conflict(f"host {target} has no room for {vm}: {reason}")
        lease.check()
        source = guest.host_name
        fitted, why = pol.for_link(policy, _link_mibps(fleet, source, target))
        if fitted.postcopy and local_disks.local_disks(guest.xml()):
            fitted = replace(fitted, postcopy=False)
            why = "; ".join(filter(None, (why, "no post-copy: a local disk's copy must end first")))
        move = _Migration(fleet, guest, target, fitted, on_progress, poll_interval, lease)
        if why:
            move._event(why)
        try:
            result = move.run()
        finally:
            fleet.publish(vm)  # wherever it ended up
        if result.link_mibps and not policy.bandwidth_mibps:  # a capped move says nothing of it
            try:
                fleet.state.set_link_mibps(source, target, result.link_mibps)
                if not result.postcopy:  # a post-copy's time says nothing of a set-up's
                    overhead = result.outside_copy_s
                    fleet.state.learn_move(
                        min(1.0, (result.bytes_transferred - result.disk_bytes) / 2**20
                            / max(1, memory_mib)), overhead)
                    fleet.state.learn_link_overhead(source, target, overhead)
            except redis.RedisError:
                pass  # the next move over the link measures it again
        return result


def _link_mibps(fleet: Fleet, source: str, target: str) -> float | None:
    """What the last move from source to target measured on the wire (None: nothing yet)."""
    try:
        return fleet.state.link_mibps(source, target)
    except redis.RedisError:
        return None


def resume_postcopy(fleet: Fleet, vm: str, source: str, target: str, policy: Policy,
                    on_progress: Callable[[JobProgress], None] | None = None,
                    poll_interval: float = 0.2) -> MigrationResult:
    """Resume a migration left paused in post-copy (`PostcopyPaused`) from `source` to
    `target`; raises PostcopyPaused again while the link is still down."""
    validate_name(vm)
    with fleet.lock_vm(vm, f"post-copy recovery of {vm} to {target}") as lease:
        guest = fleet.host(source).find_guest(vm)
        if guest is None or guest.postcopy_phase() != "failed":
            raise Conflict(f"VM {vm!r} is not paused in a broken post-copy on {source}")
        lease.check()
        try:
            return _Migration(fleet, guest, target, policy, on_progress, poll_interval,
                              lease).resume_postcopy()
        finally:
            fleet.publish(vm)


def adopt(fleet: Fleet, vm: str, target: str, policy: Policy,
          on_progress: Callable[[JobProgress], None] | None = None,
          poll_interval: float = 0.2) -> str | None:
    """A migration of `vm` an earlier run started and left running in libvirt (a worker killed
    mid-migration; libvirt carries on without its client) is steered by `policy` to its end, as
    its own run would have: the same downtime steps, and the same timeouts counted from when the
    job began, not waited out. Returns why the policy aborted it, None if it was not aborted."""
    with fleet.lock_vm(vm, f"migration of {vm} to {target}") as lease:
        guest = fleet.locate(vm)
        if not guest.has_job():
            return None
        return _Migration(fleet, guest, target, policy, on_progress, poll_interval,
                          lease).adopt()


def require_live_migratable(guest) -> None:
    """A VM whose devices cannot be migrated never enters a live migration."""
    live, why = guest.live_migratable()
    if not live:
        raise Conflict(f"VM {guest.name!r} cannot be live-migrated: it {why}. It moves by guest "
                       "hibernation: `vmmgr vm suspend --mode guest`, then `vmmgr vm resume`")


CANCEL_WAIT = 10.0  # s a cancel asked before the job waits for the move to take it


def cancel(fleet: Fleet, vm: str) -> str:
    """Abort the VM's running migration; it keeps running on the source. Returns the source."""
    sources = [g for g in fleet.find_all(vm) if g.is_persistent()]
    if not sources:
        raise NotFound(f"unknown VM {vm!r}")
    source = sources[0]
    if source.postcopy_phase():
        raise Conflict(f"{vm} is in post-copy: it already runs on the destination")
    if source.has_job():
        source.abort_job()
        return source.host_name
    owner, _, what = (fleet.state.holder("vm", vm) or "").partition(" ")
    if what.startswith("migration of "):  # before its job (sending the base image, setting up)
        fleet.state.ask_cancel(vm, owner)
        deadline = time.monotonic() + CANCEL_WAIT
        while time.monotonic() < deadline:  # said cancelled only once the move took it
            if not fleet.state.cancel_pending(vm):
                return source.host_name
            if source.has_job():  # its job began meanwhile: aborted as any other
                fleet.state.drop_cancel(vm)
                source.abort_job()
                return source.host_name
            if (fleet.state.holder("vm", vm) or "").partition(" ")[0] != owner:
                break  # it ended without
            time.sleep(0.1)
        fleet.state.drop_cancel(vm)
    raise Conflict(f"VM {vm!r} has no migration in progress")


class _Migration:
    """One attempt: libvirt's call in a thread, the monitor loop in the caller's."""

    def __init__(self, fleet: Fleet, guest: Guest, target: str, policy: Policy, on_progress,
                 poll_interval: float, lease: Lease):
        self.fleet, self.guest, self.target, self.policy = fleet, guest, target, policy
        self.lease = lease
        self.on_progress, self.poll_interval = on_progress, poll_interval
        self.dest = fleet.host(target)
        self.source = guest.host_name
        self.events: list[str] = []
        self.policy_abort: str | None = None
        self.postcopy_started = False
        self.paused = False
        self.routed = False  # the edge sends the VM's address to the target
        self.routing = threading.Lock()  # the switch-over's events against the call's end
        self.hold_lock = threading.Lock()  # the monitor's hold against the event's release
        self.routing_over = False
        self.hold_edge: Edge | None = None  # an edge that holds the VM's packets (see run())
        self.address: str | None = None
        self.held = False  # its packets are held at the edge now
        self.source_paused = False  # for the switch-over (libvirt's event, or vmmgr's pause)
        self.paused_at: float | None = None  # when vmmgr paused the VM for the switch-over
        self.resumed_at: float | None = None  # when the target said it runs
        self.last_stats: dict = {}
        self.fast_polls = False  # a hold is on or near: poll every pol.HOLD_POLL_S
        self.hold_failed = False
        self.progress_lost = False
        self.disks: list[str] = []  # local disks, copied with the memory (set by run())
        self.base_ms = 0  # spent sending the disk's base image to the target's site first
        self.query: threading.Thread | None = None  # a job query left waiting (`_query_within`)

    def _flags_and_params(self, segment) -> tuple[int, dict]:
        guest = self.guest
        flags, params = flags_and_params(self.policy)
        if self.dest.record.tls:  # a host set up for TLS refuses a migration without it
            flags |= libvirt.VIR_MIGRATE_TLS
        live_xml = guest.xml(migratable=True)
        if self._lab_storage_disks(live_xml):
            flags |= libvirt.VIR_MIGRATE_UNSAFE
        if self.disks:  # only the overlay travels: its base image is on both sites' storage
            flags |= libvirt.VIR_MIGRATE_NON_SHARED_INC
            params[libvirt.VIR_MIGRATE_PARAM_MIGRATE_DISKS] = self.disks
            if flags & libvirt.VIR_MIGRATE_TLS:
                # The name the disk's NBD connection checks the target's certificate for:
                # libvirt 9.0 leaves it unset with multifd, and QEMU then refuses the target.
                params[libvirt.VIR_MIGRATE_PARAM_TLS_DESTINATION] = urlsplit(
                    self.dest.uri).hostname
        params[libvirt.VIR_MIGRATE_PARAM_DEST_XML] = set_console_path(live_xml, segment)
        params[libvirt.VIR_MIGRATE_PARAM_PERSIST_XML] = set_console_path(
            guest.xml(inactive=True, migratable=True), segment)
        return flags, params

    def _lab_storage_disks(self, xml: str) -> bool:
        """Whether this is a lab move of a VM with disks on the fleet's storage. libvirt 9.0
        calls a file disk safe to live-migrate only on a filesystem it knows is shared (NFS,
        GFS2, Ceph...), which is what production's storage is. The lab's storage is one
        directory of one machine that every lab host sees, and libvirt cannot tell: it refuses
        "Migration without shared storage is unsafe". There (only), vmmgr vouches for it;
        the disks use cache='none', which is what libvirt asks of shared disks."""
        if not (self.dest.record.lab and self.fleet.host(self.source).record.lab):
            return False
        storage = str(self.fleet.paths.storage.resolve())
        return any((src.get("file") or "").startswith(storage + "/")
                   for src in ET.fromstring(xml).iterfind("./devices/disk/source"))

    def run(self) -> MigrationResult:
        guest = self.guest
        segment = site_consoles.new_segment(self.fleet, guest.name, self.target)
        persistent = guest.xml(inactive=True, migratable=True)
        self.disks = local_disks.local_disks(persistent)
        flags, params = self._flags_and_params(segment)

        # The first downtime limit is set before the job starts. A libvirt call that steers a
        # migration made during its setup phase waits for the whole job to end (seen in the lab:
        # a deadlock, as only this monitor would end it); so nothing is steered until the job
        # reports data, and this one setting is made while there is no job at all.
        address = self.address = address_of(persistent)
        self.hold_edge = self._edge_that_holds(address)
        watch, actions = pol.start(self.policy, time.monotonic(), can_hold=bool(self.hold_edge))
        for action in actions:
            self._apply(action)
        started_at, t0 = time.time(), time.monotonic()
        if self.disks:
            try:
                self._lay_target_disk()
            except BaseException:  # refused or cancelled before the target's QEMU started
                site_consoles.drop_if_empty(self.fleet, guest.name, segment)
                raise
        watches = self._follow_switchover(address)
        try:
            try:  # a cancel asked before the job had begun ends the move as one of the job would
                error = (JobAborted("cancelled before its job began") if self._cancel_asked()
                         else self._migrate(params, flags, watch))
            finally:
                for host, token in watches:
                    host.unwatch(token)
                with self.routing:
                    self.routing_over = True  # an event still in flight routes nothing now
            wall_ms = int((time.monotonic() - t0) * 1000)
            if self.disks:
                self.tidy_disks()
            if error is not None:
                if self.routed:  # routed to the target at the switch-over, then it failed
                    try:
                        self.fleet.route_address(address, self.source)
                    except Exception as err:  # the VM must still be resumed (_fail)
                        self._event(f"could not route {address} back to {self.source}: {err}")
                self._release("to the source")  # what waits there reaches it once resumed
                self._fail(error, segment)
            if address and not self.routed:  # no event came, or routing failed then: now
                self._event("routing the address after the fact")
                stored(lambda: self.fleet.route_address(address, self.target))
            return self._result(started_at, wall_ms)
        finally:  # if the resume's event never came, or whatever went wrong: never left held
            self._release("as the move ended")

    def _edge_that_holds(self, address: str | None) -> Edge | None:
        """The edge, if it can hold this VM's packets through the switch-over."""
        if not address:
            return None
        try:
            edge = Edge.load(self.fleet.paths, self.fleet.state)
        except (OSError, ValueError, KeyError, TypeError) as err:
            self._event(f"the edge's description is unreadable ({err}): no hold")
            return None
        return edge if edge is not None and edge.can_hold else None

    def _hold(self, reason: str) -> str | None:
        """Queue what comes for the VM at the edge from now until `_release`: its switch-over
        is near, and nothing may reach its source once it pauses there. Hold and release
        take turns (`hold_lock`): the monitor holds, the target's event may release."""
        with self.hold_lock:
            if self.held or self.source_paused or self.routing_over:
                return None
            try:
                self.hold_edge.hold(self.address)
            except VmmgrError as err:
                self.hold_failed = True  # QEMU chooses the moment from now on, as without
                try:
                    self.hold_edge.release(self.address)  # in case it was made all the same
                except VmmgrError:
                    self.held = True  # may be: released by the move's end, or the reconcile
                return self._event(f"could not hold {self.address} at the edge: {_words(err)}")
            self.held = True
        return self._event(f"packets for {self.address} held at the edge: {reason}")

    def _switch_over(self, reason: str) -> str | None:
        """Pause the VM, its packets held: QEMU sends the rest and starts it on the target."""
        if self.source_paused or not self.held:
            return None  # QEMU paused it already, or the hold failed: QEMU chooses
        before = time.monotonic()
        self.guest.pause()
        self.paused_at, self.paused = before, True
        self._paused_for_switchover()
        return self._event(f"VM paused on {self.source} for the switch-over: {reason}")

    def _paused_for_switchover(self) -> None:
        self.source_paused = True
        if self.address:
            self._route_to_target(self.address, "as the source paused for the switch-over")

    def _release(self, where: str) -> None:
        """Let what the edge held for the VM go, to wherever its address is routed now. A
        release that fails is tried again by the next call (the move's end calls it in any
        case), then by the reconcile once no one holds the VM's lock."""
        with self.hold_lock:
            if not self.held:
                return
            try:
                self.hold_edge.release(self.address)
            except VmmgrError as err:
                self._event(f"could not release {self.address} at the edge: {_words(err)}")
                return
            self.held = False
        self._event(f"packets held for {self.address} released {where}")

    def resume_postcopy(self) -> MigrationResult:
        """Resume the post-copy this VM was left paused in (`PostcopyPaused`), now that the
        link may be back: the same migration, its flags and the policy it started with."""
        guest = self.guest
        self.postcopy_started = True
        segment = site_consoles.current_segment(self.fleet, guest.name, self.target)
        flags, params = self._flags_and_params(segment)
        address = address_of(guest.xml(inactive=True))  # now: the source is gone once it ends
        started_at, t0 = time.time(), time.monotonic()
        self._event("resuming the post-copy left paused")
        error = self._break_off_destination() or self._migrate(
            params, flags | libvirt.VIR_MIGRATE_POSTCOPY_RESUME,
            pol.Watch(started=time.monotonic(), postcopy=True), first=False)
        wall_ms = int((time.monotonic() - t0) * 1000)
        if error is not None:
            self._fail(error, segment)
        if address:  # it runs on the target now (it already did, paused, before the link broke)
            stored(lambda: self.fleet.route_address(address, self.target))
        return self._result(started_at, wall_ms)

    def _lay_target_disk(self) -> None:
        """The target's overlay, empty, on the same base at the same path: libvirt mirrors the
        source's into it (`NON_SHARED_INC`) before the memory moves. A target whose site's
        storage lacks the base receives it first, once."""
        source = self.fleet.host(self.source)
        capacity, base = local_disks.overlay_of(source.conn, self.guest.name)
        t0 = time.monotonic()
        if self._send_base(base):
            self.base_ms = int((time.monotonic() - t0) * 1000)
            self._cancelled_yet("once its base image was sent")
        self._lay(capacity, base)
        self._send_seed()
        self._event(f"local disk laid on {self.target} (over {base})")

    def _send_seed(self) -> None:
        """The seed, read-only, is not mirrored by libvirt: the target's QEMU opens its own
        copy. Sent after the overlay; on failure the overlay is taken away again."""
        vm = self.guest.name
        if not local_disks.has_pool_seed(self.guest.xml(inactive=True)):
            return  # on its site's storage (a VM made before seeds were kept in the pool)
        try:
            local_disks.copy_seed(self.fleet.host(self.source).conn, self.dest.conn, vm)
        except VmmgrError as err:
            with contextlib.suppress(VmmgrError):
                local_disks.remove(self.dest.conn, vm)
            raise MigrationFailed(
                f"{self._not_started()}: {self.target} could not receive its seed "
                f"({_words(err)}); the VM is still running on {self.source}") from err

    def _lay(self, capacity: int, base: str) -> None:
        try:
            local_disks.create_overlay(self.dest.conn, self.guest.name, capacity, base)
        except VmmgrError as err:  # e.g. a site that lacks the base image
            raise MigrationFailed(
                f"{self._not_started()}: {self.target} cannot lay the local disk over its base "
                f"image {base} ({_words(err)}); the VM is still running on {self.source}") from err

    def _send_base(self, base: str) -> bool:
        """Copy the base image to the target's storage unless it holds it whole (asked each
        time: a copy cut short leaves a disk no overlay may be laid on); whether it was sent.
        Refused, with nothing left on the target, if it cannot receive it: no room, no write
        access, a damaged source."""
        started, last = time.monotonic(), [0.0]

        def progress(done: int, size: int) -> None:
            self.lease.check()  # a long copy stops when the VM's lock is lost
            now = time.monotonic()
            if now - last[0] < 0.5 and done < size:
                return
            last[0] = now
            self._cancelled_yet(f"while {self.target} received its base image")
            if self.on_progress:
                self._report(JobProgress(
                    elapsed_ms=int((now - started) * 1000), processed_bytes=done,
                    remaining_bytes=size - done, total_bytes=size,
                    speed_bps=int(done / max(now - started, 1e-3)), dirty_rate_bps=0,
                    iteration=0, phase="base", disk_processed_bytes=done,
                    disk_total_bytes=size))

        try:
            sent = site_images.ensure(
                self.fleet, self.target, base, [self.source], progress, self._event,
                lambda: self._cancelled_yet(f"while waiting for {self.target} to receive "
                                            "its base image"))
        except MigrationCancelled:
            raise
        except (VmmgrError, redis.RedisError) as err:
            raise MigrationFailed(
                f"{self._not_started()}: {self.target} lacks the base image {base} and could "
                f"not receive it ({_words(err)}); the VM is still running on {self.source}"
            ) from err
        if sent is None:
            return False
        self._event(f"base image {site_images.image_name(base)} sent to {self.target}: "
                    f"{sent[0] / 2**20:.0f} MiB in {time.monotonic() - started:.1f} s, sha256 "
                    f"{sent[1][:12]} as recorded")
        return True

    def _cancelled_yet(self, when: str) -> None:
        """A cancel asked before the move's libvirt job (`cancel`) ends it here, where nothing
        has moved."""
        if self._cancel_asked():
            raise MigrationCancelled(
                f"migration of {self.guest.name} from {self.source} to {self.target} was "
                f"cancelled {when}; the VM is still running on {self.source}")

    def _cancel_asked(self) -> bool:
        """Whether a cancel was asked of this move (`cancel`, when it had no job to abort);
        taken if so, which tells the cancel it was."""
        try:
            return self.fleet.state.cancel_asked(self.guest.name, self.lease.owner)
        except redis.RedisError:
            return False  # nor can one be asked then

    def _not_started(self) -> str:
        return f"migration of {self.guest.name} from {self.source} to {self.target} not started"

    def tidy_disks(self) -> None:
        """A local disk stays only where the VM is now defined: the target's after a move,
        the source's after a failed or cancelled one (`Fleet.tidy_local_disks`: nothing is
        removed while that cannot be told)."""
        try:
            for host in self.fleet.tidy_local_disks(self.guest.name):
                self._event(f"local disk removed from {host}")
        except VmmgrError as err:
            self._event(f"local disks left as they are: {_words(err)}")

    def _follow_switchover(self, address: str | None) -> list:
        """Note the source's pause for the switch-over (`pol.decide_paused` watches it end).
        Move the VM's address at the edge the moment the source pauses for the switch-over
        (libvirt's lifecycle event, not a poll after the fact), or at the latest when the VM
        resumes on the target. From the pause on, what the edge sends the VM waits on the
        target, whose route to the VM is in place from libvirt's prepare, in the kernel's queue
        for the VM's neighbour entry and then the tap (QEMU reads neither while the VM is
        paused), and reaches the VM the moment it resumes; what the VM sends on resuming is
        let in at the edge at once. Routed only at the resume, both waited for the route
        change, and what came in meanwhile was lost at the paused source (bench/stall.py).
        With an edge that holds (`_switch_over`), vmmgr pauses the VM itself and routes at
        once; the events then only note the resume, which releases what the edge held.
        Returns the (host, token) of each watch."""
        def at_source(event: int, detail: int) -> None:
            if (event == libvirt.VIR_DOMAIN_EVENT_SUSPENDED
                    and detail == libvirt.VIR_DOMAIN_EVENT_SUSPENDED_MIGRATED):
                self._paused_for_switchover()

        def at_target(event: int, detail: int) -> None:
            if event == libvirt.VIR_DOMAIN_EVENT_RESUMED:
                self.resumed_at = self.resumed_at or time.monotonic()
                if address is None:
                    return
                self._route_to_target(address, "at resume")
                if self.routed and not self.routing_over:  # else run() routes, then releases
                    self._release("to the target at resume")

        source = self.fleet.host(self.source)
        return [(source, source.watch_lifecycle(self.guest.name, at_source)),
                (self.dest, self.dest.watch_lifecycle(self.guest.name, at_target))]

    def _route_to_target(self, address: str, why: str) -> None:
        with self.routing:
            if self.routed or self.routing_over:
                return
            try:
                self.fleet.route_address(address, self.target)
                self.routed = True
                self._event(f"address {address} routed to {self.target} {why}")
            except Exception as err:  # e.g. the store is away: routed once the VM has moved
                self._event(f"could not route {address} to {self.target} {why}: {err}")

    def _migrate(self, params: dict, flags: int, watch: pol.Watch,
                 first: bool = True) -> Exception | None:
        error = self._call_and_monitor(params, flags, watch)
        attempts = 0 if first else POSTCOPY_RECOVERY_ATTEMPTS  # a later try is one call
        while (error is not None and self._in_postcopy()
               and attempts < POSTCOPY_RECOVERY_ATTEMPTS):
            # The link broke during post-copy: the VM's memory is split between the hosts, so the
            # only way forward is to resume the same migration once the link is back.
            attempts += 1
            self._event(f"post-copy interrupted ({_words(error)}); recovery attempt {attempts}")
            time.sleep(min(2 ** attempts, 10))
            error = self._break_off_destination() or self._call_and_monitor(
                params, flags | libvirt.VIR_MIGRATE_POSTCOPY_RESUME,
                pol.Watch(started=time.monotonic(), postcopy=True))
        return error

    def _in_postcopy(self) -> bool:
        """Whether the source is in post-copy now: asked for is not switched to (QEMU switches
        at the end of a pass), and a migration cut before the switch is an ordinary failure,
        the VM running on its source."""
        if not self.postcopy_started:
            return False
        try:
            return self.guest.postcopy_phase() is not None
        except VmmgrError:
            return True  # the source does not answer: assume the worst, keep the VM's memory

    def _break_off_destination(self) -> Exception | None:
        """Before a post-copy is resumed both sides must know it broke. A destination that never
        saw the stream fail (its packets were dropped, no reset came) still waits in post-copy:
        pause it, as `virsh domjobabort --postcopy` on that host does. Returns why the resume
        must wait, if it must: asked while the destination still waits, libvirt's prepare there
        hangs holding the domain (seen on the lab), and nothing resumes it after. (libvirt 9.0
        reports the destination "running (post-copy)" whether or not its QEMU saw the break, so
        the pause is asked for whenever it says so.)"""
        try:
            there = self.dest.find_guest(self.guest.name)
            if there is None:
                return MigrationFailed(f"{self.guest.name} is gone from {self.target}")
            if there.postcopy_phase() == "running":
                there.pause_postcopy()
            return None
        except VmmgrError as err:
            self._event(f"the post-copy on {self.target} could not be paused: {_words(err)}")
            return err

    def _result(self, started_at: float, wall_ms: int) -> MigrationResult:
        guest = self.guest
        arrived = self.dest.find_guest(guest.name)
        if arrived is None:
            raise MigrationFailed(f"{guest.name} is not on {self.target} after libvirt reported success")
        if arrived.state() == "paused" and self.paused:
            arrived.resume()  # we paused it to force completion; it must run on the target
            self.resumed_at = self.resumed_at or time.monotonic()
        completed = arrived.job_stats(completed=True)
        if completed.get("type", libvirt.VIR_DOMAIN_JOB_NONE) == libvirt.VIR_DOMAIN_JOB_NONE:
            # After post-copy the destination keeps no completed job: use the last numbers seen.
            completed = {k: v for k, v in self.last_stats.items() if k != "downtime"}
        disk = self.last_stats.get("disk_processed", 0) if self.disks else 0
        if disk and not completed.get("disk_processed"):
            # The target's stats know nothing of the disk's mirror; the source's last poll does.
            completed = completed | {"disk_processed": disk, "data_processed": completed.get(
                "data_processed", completed.get("memory_processed", 0)) + disk}
        if self.paused_at is not None and self.resumed_at is not None:
            # QEMU counts its downtime from its own final stop; the VM stopped at vmmgr's pause.
            blackout = round((self.resumed_at - self.paused_at) * 1000)
            self._event(f"blackout {blackout} ms from vmmgr's pause to the resume on "
                        f"{self.target} (QEMU's own count: {completed.get('downtime')} ms)")
            completed = completed | {"downtime": blackout}
        return MigrationResult.from_completed_stats(
            guest.name, self.source, self.target, completed, wall_ms,
            started_at, policy=self.policy.name, postcopy=self.postcopy_started,
            events=tuple(self.events), streams=max(1, self.policy.parallel_connections),
            base_ms=self.base_ms,
        )

    def _call_and_monitor(self, params: dict, flags: int, watch: pol.Watch) -> Exception | None:
        outcome: dict = {}
        self.query = None  # one an earlier call left waiting answers for that call
        resuming = bool(flags & libvirt.VIR_MIGRATE_POSTCOPY_RESUME)
        moved, moved_at = None, time.monotonic()

        def call() -> None:
            try:
                with self.fleet.host(self.source).connection_apart() as via:
                    self.guest.migrate_to(peer_uri(self.dest.uri), params, flags, via=via)
            except Exception as err:  # anything but a return is a failure, never a success
                outcome["error"] = err

        worker = threading.Thread(target=call, name=f"migrate-{self.guest.name}", daemon=True)
        worker.start()

        def running() -> bool:
            nonlocal moved, moved_at
            worker.join(pol.HOLD_POLL_S if self.fast_polls else self.poll_interval)
            if not worker.is_alive() or not resuming:
                return worker.is_alive()
            stats = _active_job_stats(self.guest) or {}
            now = (stats.get("data_total"), stats.get("data_remaining"))
            if now != moved:
                moved, moved_at = now, time.monotonic()
            elif time.monotonic() - moved_at > RESUME_STALL_S:
                self._give_up_resume(worker, outcome)
                return False
            return True

        self._monitor(running, watch)
        return outcome.get("error")

    def _give_up_resume(self, worker: threading.Thread, outcome: dict) -> None:
        """A resume that moved nothing for RESUME_STALL_S: pause the source's side again (its
        call then returns with its own error), so the VM is as it was before the try, and the
        lock is free for the next. A call libvirt still does not return is left behind, in its
        daemon thread, and the attempt fails."""
        self._event(f"the post-copy resume moved nothing in {RESUME_STALL_S:.0f} s: giving it up")
        try:
            self.guest.pause_postcopy()
        except VmmgrError as err:
            self._event(f"could not pause the source's post-copy: {_words(err)}")
        worker.join(15)
        if not worker.is_alive():
            return  # it ended meanwhile (even with success): its own outcome stands
        self._event("libvirt's resume call did not return: left behind")
        outcome["error"] = MigrationFailed(
            f"the post-copy resume moved no data in {RESUME_STALL_S:.0f} s")

    def adopt(self) -> str | None:
        """Steer a migration job an earlier run left running in libvirt (its monitor died with
        that run) until it ends, by this policy, its clock started when the job did. Returns
        why the policy aborted it, if it did."""
        stats = _active_job_stats(self.guest) or {}
        elapsed = stats.get("time_elapsed", 0) / 1000
        watch, _ = pol.start(self.policy, time.monotonic() - elapsed)
        self._event(f"steering the migration an earlier run left running ({elapsed:.0f} s in)")
        if stats.get("data_total"):  # past setup (see run()): the earlier run may have held
            self._apply(pol.SetDowntime(watch.downtime_ms))  # QEMU's limit back (HOLD_BACK_MS)
        address = self.address = address_of(self.guest.xml(inactive=True))
        edge = self._edge_that_holds(address)
        if edge is not None:  # what the earlier run held goes where the address points now
            try:
                edge.release(address)
            except VmmgrError as err:
                self._event(f"could not release {address} at the edge: {_words(err)}")
        local = local_disks.local_disks(self.guest.xml(inactive=True))  # gone from here after
        # Paused for its switch-over by the earlier run (or by QEMU): its end is watched.
        self.source_paused = self.guest.state() == "paused" and not self.guest.postcopy_phase()

        def running() -> bool:  # a source stuck sending answers nothing: the job runs on
            time.sleep(self.poll_interval)
            return self._query_within(PAUSED_QUERY_S) is not None

        self._monitor(running, watch)
        if local:
            self.tidy_disks()
        return self.policy_abort

    def _monitor(self, running, watch: pol.Watch) -> None:
        """Poll the job while `running()`: apply the policy's decisions, report progress."""
        while running():
            if watch.gave_up_at is not None:  # its call must still return (`after_giving_up`)
                if self.lease.lost:
                    continue  # another holder may act on the VM: nothing more from here
                watch, actions = pol.after_giving_up(watch, time.monotonic())
                self._report_event("; ".join(filter(None, [self._back_to_source()] + [
                    self._apply(a) for a in actions])), watch)
                continue
            paused = (self.source_paused or self.paused) and not (
                self.postcopy_started and self._in_postcopy())
            stats = self._query_within(PAUSED_QUERY_S) if paused else _active_job_stats(self.guest)
            if stats is NO_ANSWER:
                if self.lease.lost:
                    continue  # another holder may act on the VM: nothing more from here
                watch, actions = pol.decide_unanswered(watch, time.monotonic(),
                                                       self._target_cpu_ns())
                self._report_event("; ".join(filter(None, (self._apply(a) for a in actions))),
                                   watch)
                continue
            if watch.unanswered_since is not None:  # it answers (or failed): not stuck
                watch = replace(watch, unanswered_since=None)
            if not stats:
                continue
            self.last_stats = stats
            now = time.monotonic()
            actions = []
            if self.lease.lost and not self.postcopy_started and not self.policy_abort:
                # Another holder may act on this VM now: give the VM back to its source.
                actions = [pol.Abort("the VM's lock was lost")]
            elif pol.in_disk_phase(stats):
                watch, actions = pol.decide_disk(self.policy, watch, now)
            elif stats.get("data_total"):  # past setup: see run()
                seen = JobProgress.from_stats(stats)
                memory_left = stats.get("memory_remaining", seen.remaining_bytes)
                if paused:
                    watch, actions = pol.decide_paused(watch, seen.processed_bytes, now)
                    self.fast_polls = False
                else:
                    watch, actions = pol.decide(self.policy, watch, seen.remaining_bytes,
                                                seen.iteration, now, seen.dirty_rate_bps,
                                                seen.speed_bps, memory_left)
                    self.fast_polls = pol.polls_fast(watch, memory_left, seen.speed_bps,
                                                     self.poll_interval, now)
            event = "; ".join(filter(None, (self._apply(a) for a in actions))) or None
            if self.hold_failed and watch.can_hold:  # QEMU chooses the moment, as without
                watch = replace(watch, can_hold=False, holding_since=None)
                self._apply(pol.SetDowntime(watch.downtime_ms))
            if (any(isinstance(a, pol.SwitchOver) for a in actions) and not self.paused
                    and not self.source_paused):  # vmmgr's pause failed: the VM runs on,
                self._apply(pol.SetDowntime(pol.HOLD_BACK_MS))  # its hold given up as any
                watch = replace(watch, finished=False,
                                release_at=now + pol.QEMU_LIMIT_LAG_S)
            if self.on_progress:
                phase = ("postcopy" if self.postcopy_started else
                         "disk" if pol.in_disk_phase(stats) else "precopy")
                progress = JobProgress.from_stats(stats, watch.downtime_ms, phase=phase,
                                                  event=event)
                warning = pol.warning(progress.dirty_rate_bps, progress.speed_bps,
                                      self.policy.auto_converge)
                self._report(replace(progress, warning=warning))

    def _report_event(self, event: str, watch: pol.Watch) -> None:
        """An event of a poll with no job stats of its own: reported with the last ones."""
        if event and self.on_progress and self.last_stats:
            self._report(JobProgress.from_stats(self.last_stats, watch.downtime_ms,
                                                phase="precopy", event=event))

    def _report(self, progress: JobProgress) -> None:
        """Progress is for the watchers: its store being away (a Redis outage) must not stop
        the monitor, which alone steers and ends the migration."""
        try:
            self.on_progress(progress)
            self.progress_lost = False
        except Exception as err:  # whatever the reporter's store raises
            if not self.progress_lost:
                self._event(f"progress not reported ({type(err).__name__}: {err}); "
                            "the migration goes on")
            self.progress_lost = True

    def _apply(self, action) -> str | None:
        guest = self.guest
        try:
            if isinstance(action, pol.SetDowntime):
                guest.set_max_downtime(action.ms)
                return f"downtime limit {action.ms} ms"
            if isinstance(action, pol.Hold):
                return self._hold(action.reason)
            if isinstance(action, pol.Release):
                if self.source_paused:
                    return None  # it did switch over: released when the target runs
                self._release("to the source, still running")
                return self._event(f"hold given up: {action.reason}")
            if isinstance(action, pol.SwitchOver):
                return self._switch_over(action.reason)
            if isinstance(action, pol.StartPostCopy):
                guest.start_postcopy()
                self.postcopy_started = True
                return self._event(f"switched to post-copy: {action.reason}")
            if isinstance(action, pol.Abort):
                self.policy_abort = action.reason
                guest.abort_job()
                return self._event(f"aborting: {action.reason}")
            if isinstance(action, pol.DropTarget):
                return self._drop_target(action.reason, action.stuck)
            if isinstance(action, pol.Pause):
                guest.pause()
                self.paused = True
                return self._event(f"paused the guest to finish: {action.reason}")
        except VmmgrError as err:
            # The job may have ended between the poll and the action; the call's result decides.
            return self._event(f"could not apply {type(action).__name__}: {_words(err)}")
        return None

    def _back_to_source(self) -> str | None:
        """Once a given-up switch-over has the VM running on its source again (libvirt resumes
        it at the abort), its address and what the edge held for it go back there at once, not
        when libvirt's call returns (`after_giving_up`: some 20 s with a hung target)."""
        try:
            if self.routing_over or not self.address or not _is_active(self.guest) or (
                    self.guest.state() != "running"):
                return None
        except VmmgrError:
            return None  # the source does not say (gone, or its libvirtd away): not yet
        with self.routing:
            self.routing_over = True  # the target's events route nothing from now on
            try:  # whoever routed it to the target (this run, at the pause, or an earlier one)
                self.fleet.route_address(self.address, self.source)
                self.routed = False
            except Exception as err:  # run() tries again once the call returns, the reconcile after
                self._event(f"could not route {self.address} back to {self.source}: {err}")
        self._release("to the source, running again")
        return self._event(f"the VM runs on {self.source} again: its address goes back there")

    def _target_cpu_ns(self) -> int | None:
        try:
            there = self.dest.find_guest(self.guest.name)
            return there.cpu_time_ns() if there is not None else None
        except VmmgrError:
            return None

    def _source_job_ended(self) -> bool:
        """Whether libvirt reports the source's job cancelled or failed (QEMU's stream broken
        off), though its call has not returned: it then finishes the move cancelled and never
        starts the target's copy (libvirt's qemu_migration.c: a Perform that failed calls Finish
        with cancelled=1, and only a Finish that succeeds starts the target's vCPUs)."""
        stats = self._query_within(PAUSED_QUERY_S)
        return isinstance(stats, dict) and stats.get("type") in (
            libvirt.VIR_DOMAIN_JOB_CANCELLED, libvirt.VIR_DOMAIN_JOB_FAILED)

    def _query_within(self, seconds: float):
        """The job's stats, or NO_ANSWER if libvirt's query does not return within `seconds`
        (it is left to return in its daemon thread; no other is asked meanwhile)."""
        if self.query is None:
            answer: dict = {}

            def ask() -> None:
                answer["stats"] = _active_job_stats(self.guest)

            self.query = threading.Thread(target=ask, daemon=True,
                                          name=f"query-{self.guest.name}")
            self.query.answer = answer
            self.query.start()
        self.query.join(seconds)
        if self.query.is_alive():
            return NO_ANSWER
        stats, self.query = self.query.answer.get("stats"), None
        return stats

    def _drop_target(self, reason: str, stuck: bool = False) -> str | None:
        """Destroy the target's copy of a move given up at its switch-over, so that libvirt's
        call returns: what libvirt says to do with an incoming migration ("cannot abort
        incoming migration; use virDomainDestroy instead"). Only where libvirt will never
        start that copy:
        - the source runs the VM again: libvirt resumed it at the abort and finishes the move
          cancelled;
        - the source's job reports the move cancelled or failed (`_source_job_ended`), the VM
          paused while libvirt waits for the hung target to answer its Finish;
        - the source is `stuck` sending the rest (`pol.decide_unanswered`): its target cannot
          have the VM whole (checked once more last of all: the query still waits).
        Otherwise a source still paused may have sent the VM whole: its target may yet load it
        and start it, and a copy destroyed in that moment would take the VM with it, its source
        undefined. That one waits for the target, tried again every `pol.ABORT_GRACE_S`."""
        if not _is_active(self.guest):
            return self._event(f"the copy on {self.target} kept: {self.source} does not hold "
                               f"the VM ({reason})")
        state = self.guest.state()
        if state == "paused" and self.guest.postcopy_phase() is not None:
            return self._event(f"the copy on {self.target} kept: the source is in post-copy, "
                               f"its memory split between the hosts ({reason})")
        if state == "running" or (state == "paused" and stuck):
            why = reason
        elif state == "paused" and self._source_job_ended():
            why = f"{reason}; libvirt reports the move ended on {self.source}"
        else:
            return self._event(f"the copy on {self.target} kept: the VM, sent whole, is still "
                               f"{state} on {self.source}, and {self.target} may yet start it "
                               f"({reason})")
        there = self.dest.find_guest(self.guest.name)
        if there is None or not there.is_active():
            return self._event(f"no copy left on {self.target} ({reason})")
        if there.state() == "running" or there.postcopy_phase() is not None:
            return self._event(f"the copy on {self.target} kept: it runs, or holds part of the "
                               f"VM ({reason})")
        if stuck and state == "paused" and (self.query is None or not self.query.is_alive()):
            return None  # the source answers again: its numbers decide
        try:
            there.destroy()
        except NotFound:
            pass  # gone as it died: libvirt drops a transient incoming domain then
        return self._event(f"the copy on {self.target}, never run, destroyed: {why}")

    def _ended_on_source(self, segment) -> bool:
        """Whether the move surely ended with no copy that will ever write `segment`: the source
        runs the VM with no migration job (a call that failed on our side of the connection
        does not stop a peer-to-peer migration), and the target holds no definition that
        points at the segment (libvirt keeps the one it persisted before a late failure: it
        could be started later). What cannot be told keeps the segment."""
        try:
            if not self.guest.is_active() or self.guest.job_stats().get(
                    "type", libvirt.VIR_DOMAIN_JOB_NONE) != libvirt.VIR_DOMAIN_JOB_NONE:
                return False
            found = self.dest.find_guest(self.guest.name)
            return found is None or found.console_path() != Path(segment)
        except VmmgrError:
            return False

    def _event(self, text: str) -> str:
        self.events.append(text)
        return text

    def _fail(self, error: Exception, segment) -> None:
        in_postcopy = self._in_postcopy()
        if self.paused and _is_active(self.guest) and self.guest.state() == "paused":
            self.guest.resume()  # a pause we ordered must not outlive the attempt
        if not in_postcopy and self._ended_on_source(segment):  # in post-copy it writes there
            site_consoles.drop_if_empty(self.fleet, self.guest.name, segment)
        where = "still running on" if _is_active(self.guest) else "NOT running on"
        what = f"migration of {self.guest.name} from {self.source} to {self.target}"
        tail = f"the VM is {where} {self.source}"
        if in_postcopy:
            raise PostcopyPaused(
                f"{what} broke in post-copy and could not be resumed ({_words(error)}); its memory is split between the hosts, so "
                f"it stays paused on both until the link is back and the migration is resumed "
                f"(the reconcile tries again)", self.source, self.target)
        if self.policy_abort:
            raise MigrationFailed(f"{what} aborted by policy {self.policy.name}: {self.policy_abort}; {tail}")
        if isinstance(error, JobAborted):
            raise MigrationCancelled(f"{what} was cancelled; {tail}")
        raise MigrationFailed(f"{what} failed: {_words(error)}; {tail}")


def _words(error: Exception) -> str:
    """What went wrong, in the hypervisor's own words where it gave any."""
    return getattr(error, "detail", "") or f"{type(error).__name__}: {error}"


def _active_job_stats(guest: Guest) -> dict | None:
    try:
        stats = guest.job_stats()
    except VmmgrError:
        return None  # the domain just left the source
    return stats if stats.get("type", libvirt.VIR_DOMAIN_JOB_NONE) != libvirt.VIR_DOMAIN_JOB_NONE else None


def _is_active(guest: Guest) -> bool:
    try:
        return guest.is_active()
    except VmmgrError:
        return False

