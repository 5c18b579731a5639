"""The hosts in the inventory and the VMs on them.

libvirt is the ground truth for where a VM is: `locate` asks the hosts. Creating and destroying
VMs happens here; moving them is `migration`'s job.
"""

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from dataclasses import dataclass, replace

import redis

from . import devices, local_disks, os_images, seed, site_consoles, site_images, view
from .addresses import NetworkConfig, mac_for, pool_for
from .edge import Edge
from .errors import Conflict, HostUnreachable, InvalidRequest, NotFound, VmmgrError
from .guest import Guest, read_each
from .host import Capacity, Host
from .inventory import Inventory
from .locks import Lease
from .paths import Paths
from .placement import refusal
from .render import address_of, domain_xml, set_console_path, workload_of
from .spec import VMSpec, validate_name
from .state import FleetState


@dataclass(frozen=True)
class VMInfo:
    name: str
    host: str
    state: str
    memory_mib: int
    vcpus: int
    workload: str
    device_model: str = ""  # passed-through devices it holds (count of model)
    device_count: int = 0
    live: bool = True  # False: a device blocks live migration (see devices.live_migratable)
    not_live_because: str = ""
    address: str = ""  # its stable address ("" without one)
    held: tuple[str, ...] = ()  # the addresses of the host's devices it holds
    site_disk: str = ""  # a disk on its site's storage: it never leaves that site


IMAGE_WAIT = 60.0  # s a create waits for an image's removal or rebuild to decide (and back)


def new_owner() -> str:
    """A lock owner for work that is not a task: unique to this node, process and command."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


class Fleet:
    """The hosts and VMs, as seen by one operation.

    `owner` is whose name VM locks are taken in: a task passes its id, so the operation's body
    nests inside the lock its submitter took; anything else gets a name of its own.
    """

    def __init__(self, paths: Paths, owner: str | None = None):
        self.paths = paths
        url = paths.redis_url()
        if url is None:
            raise InvalidRequest("no fleet store configured: set $VMMGR_REDIS_URL (or write it "
                                 "to <home>/redis.url; `vmmgr lab up` does)")
        self.state = FleetState(url)
        self.inventory = Inventory(self.state.r)
        self.owner = owner or new_owner()
        self._hosts: dict[str, Host] = {}

    @property
    def consoles(self) -> site_consoles.FleetConsoles:
        """The VMs' serial consoles, wherever their segments are (read with `console`)."""
        return site_consoles.FleetConsoles(self)

    def lock_vm(self, vm: str, what: str, patient: bool | None = None) -> Lease:
        """The VM's one lock, for the whole of an operation that changes it (`patient`: see
        `locks.acquire`)."""
        return Lease(self.state, "vm", vm, self.owner, what, patient=patient)

    def lock_image(self, image: str, what: str) -> Lease:
        """An OS image's lock: a create holds it while it lays its disk on the image, a removal
        or rebuild while it checks for such disks and takes the image away. The one waits for
        the other (a create's hold is short), rather than refuse."""
        return Lease(self.state, "image", image, self.owner, what, wait=IMAGE_WAIT)

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for host in self._hosts.values():
            host.close()
        self._hosts.clear()

    def host(self, name: str) -> Host:
        record = self.inventory.get(name)  # NotFound for an unknown host
        if name not in self._hosts:
            self._hosts[name] = Host(record)
        self._hosts[name].record = record  # the state may have changed since
        return self._hosts[name]

    def active_capacities(self, exclude: str | None = None) -> dict[str, Capacity]:
        """Capacities of the hosts that take VMs now (active and reachable)."""
        caps = {}
        for h in self.hosts():
            if h.name != exclude and h.record.state == "active":
                try:
                    caps[h.name] = h.capacity()
                except VmmgrError:
                    continue
        return caps

    def hosts(self) -> list[Host]:
        return [self.host(r.name) for r in self.inventory.records()]

    def sites(self) -> dict[str, str]:
        """host -> its site ("" where none is named)."""
        return {r.name: r.site for r in self.inventory.records()}

    def own_site(self) -> str:
        """The site whose storage this node sees, and so whose saves it may act on: its host's
        ($VMMGR_HOST: a host's worker or notice watcher); "" on a node that is none of the
        fleet's hosts (a control node: the storage of a fleet that names no site)."""
        me = os.environ.get("VMMGR_HOST")
        return self.sites().get(me, "") if me else ""

    def save_site(self, save: dict | None) -> str | None:
        """The site on whose storage a save (the store's copy) lives: the one it was made in,
        as the save names it; None for no save. A save made before saves named their site is
        on the storage of a fleet that named none ("")."""
        if save is None:
            return None
        return (save.get("record") or save.get("intent") or {}).get("site", "")

    def sees_save(self, vm: str) -> bool:
        """Whether this node sees the storage the VM's save (if any) is on: only there is its
        folder read, changed or taken for gone."""
        site = self.save_site(self.state.save_of(vm))
        return self.paths.saves.is_dir() and site in (None, self.own_site())

    def require_save_here(self, vm: str, what: str) -> None:
        """Refuse `what` of a VM saved on another site's storage (its site's workers run it)."""
        if self.state.save_of(vm) is not None and not self.sees_save(vm):
            site = self.save_site(self.state.save_of(vm))
            raise Conflict(f"VM {vm!r} is saved on the storage of site {site or '-'}, which this "
                           f"node does not see: its {what} runs there (a worker of that site)")

    def require_own_site(self, host: str, what: str) -> None:
        """Refuse `what`, a save of a VM on `host`, on a node of another site: the save would be
        written on this node's storage, not on the storage of the host's site."""
        site = self.sites().get(host, "")
        if site != self.own_site():
            raise Conflict(f"{what} writes on the storage of site {site or '-'}, which this node "
                           "does not see: it runs on a worker of that site")

    def require_site_holds(self, vm: str, domain_xml: str, source: str, target: str) -> None:
        """Refuse to move `vm` from `source` to a host of another site if it has a disk
        on its site's storage: that site's storage lacks the disk, or holds another VM's of
        the same name. (Its local disks and base image are sent along; these are not.)"""
        bound = local_disks.site_bound(domain_xml, self.paths.storage)
        self.require_disk_reaches(vm, bound[0] if bound else "", source, target)

    def require_disk_reaches(self, vm: str, site_disk: str, source: str, target: str) -> None:
        """`require_site_holds` for a VM whose disk on its site's storage is `site_disk` (""
        for none), as its row in the fleet view names it."""
        sites = self.sites()
        here, there = sites.get(source, ""), sites.get(target, "")
        if site_disk and here != there:
            raise Conflict(f"{vm} moves only inside its site ({here or '-'}), not to {target} "
                           f"in site {there or '-'}: {site_disk} is on its site's storage")

    def find_all(self, vm: str, strict: bool = False,
                 among: Iterable[str] | None = None) -> list[Guest]:
        """Every host's copy of the VM (or only those of the hosts named `among`): one, or two
        while it migrates. A host that does not answer is skipped, unless `strict` (deciding
        that a VM exists nowhere): then it raises HostUnreachable, as it may hold the VM. A
        reclaimed host was emptied: it holds none."""
        validate_name(vm)
        found = []
        hosts = self.hosts()
        if among is not None:
            names = set(among)
            hosts = [h for h in hosts if h.name in names]
        connect_all(hosts)
        for host in hosts:
            try:
                guest = host.find_guest(vm)
            except HostUnreachable as err:
                if strict and host.record.state != "reclaimed":
                    raise HostUnreachable(f"{err}; it may hold {vm}, so nothing is decided "
                                          "about that name until it answers (or is removed)"
                                          ) from None
                continue
            if guest is not None:
                found.append(guest)
        return found

    def find(self, vm: str, strict: bool = False) -> Guest | None:
        """The VM's guest on the host that runs it (or holds it defined), None if nowhere.

        During a migration the VM exists on both hosts; the active side that is not paused for
        an incoming migration wins, which is the source until the switch-over.
        """
        for _ in range(3):
            found = self.find_all(vm, strict)
            if not found:
                return None
            try:
                found.sort(key=lambda g: (g.state() != "running", not g.is_persistent()))
            except NotFound:
                continue  # one copy vanished as a migration ended: look again
            return found[0]
        raise Conflict(f"VM {vm!r} keeps changing hosts: try again")

    def locate(self, vm: str) -> Guest:
        """The VM's guest; NotFound only when every host answered (a host that does not may
        hold it: HostUnreachable says so instead of calling the VM unknown)."""
        guest = self.find(vm) or self.find(vm, strict=True)
        if guest is None:
            raise NotFound(f"unknown VM {vm!r}")
        return guest

    def vms(self, unreachable: set[str] | None = None) -> list[VMInfo]:
        """Every VM defined on a host that answers (the names of those that do not are added
        to `unreachable`)."""
        infos = []
        for host in self.hosts():
            try:
                guests = host.guests()
            except HostUnreachable:
                if unreachable is not None:
                    unreachable.add(host.name)
                continue
            infos += [i for i in read_each(guests, lambda g: self._info(host.name, g)) if i]
        return sorted(infos, key=lambda i: i.name)

    def _info(self, host_name: str, g: Guest) -> VMInfo | None:
        if not g.is_persistent():  # the transient twin of an incoming migration is not a VM
            return None
        xml = g.xml()  # once: workload, devices and migratability all read it
        live, why = devices.live_migratable(xml)
        bound = local_disks.site_bound(xml, self.paths.storage)
        return VMInfo(g.name, host_name, g.state(), g.memory_mib(), g.vcpus(), workload_of(xml),
                      *devices.wanted(xml), live, "" if live else why, address_of(xml) or "",
                      tuple(devices.held(xml)), bound[0] if bound else "")

    # ---- the fleet view (see view.py) -----------------------------------------------------

    def publish(self, vm: str) -> None:
        """Write the VM's row of the fleet view from libvirt and the storage, or drop it if the
        VM is gone: the operation that changed it, holding its lock. Never fails the operation:
        the next reconcile repairs the row."""
        try:
            self.state.set_vm_view(vm, self._row(vm))
        except (VmmgrError, redis.RedisError):
            pass

    def observe(self, vms: set[str]) -> list[str]:
        """Rewrite the rows of VMs that changed under no operation of this caller (a lifecycle
        event); returns those left alone: an operation holds them or wrote them meanwhile, and
        its own row stands (see FleetState.observe_vm_views)."""
        since = self.state.view_mark()  # before looking: a write after it is newer than ours
        held = [vm for vm in vms if self.state.holder("vm", vm)]  # no need to ask libvirt
        rows = {}
        for vm in set(vms) - set(held):
            try:
                rows[vm] = self._row(vm)
            except HostUnreachable:
                pass  # a host that does not answer may hold it: its row stays as it was
        return held + (self.state.observe_vm_views(rows, since) if rows else [])

    def _row(self, vm: str) -> dict | None:
        """The VM's row; None only when every host answered that it holds no such VM (a
        row dropped for a VM on a silent host would have its record forgotten)."""
        row = view.suspended_row(self.state.save_of(vm))
        if row is None:
            guest = self.find(vm) or self.find(vm, strict=True)
            info = self._info(guest.host_name, guest) if guest is not None else None
            row = view.guest_row(info) if info is not None else None
        return row

    def refresh_view(self) -> list[dict]:
        """Rewrite the whole fleet view from libvirt and the storage; returns its rows.
        A host that does not answer keeps its VMs' rows as they were; so does a VM an
        operation holds or wrote while this looked."""
        since = self.state.view_mark()
        unreachable: set[str] = set()
        rows = [view.guest_row(i) for i in self.vms(unreachable)]
        # A save's row stands over a shut-off copy (a save cut short after its record), never
        # over a running one (a resume whose last write to the store failed).
        active = {r["name"] for r in rows if r["state"] in ("running", "paused")}
        rows += [r for r in map(view.suspended_row, self.state.saves().values())
                 if r and r["name"] not in active]
        rows += [r for r in self.state.vm_views() if r["host"] in unreachable]
        self.state.observe_vm_views({r["name"]: r for r in rows}, since, whole=True)
        return rows

    def create(self, spec: VMSpec, host_name: str) -> Guest:
        """Define and start `spec` on a host; on any failure nothing is left defined."""
        host = self.host(host_name)
        with self.lock_vm(spec.name, f"create of {spec.name} on {host_name}") as lease:
            # strict: a host that does not answer may hold a VM of that name (and its address)
            if self.find(spec.name, strict=True) is not None or (
                    self.paths.saves / spec.name).exists() or self.state.save_of(spec.name):
                raise Conflict(f"VM {spec.name!r} already exists")
            require_active(host)
            reason = refusal(host.capacity(), spec.memory_mib, spec.vcpus, spec.gpu_model,
                             spec.gpu_count)
            if reason:
                raise Conflict(f"host {host_name} has no room for {spec.name}: {reason}")
            held = host.free_devices(spec.gpu_model)[:spec.gpu_count] if spec.gpu_count else []
            if spec.gpu_count:
                spec = replace(spec, swap_disk=str(self._make_swap_disk(spec)))
            pool = pool_for(self.paths, self.state.r)
            if pool is not None:
                config = NetworkConfig.load(self.paths)
                spec = replace(spec, address=pool.allocate(spec.name), gateway=config.gateway)
            site_consoles.remove(self, spec.name)  # a VM of that name's, destroyed before
            path = site_consoles.new_segment(self, spec.name, host_name)
            defined = False
            try:
                lease.check()
                if spec.image:
                    with self.lock_image(spec.image, f"create of {spec.name}"):
                        os_images.get(self.paths.images, spec.image)  # not removed meanwhile
                        spec = self._make_system_disk(spec, host)
                xml = domain_xml(spec, accel=host.accel, console_path=path)
                guest = host.define(devices.assign(xml, held, host_name) if held else xml)
                defined = True
                try:
                    guest.start()
                except HostUnreachable:
                    raise
                except VmmgrError:
                    guest.undefine()
                    defined = False
                    raise
            except HostUnreachable:
                # The host may have defined (even started) it before its answer was lost:
                # nothing is taken back, its address least of all. Once the host answers, the
                # reconcile records what runs there; `vm destroy` removes what does not.
                raise
            except VmmgrError:
                if pool is not None:
                    pool.release(spec.name)
                if not defined:  # a definition left would write there once started
                    site_consoles.drop_if_empty(self, spec.name, path)
                for made in self.vm_files(spec.name):
                    made.unlink(missing_ok=True)
                if spec.local_disk:
                    local_disks.remove(host.conn, spec.name)
                raise
            if spec.address:
                self.route_address(spec.address, host_name)
            self.publish(spec.name)
            return guest

    def relocate_stopped(self, vm: str, target: str) -> Guest:
        """Move a stopped VM's definition to `target` (its disk on shared storage, or a local
        disk copied along first, checked on arrival): defined
        there first, then undefined here, so some host always holds it; neither runs it. A run
        cut short between the two is finished by the next: the target's copy stays."""
        copies = self.find_all(vm, strict=True)
        if not copies:
            raise NotFound(f"unknown VM {vm!r}")
        if any(g.is_active() for g in copies):
            raise Conflict(f"{vm} is running: it moves by migration")
        moved = next((g for g in copies if g.host_name == target), None)
        if moved is not None:
            for g in copies:
                if g is not moved:
                    local = local_disks.local_disks(g.xml(inactive=True))
                    if local:
                        self._same_local_disk(g, moved)
                    g.undefine()
                    if local:
                        local_disks.remove(g.connection(), vm)
            self.state.set_vm(vm, state="shutoff", host=target, target="")
            self.publish(vm)
            return moved
        guest = copies[0]
        if guest.device_needs()[1]:
            raise Conflict(f"{vm} is stopped and holds passed-through devices: start it to move "
                           f"it, or destroy it")
        host = self.host(target)
        require_active(host)
        self.require_site_holds(vm, guest.xml(inactive=True), guest.host_name, target)
        reason = refusal(host.capacity(), guest.memory_mib(), guest.vcpus())
        if reason:
            raise Conflict(f"host {target} has no room for {vm}: {reason}")
        segment = site_consoles.new_segment(self, vm, target)
        definition = guest.xml(migratable=True, inactive=True)
        local = local_disks.local_disks(definition)
        try:
            if local:  # its disk on its host's own storage goes with it, checked on arrival
                _, base = local_disks.overlay_of(guest.connection(), vm)
                site_images.ensure(self, target, base, [guest.host_name])  # a site without it
                local_disks.copy(guest.connection(), host.conn, vm,
                                 seed=local_disks.has_pool_seed(definition))
            moved = host.define(set_console_path(definition, segment))
        except HostUnreachable:
            raise  # it may be defined there, its answer lost: the segment is its console
        except Exception:
            site_consoles.drop_if_empty(self, vm, segment)  # nothing was defined there
            raise
        guest.undefine()
        if local:
            local_disks.remove(guest.connection(), vm)
        self.state.set_vm(vm, state="shutoff", host=target, target="")
        self.publish(vm)
        return moved

    def tidy_local_disks(self, vm: str, strict: bool = False, check=None) -> list[str]:
        """After a move cut short (its worker killed), a VM's local disk may be on two hosts:
        the one that runs it and the one it left, or the one it never reached. Keep the disk of
        the host that defines it, alone, and remove the others; returns where from. A VM
        suspended with its disk kept beside its save needs none on any host. Nothing is
        removed while that cannot be told: the VM defined on no host that answers, or on two
        (`strict`: or on a host that does not answer). For the caller holding the VM's lock;
        `check()`, before each removal, raises once that lock is lost."""
        copies = self.find_all(vm, strict)
        if not copies:
            return self._tidy_suspended_disks(vm, check)
        if len(copies) != 1 or not local_disks.local_disks(copies[0].xml(inactive=True)):
            return []
        keeper = copies[0].host_name
        if local_disks.find(self.host(keeper).conn, vm) is None:
            return []  # its disk is not where it is defined: touch nothing
        return self._remove_local_disks(vm, [h for h in self.hosts() if h.name != keeper], check)

    def disk_kept_with_save(self, vm: str) -> bool:
        """Suspended, its local disk kept beside its save, and neither half way in nor out (a
        save on another site's storage: by the store's copy)."""
        if not self.sees_save(vm):
            save = self.state.save_of(vm) or {}
            return save.get("state") == "saved" and bool(save.get("disk"))
        return self.is_saved_whole(vm) and (self.paths.saves / vm / "disk.json").is_file()

    def _tidy_suspended_disks(self, vm: str, check=None) -> list[str]:
        if not self.disk_kept_with_save(vm):
            return []
        try:
            if self.find_all(vm, strict=True):
                return []
        except HostUnreachable:
            return []  # a host that does not answer may run it
        return self._remove_local_disks(vm, self.hosts(), check)

    def _remove_local_disks(self, vm: str, hosts: list[Host], check) -> list[str]:
        removed = []
        for host in hosts:
            if check is not None:
                check()
            try:  # refused where the host defines the VM (local_disks.remove)
                if local_disks.remove(host.conn, vm):
                    removed.append(host.name)
            except VmmgrError:
                continue  # a host that does not answer keeps its copy until it does
        return removed

    def _same_local_disk(self, left: Guest, kept: Guest) -> None:
        """Before the copy `left` is undefined for `kept` (a relocation cut short between the
        two), the kept host must hold the same disk: copied there if it has none, refused if
        its disk differs (one of the two was started meanwhile; neither is thrown away)."""
        vm = kept.name
        if local_disks.find(kept.connection(), vm) is None:
            local_disks.copy(left.connection(), kept.connection(), vm,
                             seed=local_disks.has_pool_seed(left.xml(inactive=True)))
        elif (local_disks.checksum(left.connection(), vm)
              != local_disks.checksum(kept.connection(), vm)):
            raise Conflict(f"{vm} is defined on {left.host_name} and {kept.host_name} with "
                           f"different local disks: neither is removed (undefine the copy "
                           f"to drop on its host by hand)")

    def swap_disk_path(self, vm: str) -> Path:
        return self.paths.storage / "disks" / f"{vm}-swap.img"

    def system_disk_path(self, vm: str) -> Path:
        return self.paths.storage / "disks" / f"{vm}.qcow2"

    def seed_path(self, vm: str) -> Path:
        return self.paths.storage / "disks" / f"{vm}-seed.iso"

    def vm_files(self, vm: str) -> list[Path]:
        """What a VM keeps on shared storage besides its console and saves: gone with it."""
        return [self.swap_disk_path(vm), self.system_disk_path(vm), self.seed_path(vm)]

    def leftovers(self, vm: str) -> list[Path]:
        """A VM's files on storage: with no definition and no save, what a create cut short
        (its worker killed between laying the disks and defining the VM) left; `destroy`
        removes them, and they hold the image they lie on until then."""
        return [f for f in self.vm_files(vm) if f.exists()]

    def has_leftovers(self, vm: str, address: str | None) -> bool:
        """Whether anything of a VM with no definition and no save is left for `destroy` to
        remove: its files, its `address` alone (a destroy cut short after the undefine), or
        a local disk a create cut short laid in a host's pool (asked of each host that
        answers: such a create leaves nothing on storage)."""
        return bool(address) or bool(self.leftovers(vm)) or self._local_disk_anywhere(vm)

    def _local_disk_anywhere(self, vm: str) -> bool:
        for host in self.hosts():
            try:
                if host.record.state != "reclaimed" and vm in local_disks.held(host.conn):
                    return True
            except VmmgrError:
                continue  # one that does not answer: a later destroy finds it there
        return False

    def _make_system_disk(self, spec: VMSpec, host: Host) -> VMSpec:
        """A qcow2 overlay on the OS image (which is never written) and the cloud-init seed,
        both on shared storage so that any host can run the VM; a local disk's overlay and
        seed on the host's own storage (`local_disks`)."""
        base = os_images.disk_path(self.paths.images, spec.image)
        disk, seed_file = self.system_disk_path(spec.name), self.seed_path(spec.name)
        disk.parent.mkdir(parents=True, exist_ok=True)
        if spec.local_disk:
            disk = Path(local_disks.create_overlay(host.conn, spec.name, spec.disk_gib * 2**30,
                                                   str(base)))
        else:
            proc = subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2",
                                   "-b", str(base), str(disk), f"{spec.disk_gib}G"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise VmmgrError(f"disk of {spec.name}: {proc.stderr.strip()}")
            disk.chmod(0o600)
        mac = mac_for(spec.address) if spec.address else ""
        files = {
            "meta-data": seed.meta_data(spec.uuid, spec.name),
            "user-data": seed.user_data(spec.ssh_keys, spec.user_data,
                                        hibernation_swap=bool(spec.gpu_count)),
            "network-config": seed.network_config(mac, spec.address, spec.gateway),
        }
        if spec.local_disk:  # beside its overlay, moving with it (made here, sent there)
            with tempfile.TemporaryDirectory(prefix="vmmgr-seed-") as made:
                seed_file = Path(local_disks.lay_seed(
                    host.conn, spec.name, seed.write(Path(made) / "seed.iso", files)))
        else:
            seed.write(seed_file, files)
        return replace(spec, disk=str(disk), seed=str(seed_file))

    def _make_swap_disk(self, spec: VMSpec) -> Path:
        """A sparse swap disk on shared storage, large enough for a hibernation image of all of
        the VM's memory (the kernel compresses; this never runs short)."""
        path = self.swap_disk_path(spec.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        # 0600: a hibernation image is the guest's whole memory (libvirt's dynamic ownership,
        # where on, hands it to QEMU's user when the VM starts)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # a disk left by an earlier VM of the name too
            f.truncate((spec.memory_mib + 64) * 1024 * 1024)
        return path

    def route_address(self, address: str | None, host: str) -> None:
        """Point the edge at `host` for the VM's stable address (nothing without an edge)."""
        edge = Edge.load(self.paths, self.state)
        if edge is not None and address:
            edge.route(address, host)

    def is_suspended(self, vm: str) -> bool:
        """Saved on storage (a resume that claimed the image has not finished yet): by the
        store's copy of its save, or by the folder where this node sees it (a copy not yet
        written must not let anything take the VM for gone)."""
        save = self.state.save_of(vm)
        if save is not None and (save["record"] is not None or not self.sees_save(vm)):
            return True  # (a save begun on another site: only its site can tell how it ends)
        d = self.paths.saves / vm
        return (d / "record.json").is_file() or (d / "claim.json").is_file()

    def is_saved_whole(self, vm: str) -> bool:
        """Saved, and neither half way in (a save's intent) nor out (a resume's claim): it runs
        nowhere."""
        d = self.paths.saves / vm
        return ((d / "record.json").is_file() and not (d / "intent.json").is_file()
                and not (d / "claim.json").is_file())

    def destroy(self, vm: str) -> str:
        """Power the VM off and remove it everywhere (a suspended VM: its image), console logs
        included; returns where it was."""
        with self.lock_vm(vm, f"destroy of {vm}") as lease:
            self.require_save_here(vm, "destroy")
            guest = self.find(vm)
            suspended = self.is_suspended(vm)
            if (guest is None or not guest.is_active()) and not self.is_saved_whole(vm):
                # A host that does not answer may run it (a resume or a save cut short may have
                # left it running there too, a move a stale stopped copy here): freeing its
                # address, or anything else, would give a running VM's address to the next
                # create.
                self.find_all(vm, strict=True)
            edge, pool = Edge.load(self.paths, self.state), pool_for(self.paths, self.state.r)
            address = pool.address_of(vm) if pool else None
            if guest is None and not suspended and not self.has_leftovers(vm, address):
                raise NotFound(f"unknown VM {vm!r}")
            lease.check()
            local = (self.paths.saves / vm / "disk.json").is_file()  # kept with its save
            for copy in self.find_all(vm):  # two while a broken post-copy waits paused
                try:
                    local = local or bool(local_disks.local_disks(copy.xml(inactive=True)))
                    copy.destroy()
                    copy.undefine()
                except NotFound:
                    pass  # libvirt removed that copy with the other (an incoming one)
            if local or (guest is None and not suspended):
                # on every host: one a move or a resume cut short left it on too, or (no
                # definition, no save) the overlay a create cut short laid before its seed
                for host in self.hosts():
                    try:
                        local_disks.remove(host.conn, vm)
                    except VmmgrError:
                        pass  # a host that does not answer keeps it until destroyed again
            if edge is not None and address:
                edge.unroute(address)
            shutil.rmtree(self.paths.saves / vm, ignore_errors=True)
            if self.paths.saves.is_dir() and not (self.paths.saves / vm).exists():
                self.state.forget_save(vm)  # (what stays is copied again by the reconcile)
            for made in self.vm_files(vm):
                made.unlink(missing_ok=True)
            site_consoles.remove(self, vm)
            if pool is not None:
                pool.release(vm)
            self.publish(vm)
            return (guest.host_name if guest is not None else "storage (suspended)" if suspended
                    else "storage (what a create or destroy cut short left)")


def connect_all(hosts: list[Host]) -> None:
    """Open the connections not open yet side by side: a scan of every host then waits for the
    slowest TLS handshake, not for their sum (about 8 ms each in the lab, on every task's first
    look for a VM). Failures are left for the caller's own call to raise."""
    closed = [h for h in hosts if not h.connected]
    if len(closed) < 2:
        return

    def attempt(host: Host) -> None:
        try:
            host.conn
        except Exception:  # noqa: BLE001 - the caller's call raises it, with its context
            pass

    threads = [threading.Thread(target=attempt, args=(h,), daemon=True) for h in closed]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def require_active(host: Host) -> None:
    if host.record.state != "active":
        raise Conflict(f"host {host.name} is {host.record.state}: it takes no new VMs")


def require_other_host(guest: Guest, target: str) -> None:
    if guest.host_name == target:
        raise InvalidRequest(f"VM {guest.name!r} already runs on {target}")
