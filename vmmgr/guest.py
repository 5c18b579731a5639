"""A thin wrapper over one libvirt domain on one host."""

import xml.etree.ElementTree as ET
from pathlib import Path

import libvirt

from . import devices
from .errors import NotFound
from .libvirt_errors import translated
from .render import console_path_of, group_of, workload_of

_STATES = {
    libvirt.VIR_DOMAIN_NOSTATE: "nostate",
    libvirt.VIR_DOMAIN_RUNNING: "running",
    libvirt.VIR_DOMAIN_BLOCKED: "running",  # idle vCPUs: running as far as an operator cares
    libvirt.VIR_DOMAIN_PAUSED: "paused",
    libvirt.VIR_DOMAIN_SHUTDOWN: "shutting-down",
    libvirt.VIR_DOMAIN_SHUTOFF: "shutoff",
    libvirt.VIR_DOMAIN_CRASHED: "crashed",
    libvirt.VIR_DOMAIN_PMSUSPENDED: "pmsuspended",
}


def read_each(guests: list["Guest"], read) -> list:
    """`read(g)` for every listed guest that still exists when it is read.

    A listing is a moment: the incoming twin of a migration vanishes when the migration ends or
    is cancelled, and a destroyed VM with it. Such a guest is simply gone, not an error."""
    out = []
    for g in guests:
        try:
            out.append(read(g))
        except NotFound:
            continue
    return out


class Guest:
    def __init__(self, domain: libvirt.virDomain, host_name: str):
        self._dom = domain
        self.host_name = host_name

    def __repr__(self) -> str:
        return f"<Guest {self.name} on {self.host_name}>"

    @property
    def name(self) -> str:
        return self._dom.name()

    @property
    def uuid(self) -> str:
        return self._dom.UUIDString()

    def state(self) -> str:
        with translated(f"state of {self.name}"):
            code, _reason = self._dom.state()
        return _STATES.get(code, "unknown")

    def postcopy_phase(self) -> str | None:
        """'running' or 'failed' while this side is in post-copy, else None."""
        with translated(f"state of {self.name}"):
            code, reason = self._dom.state()
        if code == libvirt.VIR_DOMAIN_PAUSED and reason == libvirt.VIR_DOMAIN_PAUSED_POSTCOPY_FAILED:
            return "failed"
        if (code == libvirt.VIR_DOMAIN_PAUSED and reason == libvirt.VIR_DOMAIN_PAUSED_POSTCOPY) or (
            code == libvirt.VIR_DOMAIN_RUNNING and reason == libvirt.VIR_DOMAIN_RUNNING_POSTCOPY
        ):
            return "running"
        return None

    def cpu_time_ns(self) -> int:
        """The CPU time its QEMU has used (libvirt reads it from /proc: no monitor command, so
        a hung QEMU answers too)."""
        with translated(f"CPU time of {self.name}"):
            return int(self._dom.info()[4])

    def is_active(self) -> bool:
        with translated(f"state of {self.name}"):
            return bool(self._dom.isActive())

    def is_persistent(self) -> bool:
        with translated(f"state of {self.name}"):
            return bool(self._dom.isPersistent())

    def memory_mib(self) -> int:
        with translated(f"memory of {self.name}"):
            return self._dom.maxMemory() // 1024

    def vcpus(self) -> int:
        with translated(f"vCPUs of {self.name}"):
            return self._dom.info()[3]

    def agent_connected(self) -> bool:
        """Whether the guest holds its agent's port open (libvirt's channel state)."""
        root = ET.fromstring(self.xml())
        return any(t.get("name") == "org.qemu.guest_agent.0" and t.get("state") == "connected"
                   for t in root.iterfind("./devices/channel/target"))

    def connection(self) -> libvirt.virConnect:
        """Its host's libvirt connection (for that host's storage: `local_disks`)."""
        return self._dom.connect()

    def xml(self, migratable: bool = False, inactive: bool = False) -> str:
        """The running definition; `inactive`: the persistent one (what a host defines anew);
        `migratable`: without what only this host's libvirt may keep."""
        flags = (libvirt.VIR_DOMAIN_XML_MIGRATABLE if migratable else 0) | (
            libvirt.VIR_DOMAIN_XML_INACTIVE if inactive else 0)
        with translated(f"XML of {self.name}"):
            return self._dom.XMLDesc(flags)

    def console_path(self) -> Path | None:
        return console_path_of(self.xml())

    def workload(self) -> str:
        return workload_of(self.xml())

    def group(self) -> str:
        return group_of(self.xml())

    def device_needs(self) -> tuple[str, int]:
        """(model, count) of the passed-through devices the VM asks for."""
        return devices.wanted(self.xml())

    def live_migratable(self) -> tuple[bool, str]:
        return devices.live_migratable(self.xml())

    def start(self) -> None:
        with translated(f"start {self.name} on {self.host_name}"):
            self._dom.create()

    # The guest's own OS is asked, by its agent where one answers, else by the ACPI power
    # button (libvirt's QEMU driver tries them in that order).
    def shutdown(self) -> None:
        """Ask the guest to shut down; it returns at once (the caller waits for shutoff)."""
        with translated(f"shut down {self.name} on {self.host_name}"):
            self._dom.shutdownFlags(libvirt.VIR_DOMAIN_SHUTDOWN_GUEST_AGENT
                                    | libvirt.VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN)

    def reboot(self) -> None:
        """Ask the guest to reboot (its OS does it: nothing is lost that it would keep)."""
        with translated(f"reboot {self.name} on {self.host_name}"):
            self._dom.reboot(libvirt.VIR_DOMAIN_REBOOT_GUEST_AGENT
                             | libvirt.VIR_DOMAIN_REBOOT_ACPI_POWER_BTN)

    def destroy(self) -> None:
        """Power off at once (no guest shutdown)."""
        with translated(f"destroy {self.name} on {self.host_name}"):
            if self._dom.isActive():
                self._dom.destroy()

    def undefine(self) -> None:
        with translated(f"undefine {self.name} on {self.host_name}"):
            if self._dom.isPersistent():
                self._dom.undefine()

    def job_stats(self, completed: bool = False) -> dict:
        flags = libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED if completed else 0
        with translated(f"job stats of {self.name}"):
            return self._dom.jobStats(flags)

    def start_dirty_rate(self, seconds: int = 1) -> None:
        """Ask QEMU to sample how fast the guest dirties memory (page sampling: no cost to the
        guest); `dirty_rate_mibps` reads the result `seconds` later."""
        with translated(f"dirty rate of {self.name}"):
            self._dom.startDirtyRateCalc(seconds, 0)

    def dirty_rate_mibps(self) -> float | None:
        """The last measured dirty rate, None while it is measuring or was never measured."""
        with translated(f"dirty rate of {self.name}"):
            stats = self._dom.connect().domainListGetStats(
                [self._dom], libvirt.VIR_DOMAIN_STATS_DIRTYRATE)
        values = stats[0][1] if stats else {}
        if values.get("dirtyrate.calc_status") != 2:  # 2: measured
            return None
        return float(values.get("dirtyrate.megabytes_per_second", 0))

    def has_job(self) -> bool:
        """Whether libvirt runs a job on it; a shut-off VM (a stopped one) has none."""
        with translated(f"job of {self.name}"):
            try:
                return self._dom.jobInfo()[0] != libvirt.VIR_DOMAIN_JOB_NONE
            except libvirt.libvirtError:
                if not self._dom.isActive():  # libvirt: "domain is not running"
                    return False
                raise

    def resume(self) -> None:
        with translated(f"resume {self.name}"):
            self._dom.resume()

    def pause(self) -> None:
        with translated(f"pause {self.name}"):
            self._dom.suspend()

    def abort_job(self) -> None:
        with translated(f"abort job of {self.name}"):
            self._dom.abortJob()

    def pause_postcopy(self) -> None:
        """Break this side's post-copy off (QEMU's migrate-pause): a destination whose stream
        went silent (a link that dropped packets, no reset) waits for ever otherwise, and a
        broken post-copy resumes only once both sides know it is broken."""
        with translated(f"pause post-copy of {self.name} on {self.host_name}"):
            self._dom.abortJobFlags(libvirt.VIR_DOMAIN_ABORT_JOB_POSTCOPY)

    # ---- migration (the engine steers; these only carry its orders to libvirt) ----------

    def migrate_to(self, dest_uri: str, params: dict, flags: int,
                   via: libvirt.virConnect | None = None) -> None:
        """libvirt's peer-to-peer migration; blocks until it ends. A failure is raised as
        vmmgr's error (JobAborted when the job was aborted), with libvirt's words in `detail`.
        `via`: another connection to this host to make the call on (`Host.connection_apart`)."""
        with translated(f"migrate {self.name} from {self.host_name}"):
            dom = self._dom if via is None else via.lookupByUUIDString(self.uuid)
            dom.migrateToURI3(dest_uri, params, flags)

    def set_max_downtime(self, ms: int) -> None:
        with translated(f"downtime limit of {self.name}"):
            self._dom.migrateSetMaxDowntime(ms)

    def start_postcopy(self) -> None:
        with translated(f"post-copy of {self.name}"):
            self._dom.migrateStartPostCopy()

    # ---- to and from storage --------------------------------------------------------------

    def save(self, path: Path, via: libvirt.virConnect | None = None) -> None:
        """libvirt's save (a migration into a file); on failure the guest keeps running.
        `via`: another connection to this host to make the call on (`Host.connection_apart`)."""
        with translated(f"save {self.name} on {self.host_name}"):
            dom = self._dom if via is None else via.lookupByUUIDString(self.uuid)
            dom.saveFlags(str(path), None, libvirt.VIR_DOMAIN_SAVE_RUNNING)

    def hibernate(self, agent_timeout: int) -> None:
        """Ask the guest agent for suspend-to-disk (the guest writes its image and powers off).
        libvirt would wait for the agent for ever: `agent_timeout` bounds it."""
        with translated(f"hibernate {self.name} on {self.host_name}"):
            self._dom.agentSetResponseTimeout(agent_timeout, 0)
            self._dom.pMSuspendForDuration(libvirt.VIR_NODE_SUSPEND_TARGET_DISK, 0, 0)
