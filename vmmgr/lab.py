"""The local lab: several hosts on one machine.

A host is a network namespace with its own mount and UTS namespaces and its own libvirtd (own
config, state, run, log and cache directories, host UUID and hostname), reachable from the root
namespace over TCP on an inter-host bridge. Every host also gets a guest bridge with the same
gateway address and MAC, and sees the same storage directory at the same path (the root file
system is shared; only libvirt's directories are bind-mounted per host). Its libvirtd runs under
a reaper (`lab_reaper`) that reaps the exited QEMUs at once, as a real host's systemd does.

Everything the lab makes is named with the `vmmgr-` prefix, so `down` finds and removes it even
after a crashed run that left no state behind. The unauthenticated TCP settings below exist only
here, never in the production path.
"""

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

import libvirt

from . import console
from .errors import VmmgrError
from .images import BuiltinImage, ensure_builtin
from . import libvirt_errors  # noqa: F401  (keeps libvirt from printing errors we handle)
from .devices import Device
from .inventory import HostRecord, Inventory
from .state import FleetState
from .lab_net import LabNetwork, hook_script
from .lab_wan import WAN_DEV, Wan, latency, shaping, site_names
from .lab_pki import LabPKI, render_role_template
from .lab_services import SITE_FOLDERS, Services
from .paths import Paths
from .qemu_defects import tcg_migration_warning
from .workloads import BASE_CMDLINE

PREFIX = "vmmgr-"
BRIDGE = "vmmgr-br0"
SUBNET = "10.77.0"
BRIDGE_CIDR = f"{SUBNET}.1/24"
GUEST_BRIDGE = "br-guest"
GUEST_GATEWAY_CIDR = "10.78.0.1/32"  # guests are /32s routed to the bridge (see lab_net)
GUEST_GATEWAY_MAC = "02:76:6d:00:00:01"
# The management network's MACs are fixed, as a real machine's NIC's is: a host rebuilt with a
# new random one was unreachable from every namespace that had cached the old one, for as long
# as that entry stayed valid (15-45 s) and then until the next retry of TCP's connect (31 or
# 63 s after the first SYN): a repaired host's libvirtd "not answering" for a minute or two.
BRIDGE_MAC = "02:76:6d:01:00:00"  # else the bridge takes its lowest port's, which come and go
HOST_MAC_PREFIX = "02:76:6d:01:00:"  # + the host's index (host_mac)
# What a TCP socket on a host may hold unsent (the kvm_host role sets the same). A migration's
# last bytes, sent with the VM paused, queue behind whatever its stream wrote before: with the
# default (no limit) that is up to its whole send buffer, 4 MiB, which a 100 Mbit/s WAN takes
# 0.3 s to drain. At 128 KiB the blackout there fell from 208-253 to 81-88 ms (bench-sites).
TCP_NOTSENT_LOWAT = 131072
# A stream across sites keeps the WAN's bandwidth-delay product in flight (5 MB at 40 ms and
# 1 Gbit/s, 10 MB at 80 ms). The kernel's default send buffer (4 MiB, about half of it data)
# held one stream near 540 Mbit/s at 40 ms: 32 MiB for both buffers, as the kvm_host role sets.
TCP_BUFFERS = {"net.ipv4.tcp_rmem": "4096 131072 33554432",
               "net.ipv4.tcp_wmem": "4096 16384 33554432"}
# The congestion control a host's TCP uses, as the kvm_host role sets it: a lab host would
# otherwise take the machine's (a namespace starts with the root's), which need not be what a
# real host runs. BBR keeps a WAN's rate under random loss, where cubic's falls with it.
CONGESTION_CONTROL = "bbr"
HOST_SYSCTLS = {"net.ipv4.tcp_notsent_lowat": str(TCP_NOTSENT_LOWAT), **TCP_BUFFERS,
                "net.ipv4.tcp_congestion_control": CONGESTION_CONTROL}
HOST_MEMORY_MIB = 1024  # what each lab host offers VMs: small, so "no room" is easy to reach
HOST_VCPUS = 8  # vCPUs may be overcommitted; memory (above) never is
LIBVIRT_DIRS = {  # per-host folder -> the path libvirtd sees
    "etc": "/etc/libvirt",
    "run": "/run/libvirt",
    "lib": "/var/lib/libvirt",
    "log": "/var/log/libvirt",
    "cache": "/var/cache/libvirt",
}
EMULATOR = "/usr/bin/qemu-system-x86_64"
NWFILTERS = "/etc/libvirt/nwfilter"  # libvirt-daemon-config-nwfilter's filter definitions
CAPS = "qemu/capabilities"  # libvirtd's probe of QEMU, 15-25 s on first start: shared between hosts
FIRST_START_TIMEOUT = 30  # a start takes about 1 s; the first probe of QEMU up to 25 s
READY_TIMEOUT = 90


# The lab's stand-in GPUs: one on each of the first two hosts, none on the rest, so that a GPU VM
# has somewhere to go and a second one, at times, nowhere (see devices.py for the stand-in).
LAB_GPU_MODEL = "lab-gpu"


def lab_devices(index: int) -> tuple[Device, ...]:
    return (Device("0000:65:00.0", LAB_GPU_MODEL, "standin"),) if index < 2 else ()


def host_mac(index: int) -> str:
    """Lab host `index`'s NIC on the management network."""
    return f"{HOST_MAC_PREFIX}{index:02x}"


@dataclass(frozen=True)
class LabHost:
    name: str
    index: int

    @property
    def namespace(self) -> str:
        return f"{PREFIX}{self.name}"

    @property
    def ip(self) -> str:
        return f"{SUBNET}.{10 + self.index}"

    def uri(self, pki: Path | None) -> str:
        """TLS with the control node's client certificate from `pki` (libvirt's `pkipath`), or
        the lab's plain TCP when `pki` is None."""
        if pki is None:
            return f"qemu+tcp://{self.ip}/system"
        return f"qemu+tls://{self.ip}/system?pkipath={pki}"

    @property
    def uuid(self) -> str:
        # Distinct per host: libvirt refuses to migrate to a host with its own UUID.
        return str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{self.name}.lab.vmmgr"))


def lab_host(index: int) -> LabHost:
    return LabHost(f"host{index}", index)


@dataclass(frozen=True)
class HostStatus:
    name: str
    ip: str
    namespace: bool
    libvirtd_pid: int | None
    reachable: bool
    vms: int


class Lab:
    def __init__(self, paths: Paths, log=lambda msg: None):
        self.paths = paths
        self.root = paths.lab
        self.log = log
        self.pki = LabPKI(self.root / "pki", paths.home)
        self.tls = self._read_state().get("tls", True)

    def _uri(self, h: LabHost) -> str:
        return h.uri(self.pki.client_dir if self.tls else None)

    # ---- public verbs -------------------------------------------------------------------

    def up(self, hosts: int = 3, accel: str | None = None, plain: bool = False,
           sites: int | None = None, wan: Wan | None = None) -> list[HostRecord]:
        """Make sure hosts 1..N run; repair any that are half there. Returns their records.

        Hosts talk and migrate over TLS, as a fleet set up by `ansible/` does; `plain` (an
        explicit opt-in) gives the unauthenticated, unencrypted TCP of earlier labs. `sites`
        groups the hosts into sites with `wan` between them (None: as the lab was, at first one
        site); the inventory records each host's site."""
        if not 1 <= hosts <= 9:
            raise VmmgrError("the lab has 1 to 9 hosts")
        stored = self._read_state()
        sites = sites if sites is not None else min(stored.get("sites", 1), hosts)
        if sites > 1 and wan is None:
            wan = Wan(**stored["wan"]) if stored.get("wan") else Wan()
        try:
            site_of = site_names(hosts, sites)
        except ValueError as err:
            raise VmmgrError(str(err)) from None
        with self._lock():
            self._refuse_a_foreign_store()
            image = ensure_builtin(self.paths.images, self.log)
            accel = accel or self._detect_accel(image)
            _ensure_root_bridge()
            wanted = [lab_host(i) for i in range(1, hosts + 1)]
            if self.tls == plain:  # the other transport: every host is set up anew
                for h in self.running_hosts(include_broken=True):
                    self._remove_host(h)
                self.tls = not plain
            if self.tls:
                self.pki.ensure()
            pending = [h for h in wanted if not self._healthy(h)]
            started = list(pending)
            for h in pending:
                self._remove_host(h)
            # The first daemon probes QEMU; later ones start from its cached answer.
            if pending and not self._caps_cache_current():
                shutil.rmtree(self._caps_cache(), ignore_errors=True)
                self._start_host(pending[0])
                self._wait_ready(pending[0])
                self._probe_and_save_caps(pending[0])
                pending = pending[1:]
            for h in pending:
                self._start_host(h)
            for h in pending:
                self._wait_ready(h)
            _warm_host_capabilities([self._uri(h) for h in started])
            records = [
                HostRecord(h.name, self._uri(h), accel, HOST_MEMORY_MIB, HOST_VCPUS, lab=True,
                           devices=lab_devices(i), tls=self.tls,
                           # (a host beyond `hosts` still running: in the last site, as a
                           # fleet names a site for every host or for none)
                           site=site_of[min(h.index, hosts) - 1])
                for i, h in enumerate(self.running_hosts())
            ]
            self._warn_of_known_defects(accel, records[0].uri)
            services = self.services()
            services.start_redis()  # the fleet's store: the inventory lives there
            inventory = Inventory(FleetState(services.url).r)
            for r in records:
                inventory.add(r, replace=True)
            state = {"accel": accel, "tls": self.tls, "sites": sites,
                     "wan": wan.as_dict() if sites > 1 else None}
            self._write_state(state)
            LabNetwork(self.paths, BRIDGE, self.log).up(
                {h.name: (h.namespace, h.ip, h.index) for h in self.running_hosts()})
            by = self._shape_wan({r.name: r.site for r in records}, wan if sites > 1 else None)
            self._write_state(state | {"wan_latency": by})
            if self.tls:  # each host's worker dials libvirt with its host's certificate
                for h in self.running_hosts():
                    LabPKI.install_client(services.node_home(h.name), self._host_dir(h) / "pki")
            self._give_sites_their_storage({r.name: r.site for r in records})
            services.start_workers({h.name: h.namespace for h in self.running_hosts()})
            services.start_notice_watchers({h.name: h.namespace for h in self.running_hosts()})
            services.start_beat()
            services.start_flower()
            self._snapshot_hosts()
            return records

    def _shape_wan(self, site_of: dict[str, str], wan: Wan | None) -> str | None:
        """Each host sends to the hosts of other sites over the WAN; within its site, the LAN.
        Returns what gives the WAN its latency (and loss): "netem", or on a kernel without
        `sch_netem` (this machine's) "delay line" (lab_delay.py: what crosses sites goes through
        each host's `wan0` instead of its link, shaped there as on the link); None: nothing,
        the WAN is its rate alone."""
        running = self.running_hosts()
        far = {h: [o for o in running if site_of.get(o.name, "") != site_of.get(h.name, "")]
               for h in running}
        far = {h: others for h, others in far.items() if others}
        netem = True
        for h in running:
            self._tc_all(h, shaping("eth0", [o.ip for o in far.get(h, [])], wan))
            delay = latency("eth0", wan) if wan is not None and h in far else None
            if delay is not None:
                proc = self._tc(h, delay)
                if proc.returncode and "unknown" in proc.stderr:
                    netem = False
                elif proc.returncode:
                    raise VmmgrError(f"shaping {h.name}'s WAN: {' '.join(delay)}: "
                                     f"{proc.stderr.strip()}")
        if wan is None or not far:
            self.services().stop_delay_line()
            return None
        by = "netem" if netem else self._delay_in_user_space(wan, far)
        if netem:
            self.services().stop_delay_line()
        self.log(f"sites: {', '.join(f'{n} in {s}' for n, s in sorted(site_of.items()))}; "
                 f"between sites {wan.words() if by else f'{wan.rate_mbit:g} Mbit/s'}"
                 + ("" if netem else " (the latency from a delay line: no sch_netem here)"
                    if by else " (no latency or loss: no sch_netem, no delay line)"))
        return by

    def _delay_in_user_space(self, wan: Wan, far: dict[LabHost, list[LabHost]]) -> str | None:
        """The delay line's devices moved into their hosts, shaped at the WAN's rate, and routed
        to the far hosts (the link's route, for the same addresses, no longer chosen). A line
        that already carries this WAN to every host is kept: an `up` that repairs something
        else (a worker, a daemon) does not drop the packets of moves in flight."""
        services = self.services()
        spec = {"delay_ms": wan.delay_ms, "loss_pct": wan.loss_pct, "rate_mbit": wan.rate_mbit,
                "devices": {f"vwan-{h.name}": h.ip for h in far}}
        if services.delay_line() == json.loads(json.dumps(spec)) and all(
                self._has_wan_dev(h) for h in far):
            return "delay line"
        try:
            services.start_delay_line(spec)
        except VmmgrError as err:  # e.g. a kernel without TUN: the rate alone, as said
            self.log(str(err))
            services.stop_delay_line()
            return None
        for h, others in far.items():
            ns = h.namespace
            _run(["ip", "link", "set", f"vwan-{h.name}", "netns", ns])
            _run(["ip", "-n", ns, "link", "set", f"vwan-{h.name}", "name", WAN_DEV])
            _run(["ip", "-n", ns, "link", "set", WAN_DEV, "up"])
            self._tc_all(h, shaping(WAN_DEV, [o.ip for o in others], wan))
            for o in others:
                _run(["ip", "-n", ns, "route", "replace", f"{o.ip}/32", "dev", WAN_DEV,
                      "src", h.ip])
        return "delay line"

    @staticmethod
    def _has_wan_dev(h: LabHost) -> bool:
        return subprocess.run(["ip", "-n", h.namespace, "link", "show", WAN_DEV],
                              capture_output=True).returncode == 0

    def _tc_all(self, h: LabHost, cmds: list[list[str]]) -> None:
        for cmd in cmds:
            proc = self._tc(h, cmd)
            if proc.returncode and cmd[2] != "del":  # nothing to take away is fine
                raise VmmgrError(f"shaping {h.name}'s WAN: {' '.join(cmd)}: "
                                 f"{proc.stderr.strip()}")

    @staticmethod
    def _tc(h: LabHost, cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", h.namespace, *cmd], capture_output=True,
                              text=True)

    def sites(self) -> tuple[int, Wan | None, bool]:
        """The lab's sites as last set up, the WAN between them, and whether its latency and loss
        are there (by netem, or by the delay line where the kernel has no netem)."""
        state = self._read_state()
        by = state.get("wan_latency")  # "netem", "delay line", or None
        applied = bool(by) and (by != "delay line" or self.services().delay_line() is not None)
        return (state.get("sites", 1), Wan(**state["wan"]) if state.get("wan") else None, applied)

    def _snapshot_hosts(self) -> None:
        """The hosts as they answer now, for the admission checks (which read the last
        reconcile's snapshot): a reconcile that ran while `up` restarted their libvirtd saw
        them unreachable, and the next may be a minute away. `host add` does the same."""
        from .fleet import Fleet
        from .reconcile import snapshot_hosts

        with Fleet(self.paths) as fleet:
            snapshot_hosts(fleet)

    def down(self) -> list[str]:
        """Remove every namespace, daemon, QEMU process and link the lab made; returns what went."""
        with self._lock():
            removed = []
            for ns in _namespaces():
                _kill_namespace_processes(ns)
                _run(["ip", "netns", "delete", ns], check=False)
                removed.append(ns)
            for link in _links():
                _run(["ip", "link", "delete", link], check=False)
                removed.append(link)
            # After the namespaces, whose workers may still use Redis. The lab's store (and with
            # it the lab's inventory and records) goes with its Redis.
            self.services().stop()
            LabNetwork(self.paths, BRIDGE).remove_keys()
            shutil.rmtree(self.root / "hosts", ignore_errors=True)
            shutil.rmtree(self.root / "nodes", ignore_errors=True)  # the hosts' own homes
            shutil.rmtree(self.pki.root, ignore_errors=True)
            shutil.rmtree(self.pki.client_dir, ignore_errors=True)
            self._remove_lab_vm_files()
            shutil.rmtree(self.root / "sites", ignore_errors=True)  # only the lab's VMs' there
            shutil.rmtree(self.root / "site-of", ignore_errors=True)
            (self.root / "state.json").unlink(missing_ok=True)
            return removed

    def _refuse_a_foreign_store(self) -> None:
        """A home whose store is not the lab's belongs to a real fleet: the lab would point it
        at the lab's Redis, and `down` would remove what the lab did not make."""
        ours = self.services().url
        configured = os.environ.get("VMMGR_REDIS_URL") or self.paths.redis_url()
        if configured and configured != ours:
            raise VmmgrError(f"{self.paths.home} belongs to the fleet whose store is {configured}: "
                             "the lab needs a home of its own (the default, /var/lib/vmmgr-lab, "
                             "or --home)")

    def _remove_lab_vm_files(self) -> None:
        """The lab's VMs are gone: so are their consoles, suspended images and disks (their
        addresses went with the lab's store). A VM that ever ran on a host that is not the
        lab's keeps its files."""
        lab_names = {lab_host(i).name for i in range(1, 10)}
        gone = set()
        writers: dict[str, set[str]] = {}
        folders = [self.paths.consoles, *(self.root / "sites").glob("*/consoles")]
        for folder in filter(Path.is_dir, folders):
            for p in folder.iterdir():
                if segment := console.parse(p.name):
                    writers.setdefault(segment.vm, set()).add(segment.host)
        for vm, hosts in writers.items():
            if hosts <= lab_names:
                for folder in folders:
                    console.LocalConsoles(folder).remove(vm)
                gone.add(vm)
        saves = [self.paths.saves, *(self.root / "sites").glob("*/saves")]
        for d in [d for folder in filter(Path.is_dir, saves) for d in folder.iterdir()]:
            try:
                from_host = json.loads((d / "record.json").read_text())["from_host"]
            except (OSError, ValueError, KeyError):
                from_host = None  # a save that never completed: its console tells
            if from_host in lab_names or (from_host is None and d.name in gone):
                shutil.rmtree(d, ignore_errors=True)
                gone.add(d.name)
        for vm in gone:
            for suffix in ("-swap.img", ".qcow2", "-seed.iso"):  # Fleet.vm_files
                (self.paths.storage / "disks" / f"{vm}{suffix}").unlink(missing_ok=True)

    def status(self) -> list[HostStatus]:
        result = []
        present = set(_namespaces())
        for h in self.running_hosts(include_broken=True):
            pid = self._libvirtd_pid(h)
            vms = self._count_vms(h) if pid else None
            result.append(
                HostStatus(h.name, h.ip, h.namespace in present, pid, vms is not None, vms or 0)
            )
        return result

    def services(self) -> Services:
        return Services(self.paths, BRIDGE_CIDR.split("/")[0], self.log)

    def accel(self) -> str | None:
        return self._read_state().get("accel")

    def running_hosts(self, include_broken: bool = False) -> list[LabHost]:
        hosts = []
        for ns in _namespaces():
            name = ns.removeprefix(PREFIX)
            if name.startswith("host") and name[4:].isdigit():
                h = lab_host(int(name[4:]))
                if include_broken or self._healthy(h):
                    hosts.append(h)
        return sorted(hosts, key=lambda h: h.index)

    # ---- accelerator --------------------------------------------------------------------

    def _warn_of_known_defects(self, accel: str, uri: str) -> None:
        conn = libvirt.open(uri)
        try:
            warning = tcg_migration_warning(accel, conn.getVersion())
        finally:
            conn.close()
        if warning:
            self.log(f"warning: {warning}")

    def _detect_accel(self, image: BuiltinImage) -> str:
        cached = self.root / "accel"
        if cached.exists():
            return cached.read_text().strip()
        accel = probe_accel(image)
        self.log(f"accelerator: {accel}")
        self.root.mkdir(parents=True, exist_ok=True)
        cached.write_text(accel + "\n")
        return accel

    # ---- one host -----------------------------------------------------------------------

    def _host_dir(self, h: LabHost) -> Path:
        return self.root / "hosts" / h.name

    def _healthy(self, h: LabHost) -> bool:
        return h.namespace in _namespaces() and self._count_vms(h) is not None

    def _count_vms(self, h: LabHost) -> int | None:
        try:
            conn = libvirt.open(self._uri(h))
        except libvirt.libvirtError:
            return None
        try:
            return len(conn.listAllDomains())
        finally:
            conn.close()

    def _libvirtd_pid(self, h: LabHost) -> int | None:
        try:
            pid = int((self._host_dir(h) / "run" / "libvirtd.pid").read_text())
            os.kill(pid, 0)
            return pid
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return None

    def _remove_host(self, h: LabHost) -> None:
        # The delay line first: the other hosts' routes through it to this one would lead
        # nowhere until `up` ends; without it they take the link, as to a host that went.
        self.services().stop_delay_line()
        if h.namespace in _namespaces():
            _kill_namespace_processes(h.namespace)
            _run(["ip", "netns", "delete", h.namespace], check=False)
        if h.namespace in _links():
            _run(["ip", "link", "delete", h.namespace], check=False)
        shutil.rmtree(self._host_dir(h), ignore_errors=True)

    def _start_host(self, h: LabHost) -> None:
        self.log(f"starting {h.name} ({h.ip})")
        ns, veth = h.namespace, h.namespace
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _run(["ip", "link", "set", veth, "master", BRIDGE, "up"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "address", host_mac(h.index)])
        _run(["ip", "-n", ns, "addr", "add", f"{h.ip}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        settings = dict(HOST_SYSCTLS)
        if why := _allow_congestion_control(CONGESTION_CONTROL):
            # a lab that does not start helps nobody: said, and the machine's kept
            del settings["net.ipv4.tcp_congestion_control"]
            self.log(f"{h.name}: not the role's TCP congestion control {CONGESTION_CONTROL} "
                     f"({why}): the machine's, unlike a real host's")
        for key, value in settings.items():
            _run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"])
        _run(["ip", "-n", ns, "link", "add", GUEST_BRIDGE, "type", "bridge"])
        _run(["ip", "-n", ns, "link", "set", GUEST_BRIDGE, "address", GUEST_GATEWAY_MAC])
        _run(["ip", "-n", ns, "addr", "add", GUEST_GATEWAY_CIDR, "dev", GUEST_BRIDGE])
        _run(["ip", "-n", ns, "link", "set", GUEST_BRIDGE, "up"])

        d = self._host_dir(h)
        for sub in LIBVIRT_DIRS:
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "etc" / "libvirtd.conf").write_text(_libvirtd_conf(h, self.tls))
        hook = d / "etc" / "hooks" / "qemu"  # keeps each local guest's /32 route (lab_net)
        hook.parent.mkdir(exist_ok=True)
        hook.write_bytes(hook_script())
        hook.chmod(0o755)
        (d / "etc" / "qemu.conf").write_text(_qemu_conf(h, self.tls))
        # libvirt's network filters (clean-traffic and what it includes), as Debian's package
        # installs them in /etc/libvirt/nwfilter of a real host.
        shutil.copytree(NWFILTERS, d / "etc" / "nwfilter", dirs_exist_ok=True)
        (d / "hosts").write_text(_etc_hosts())
        if self.tls:  # the host's /etc/pki, as the kvm_host role installs it
            self.pki.install_host(d / "pki", h.name, h.ip)
        if self._caps_cache().is_dir():
            shutil.copytree(self._caps_cache(), d / "cache" / CAPS, dirs_exist_ok=True)
        self._spawn_libvirtd(h)

    @contextmanager
    def libvirtd_frozen(self, name: str):
        """The host's libvirtd stopped (SIGSTOP) for the block: a daemon that accepts
        connections and answers nothing, as a wedged one does. Its QEMUs run on."""
        h = next(h for h in self.running_hosts(include_broken=True) if h.name == name)
        pid = self._libvirtd_pid(h)
        if pid is None:
            raise VmmgrError(f"{name}: libvirtd is not running")
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def restart_libvirtd(self, name: str) -> None:
        """Kill the host's libvirtd (if it runs) and start it again, its VMs' QEMUs running on:
        a daemon crash and its restart by systemd on a real host, which `up` (rebuilding a
        broken host, QEMUs and all) is not."""
        h = next(h for h in self.running_hosts(include_broken=True) if h.name == name)
        pid = self._libvirtd_pid(h)
        if pid:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while self._libvirtd_pid(h) and time.monotonic() < deadline:
                time.sleep(0.1)
        self._spawn_libvirtd(h)
        if not self._answers_within(h, FIRST_START_TIMEOUT):
            raise VmmgrError(f"{name}: libvirtd did not come back: {self._diagnosis(h)}")

    def _give_sites_their_storage(self, site_of: dict[str, str]) -> None:
        """Each host's libvirtd (and so its QEMUs), worker and notice watcher see their own
        site's consoles and saves folders (`LabServices.site_folders`) in `<storage>`, as hosts
        of sites that share no storage would; the hosts of a lab of one site, the storage's
        own. When `up` groups the hosts anew, they are bound again in each running libvirtd's
        mount namespace, and the host's other daemons are stopped, for `up` to start them again
        seeing the new ones."""
        services = self.services()
        for h in self.running_hosts():
            site = site_of.get(h.name, "")
            if site == services.site_of(h.name):
                continue  # as its daemons were started, or last bound
            if self._count_vms(h):
                self.log(f"{h.name} changes site with VMs on it: they write on where they "
                         "were, out of its new site's sight (a real host never changes site)")
            pairs = services.site_folders(site) or [
                (self.paths.storage / kind, self.paths.storage / kind) for kind in SITE_FOLDERS]
            if pid := self._libvirtd_pid(h):  # first: one that fails is bound at the next `up`
                for folder, target in pairs:
                    target.mkdir(parents=True, exist_ok=True)
                    _bind_in(pid, folder, target)
            services.set_site_of(h.name, site)  # for the next start of each
            services.stop_worker(h.name)  # `up` starts them again, seeing the new folders
            services.stop_notice_watcher(h.name)

    def _spawn_libvirtd(self, h: LabHost) -> None:
        ns, d = h.namespace, self._host_dir(h)
        services = self.services()
        binds = " ".join(
            [f"{d / sub}:{target}" for sub, target in LIBVIRT_DIRS.items()]
            + [f"{src}:{dst}" for src, dst in services.site_folders(services.site_of(h.name))]
            + [f"{d / 'hosts'}:/etc/hosts"]
            + ([f"{d / 'pki'}:/etc/pki"] if self.tls else [])
        )
        script = (
            'set -e; hostname "$1"; for pair in $2; do src=${pair%%:*}; dst=${pair#*:}; '
            'if [ -d "$src" ]; then mkdir -p "$dst"; fi; mount --bind "$src" "$dst"; done; '
            # under a reaper that does for its QEMUs what systemd does on a real host
            'exec "$3" -m vmmgr.lab_reaper libvirtd --listen --pid-file /run/libvirt/libvirtd.pid'
        )
        with open(d / "libvirtd.stderr", "wb") as err:
            # libvirtd's PID is the one in its pid file (the one started here is the reaper's)
            subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "-m", "-u", "--propagation", "private",
                 "sh", "-c", script, "lab-host", h.name, binds, sys.executable],
                stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True,
            )

    def _wait_ready(self, h: LabHost) -> None:
        """Wait for the host's libvirtd to answer; restart the host once if it does not.

        A fresh libvirtd that neither answered nor wrote an error (seen once in about a dozen
        runs, after the daemon was killed and the host rebuilt) was most likely the random MAC
        the rebuilt host had then (see the MACs above). A second start is cheaper than a failed run
        all the same, and a second failure reports everything known about both attempts.
        """
        if self._answers_within(h, FIRST_START_TIMEOUT):
            return
        first = self._diagnosis(h)
        self.log(f"{h.name}: libvirtd not answering after {FIRST_START_TIMEOUT} s; starting it again")
        self._remove_host(h)
        self._start_host(h)
        if not self._answers_within(h, READY_TIMEOUT):
            raise VmmgrError(f"libvirtd on {h.name} did not come up, twice. First: {first}. "
                             f"Second: {self._diagnosis(h)}")

    def _answers_within(self, h: LabHost, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._count_vms(h) is not None:
                return True
            time.sleep(0.3)
        return False

    def _diagnosis(self, h: LabHost) -> str:
        d = self._host_dir(h)

        def tail(path: Path) -> str:
            try:
                return path.read_text(errors="replace")[-600:].strip() or "(empty)"
            except FileNotFoundError:
                return "(missing)"

        pid = self._libvirtd_pid(h)
        return (f"libvirtd pid {pid or 'not running'}; stderr: {tail(d / 'libvirtd.stderr')}; "
                f"libvirtd.log: {tail(d / 'log' / 'libvirtd.log')}")

    def _caps_cache(self) -> Path:
        return self.root / "qemu-capabilities"

    def _caps_cache_current(self) -> bool:
        """Whether the saved probes are of the QEMU installed now (libvirt's own test: the ctime
        of each emulator binary), so that a QEMU upgrade is probed once again, not on every host."""
        saved = [p.read_text() for p in self._caps_cache().glob("*.xml")]
        for xml in saved:
            emulator = re.search(r"<emulator>([^<]+)</emulator>", xml)
            ctime = re.search(r"<qemuctime>(\d+)</qemuctime>", xml)
            if not (emulator and ctime and os.path.exists(emulator.group(1))
                    and int(ctime.group(1)) == int(os.stat(emulator.group(1)).st_ctime)):
                return False
        return bool(saved)

    def _probe_and_save_caps(self, h: LabHost) -> None:
        # libvirtd probes QEMU lazily, on the first VM: make it happen now, once for all hosts.
        conn = libvirt.open(self._uri(h))
        try:
            conn.getDomainCapabilities(EMULATOR, "x86_64", None, "qemu")
        finally:
            conn.close()
        probed = self._host_dir(h) / "cache" / CAPS
        if probed.is_dir():
            shutil.copytree(probed, self._caps_cache(), dirs_exist_ok=True)

    # ---- lab-wide state -----------------------------------------------------------------

    @contextmanager
    def _lock(self):
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _read_state(self) -> dict:
        try:
            return json.loads((self.root / "state.json").read_text())
        except FileNotFoundError:
            return {}

    def _write_state(self, state: dict) -> None:
        (self.root / "state.json").write_text(json.dumps(state) + "\n")


def probe_accel(image: BuiltinImage, timeout: float = 15) -> str:
    """'kvm' if a guest really boots under KVM here, else 'tcg'.

    `/dev/kvm` existing proves nothing: a nested hypervisor may accept the ioctl and then abort or
    hang the guest. So boot the built-in guest with the CPU model KVM domains get and wait for it
    to say so.
    """
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    cmd = [
        "qemu-system-x86_64", "-machine", "accel=kvm", "-cpu", "host", "-m", "96",
        "-display", "none", "-monitor", "none", "-serial", "stdio", "-no-reboot",
        "-kernel", str(image.kernel), "-initrd", str(image.initrd),
        "-append", f"{BASE_CMDLINE} vmmgr.workload=probe",
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "tcg"
    return "kvm" if b"vmmgr-probe-ok" in out.stdout else "tcg"


def _warm_host_capabilities(uris: list[str]) -> None:
    """Have each new libvirtd build its host capabilities now, all at once.

    libvirtd builds them lazily (NUMA, CPU and firmware probing: 4-8 s in this sandbox) on the
    first VM start or incoming migration, which would otherwise land inside the first move to
    each host.
    """
    def warm(uri: str) -> None:
        conn = libvirt.open(uri)
        try:
            conn.getCapabilities()
        finally:
            conn.close()

    threads = [threading.Thread(target=warm, args=(u,)) for u in uris]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _etc_hosts() -> str:
    # libvirtd resolves its own hostname when it starts a QEMU: answer from a file, since DNS is
    # not reachable from a lab namespace and a resolver timeout stalls every first start.
    lines = ["127.0.0.1 localhost"] + [f"{lab_host(i).ip} {lab_host(i).name}" for i in range(1, 10)]
    return "\n".join(lines) + "\n"


def _libvirtd_conf(h: LabHost, tls: bool) -> str:
    # A host's own: its listen address (the lab's hosts share one kernel, so "all addresses"
    # would clash), its own host UUID (libvirt refuses to migrate to "the same host").
    own = (f'listen_addr = "{h.ip}"\n'
           f'host_uuid = "{h.uuid}"\n'
           'log_outputs = "3:file:/var/log/libvirt/libvirtd.log"\n')
    if tls:  # the production file, as the kvm_host role writes it
        return render_role_template("libvirtd.conf.j2") + "# The lab host's own:\n" + own
    # The explicit plain opt-in: TCP without authentication, on an address nothing outside this
    # machine sees.
    return 'listen_tls = 0\nlisten_tcp = 1\nauth_tcp = "none"\nauth_unix_rw = "none"\n' + own


def _qemu_conf(h: LabHost, tls: bool) -> str:
    # `ip netns exec` remounts /sys, so cgroups are not visible: libvirt must not use them. QEMU
    # runs as root without a security driver: the lab has no per-host users or AppArmor.
    lab = ('user = "root"\ngroup = "root"\n'
           "dynamic_ownership = 0\nremember_owner = 0\n"
           'security_driver = "none"\n'
           "cgroup_controllers = [ ]\nnamespaces = [ ]\n"
           'stdio_handler = "file"\n'
           'migration_address = "0.0.0.0"\n')
    if tls:  # the production file (migration over TLS, peers verified), then the lab's part
        return (render_role_template("qemu.conf.j2", vmmgr_address=h.ip)
                + "# The lab's namespaces:\n" + lab)
    return lab + f'migration_host = "{h.ip}"\n'



def _ensure_root_bridge() -> None:
    if BRIDGE in _links():
        return
    _run(["ip", "link", "add", BRIDGE, "address", BRIDGE_MAC, "type", "bridge"])
    _run(["ip", "addr", "add", BRIDGE_CIDR, "dev", BRIDGE])
    _run(["ip", "link", "set", BRIDGE, "up"])


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def _links() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False)
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith(PREFIX)]


def _kill_namespace_processes(ns: str, grace: float = 5.0) -> None:
    """Stop every process in the namespace: QEMUs first (they outlive libvirtd), then the rest."""
    def pids() -> list[int]:
        out = _run(["ip", "netns", "pids", ns], check=False)
        return [int(p) for p in out.split()]

    def comm(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return ""

    for pid in pids():
        if comm(pid).startswith("qemu"):
            _signal(pid, signal.SIGKILL)
    for pid in pids():
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids():
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace
    while pids() and time.monotonic() < deadline:
        time.sleep(0.1)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _allow_congestion_control(name: str) -> str:
    """Let the hosts' namespaces take `name` as their congestion control: the kernel refuses
    (EPERM) one the machine does not allow to all (its `tcp_allowed_congestion_control`), and
    knows a modular one only once loaded. A real host sets its own and needs neither. Returns
    why it could not ("" when it could)."""
    proc = Path("/proc/sys/net/ipv4")
    allowed = proc / "tcp_allowed_congestion_control"
    try:
        names = allowed.read_text().split()
        if name in names:
            return ""
        if name not in (proc / "tcp_available_congestion_control").read_text().split():
            with suppress(OSError):  # no modprobe: the write below says what fails
                subprocess.run(["modprobe", f"tcp_{name}"], capture_output=True, check=False)
        allowed.write_text(" ".join([*names, name]))
        return ""
    except OSError as err:
        return f"this machine cannot allow it: {err}"


def _bind_in(pid: int, source: Path, target: Path) -> None:
    """`source` mounted at `target` in the mount namespace of process `pid` (what was mounted
    there before taken away; `source` == `target`: only that)."""
    # lazily: a QEMU's open file keeps the folder it was opened in
    script = ('while umount -l "$2" 2>/dev/null; do :; done; '
              'if [ "$1" != "$2" ]; then mount --bind "$1" "$2"; fi')
    _run(["nsenter", "-t", str(pid), "-m", "sh", "-c", script, "bind", str(source),
          str(target)])


def _run(cmd: list[str], check: bool = True) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise VmmgrError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return proc.stdout


def status_dicts(statuses: list[HostStatus]) -> list[dict]:
    return [asdict(s) for s in statuses]
