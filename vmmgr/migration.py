"""Live pre-copy migration of one VM between two hosts.

Peer-to-peer (the source libvirtd drives the destination), persistent on the destination, and the
source definition removed only once the destination runs the VM: if anything fails before that,
libvirt leaves the VM running on the source and we say so. The destination's serial console goes to
the next console segment (see `console`).
"""

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import libvirt

from . import console
from .errors import Conflict, MigrationFailed, VmmgrError
from .fleet import Fleet, require_other_host
from .guest import Guest
from .libvirt_errors import translated
from .locks import vm_operation
from .placement import refusal
from .render import set_console_path
from .spec import validate_name

FLAGS = (
    libvirt.VIR_MIGRATE_LIVE
    | libvirt.VIR_MIGRATE_PEER2PEER
    | libvirt.VIR_MIGRATE_PERSIST_DEST
    | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE
)


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

    @classmethod
    def from_stats(cls, stats: dict, downtime_limit_ms: int | None = None) -> "JobProgress":
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
        )

    @property
    def fraction(self) -> float:
        """How much of the first pass is done; later passes only resend dirtied pages."""
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
    downtime_ms: int  # the blackout: the guest paused on the source until it runs on the target
    bytes_transferred: int
    memory_iterations: int
    wall_ms: int  # what the caller waited, setup and teardown included
    started_at: float  # unix time

    @classmethod
    def from_completed_stats(
        cls, vm: str, source: str, target: str, stats: dict, wall_ms: int, started_at: float
    ) -> "MigrationResult":
        return cls(
            vm=vm,
            source=source,
            target=target,
            total_ms=stats.get("time_elapsed", wall_ms),
            downtime_ms=stats.get("downtime", 0),
            bytes_transferred=stats.get("data_processed", stats.get("memory_processed", 0)),
            memory_iterations=stats.get("memory_iteration", 0),
            wall_ms=wall_ms,
            started_at=started_at,
        )

    def as_dict(self) -> dict:
        return asdict(self)


def migrate(
    fleet: Fleet,
    vm: str,
    target: str,
    on_progress: Callable[[JobProgress], None] | None = None,
    poll_interval: float = 0.2,
) -> MigrationResult:
    """Live-migrate `vm` to host `target`; raises before touching anything on bad input."""
    validate_name(vm)
    dest = fleet.host(target)  # NotFound for an unknown host
    with vm_operation(fleet.paths.locks, vm, f"migration to {target}"):
        guest = fleet.locate(vm)
        require_other_host(guest, target)
        if guest.state() != "running":
            raise Conflict(f"VM {vm!r} is {guest.state()}: only a running VM is live-migrated")
        reason = refusal(dest.capacity(), guest.memory_mib(), guest.vcpus())
        if reason:
            raise Conflict(f"host {target} has no room for {vm}: {reason}")
        return _run(fleet, guest, target, on_progress, poll_interval)


def _run(fleet: Fleet, guest: Guest, target: str, on_progress, poll_interval) -> MigrationResult:
    dest = fleet.host(target)
    source = guest.host_name
    segment = console.next_segment(fleet.paths.consoles, guest.name, target)
    with translated(f"XML of {guest.name}"):
        persistent = guest.domain.XMLDesc(
            libvirt.VIR_DOMAIN_XML_INACTIVE | libvirt.VIR_DOMAIN_XML_MIGRATABLE
        )
    params = {
        libvirt.VIR_MIGRATE_PARAM_DEST_XML: set_console_path(guest.xml(migratable=True), segment),
        libvirt.VIR_MIGRATE_PARAM_PERSIST_XML: set_console_path(persistent, segment),
    }
    with translated(f"downtime limit of {guest.name}"):
        downtime_limit = guest.domain.migrateGetMaxDowntime()

    outcome: dict = {}

    def call() -> None:
        try:
            guest.domain.migrateToURI3(dest.uri, params, FLAGS)
        except libvirt.libvirtError as err:
            outcome["error"] = err

    started_at, t0 = time.time(), time.monotonic()
    worker = threading.Thread(target=call, name=f"migrate-{guest.name}", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(poll_interval)
        if on_progress and worker.is_alive():
            stats = _active_job_stats(guest)
            if stats:
                on_progress(JobProgress.from_stats(stats, downtime_limit))
    wall_ms = int((time.monotonic() - t0) * 1000)

    if "error" in outcome:
        _drop_if_empty(segment)
        where = "still running on" if _is_active(guest) else "NOT running on"
        raise MigrationFailed(
            f"migration of {guest.name} from {source} to {target} failed: "
            f"{outcome['error'].get_error_message()}; the VM is {where} {source}"
        )
    arrived = dest.find_guest(guest.name)
    if arrived is None:
        raise MigrationFailed(f"{guest.name} is not on {target} after a migration libvirt reported done")
    return MigrationResult.from_completed_stats(
        guest.name, source, target, arrived.job_stats(completed=True), wall_ms, started_at
    )


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


def _drop_if_empty(segment) -> None:
    try:
        if segment.stat().st_size == 0:
            segment.unlink()
    except FileNotFoundError:
        pass
