"""Reconcile: keep the fleet's records in step with libvirt, and bring parked VMs back.

Run periodically (Celery beat) under a lease of its own. It resumes parked VMs where there is
room (oldest first, each under its VM's lock), repairs any record that drifted from what libvirt
says (and says so in the event log), points the edge at the host that holds each running VM, and
refreshes the host snapshot. Nothing a moving VM depends on is touched while it moves.
"""

import time
import xml.etree.ElementTree as ET
from dataclasses import asdict

import redis

from . import (local_disks, metrics, operations, reclaim, site_consoles, site_images,
               suspend as suspension)
from .addresses import pool_for
from .edge import Edge
from .errors import Conflict, VmmgrError
from .fleet import Fleet
from .guest import read_each
from .locks import HOUSEKEEPING, Lease
from .render import address_of


def reconcile(fleet: Fleet, report, start=None, start_saves=None) -> dict:
    """One pass. `start(vm)`, when given, starts a post-copy recovery elsewhere (the
    task API queues it as the VM's own task); without it the pass runs each one itself.
    The saves are each site's to keep (`reconcile_saves`, on the storage only its nodes see):
    in a fleet that names sites, `start_saves(site)` starts each site's pass (the task API
    queues it on the site's queue); otherwise, or without it, this pass keeps this node's."""
    sites = set(fleet.sites().values())
    if start_saves is None or sites <= {""}:
        saves = reconcile_saves(fleet, report)  # first: what follows reads the saves there
    else:
        # Each site's pass on that site's queue, this node's too: one that sends an image
        # across the WAN for minutes must not hold up the fleet's pass (and its lease).
        saves = {"repaired": [], "recovered": [], "resumed": []}
        for site in sorted(sites | {fleet.own_site()}):
            try:
                start_saves(site)
            except Exception as err:  # noqa: BLE001 - the broker is away: the next pass
                report.event(f"site {site or '-'}: its saves' pass not started: {err}",
                             kind="error")
    copied, recovered, resumed = saves["repaired"], saves["recovered"], saves["resumed"]
    postcopies = resume_postcopies(fleet, report, start)
    if start is None:
        recovered = recovered + postcopies  # (a new list: the saves' pass counted its own)
    rows = fleet.refresh_view()  # what libvirt and the storage say now (one pass over hosts)
    repaired = copied + repair_records(fleet, report, rows)
    repaired += repair_addresses(fleet, report, rows)
    rerouted = repair_edge(fleet, report, rows)
    rerouted += release_stale_holds(fleet, report)
    snapshot_hosts(fleet)
    swept = sweep_local_disks(fleet, report)  # last: the records and routes come first
    swept += sweep_sent_images(fleet, report)
    swept += sweep_image_copies(fleet, report)
    swept += site_consoles.retry_drops(fleet, report)
    swept += sweep_addresses(fleet, report, rows)
    fleet.state.write_usage_baseline()
    # (the saves' pass counts its own: in a fleet that names sites, it runs on each site)
    metrics.count(fleet.state.r, "reconcile_repairs",
                  by=len(repaired) - len(copied) + len(rerouted) + len(swept))
    metrics.count(fleet.state.r, "reconcile_recoveries",
                  by=len(recovered) - len(saves["recovered"]))
    return {"recovered": recovered, "resumed": resumed, "repaired": repaired,
            "rerouted": rerouted, "recoveries_started": postcopies if start else [],
            "swept": swept}


def reconcile_saves(fleet: Fleet, report) -> dict:
    """The pass over the saves on this node's site's storage (each site's own: its folders are
    seen only there): their copies in the store, the suspends and resumes cut short, and the
    parked VMs resumed where there is room. One pass per site at a time, whoever runs it (the
    reconcile for its own node's site, or the pass it queued on that site): two at once could
    each place a parked VM in one host's last room."""
    site = fleet.own_site() or "-"
    lease = Lease(fleet.state, "fleet", f"reconcile-saves:{site}", fleet.owner,
                  f"pass over site {site}'s saves")
    try:
        lease.__enter__()
    except Conflict:
        return {"repaired": [], "recovered": [], "resumed": [],
                "skipped": f"another pass over site {site}'s saves is running"}
    try:
        copied = suspension.sync_records(fleet, report)
        recovered = recover_cut_short(fleet, report)
        resumed = reclaim.resume_parked(fleet, report, synced=True)
    finally:
        lease.__exit__(None, None, None)
    metrics.count(fleet.state.r, "reconcile_repairs", by=len(copied))
    metrics.count(fleet.state.r, "reconcile_recoveries", by=len(recovered))
    return {"repaired": copied, "recovered": recovered, "resumed": resumed}


def resume_postcopies(fleet: Fleet, report, start=None) -> list[str]:
    """Resume every migration a broken post-copy left paused on both hosts: each pass tries
    once more, so the VM runs again as soon as the link is back. Returns those resumed here
    (or, with `start`, those started)."""
    done = []
    for vm, rec in fleet.state.vms().items():
        if (rec.get("state") != "postcopy-paused" or fleet.state.holder("vm", vm)
                or float(rec.get("recovery_at") or 0) > time.time()):
            continue  # being recovered, or its last try failed and the next waits its turn
        try:
            if start is not None:
                start(vm)
            else:
                operations.resume_postcopy(fleet, report, vm)
            done.append(vm)
        except VmmgrError:
            pass  # said in the event log (or busy: started meanwhile); the next pass tries again
        except Exception as err:  # the broker is away: the next pass starts it
            report.event(f"{vm}: post-copy recovery not started: {err}", vm=vm, kind="error")
    return done


def recover_cut_short(fleet: Fleet, report) -> list[str]:
    """Finish or undo every suspend and resume whose run was cut short (a worker killed, a node
    lost): a VM is never left shut off with its memory on storage. Those another operation
    holds are its own to finish."""
    done = []
    for vm in suspension.cut_short(fleet):
        if fleet.state.holder("vm", vm):
            continue  # its operation is running (or its lease has yet to expire)
        try:
            if operations.recover(fleet, report, vm):
                done.append(vm)
        except VmmgrError as err:  # busy, or a host that does not answer: next time
            report.event(f"{vm}: recovery postponed: {err}", vm=vm)
    return done


def sweep_local_disks(fleet: Fleet, report) -> list[str]:
    """Remove the local disks a move left on a host it could not reach when it ended (the link
    cut, or the host's libvirtd killed, while the disk was copied). Decided from one listing of
    each host's pool and VMs; then, for each disk to remove, under its VM's lock and asked of
    every host again (`Fleet.tidy_local_disks`, strict): only where the host does not define the
    VM and its disk is whole on the one host that does, or kept beside its save. Nothing while a
    host that may define it does not answer. Returns "vm@host" for each disk removed."""
    # recover needs the disk a cut-short suspend left (another site's: by the store's copy)
    cut = set(suspension.cut_short(fleet)) | {
        vm for vm, save in fleet.state.saves().items() if save["state"] != "saved"}
    disks: dict[str, set[str]] = {}
    defined: dict[str, set[str]] = {}
    silent = False
    for host in fleet.hosts():
        try:
            for vm in local_disks.held(host.conn):
                disks.setdefault(vm, set()).add(host.name)
            for guest in host.guests():  # transient ones too: a migration's incoming VM
                defined.setdefault(guest.name, set()).add(host.name)
        except VmmgrError:
            silent = silent or host.record.state != "reclaimed"  # it may define any of them
    swept = []
    for vm in sorted(set(disks) - cut):
        where = defined.get(vm, set())
        if silent or not disks[vm] - where or not (
                (len(where) == 1 and where <= disks[vm])  # whole on the one host defining it
                or (not where and fleet.disk_kept_with_save(vm))):
            continue  # nothing stray, or nothing that can be told is safe to remove
        try:
            if fleet.state.holder("vm", vm):
                continue  # an operation moves it, and its disk with it
            with fleet.lock_vm(vm, f"{HOUSEKEEPING}sweep of {vm}'s stray local disks") as lease:
                removed = fleet.tidy_local_disks(vm, strict=True, check=lease.check)
        except VmmgrError:
            continue  # taken meanwhile, or a host stopped answering: the next pass
        except Exception as err:  # noqa: BLE001 - one VM's surprise must not end the pass
            report.event(f"{vm}: stray local disks not swept: {err}", vm=vm, kind="error")
            continue
        for host in removed:
            report.event(f"{vm}: stray local disk removed from {host}", vm=vm, host=host,
                         kind="repair")
            swept.append(f"{vm}@{host}")
    return swept


def sweep_sent_images(fleet: Fleet, report) -> list[str]:
    """Remove the save images a resume sent to a host of another site and could not take back
    (the host did not answer then): a memory image is not left on a host for good. Only where
    no resume holds the VM and its save is not claimed (a resume cut short: `recover` takes it
    back). Returns "vm@host" for each image removed."""
    swept = []
    for host in fleet.hosts():
        try:
            sent = local_disks.held(host.conn, local_disks.image_volume_name(""))
        except VmmgrError:
            continue  # away: the next pass
        for vm in sorted(sent):
            try:
                if fleet.state.holder("vm", vm):
                    continue
                with fleet.lock_vm(vm, f"{HOUSEKEEPING}sweep of {vm}'s sent save image"):
                    if (fleet.state.save_of(vm) or {}).get("state") == "claimed":
                        continue
                    if not local_disks.remove_image(host.conn, vm):
                        continue
            except VmmgrError:
                continue  # taken meanwhile, or the host stopped answering: the next pass
            report.event(f"{vm}: a save image sent to {host.name} and left there removed",
                         vm=vm, host=host.name, kind="repair")
            swept.append(f"{vm}@{host.name}")
    return swept


def sweep_image_copies(fleet: Fleet, report) -> list[str]:
    """Take back what a copy of a base image to a host's storage left there when it was cut
    short (its worker killed, the host's libvirtd or the link gone): a disk without the record
    that makes it an image. Each copy is known from when it starts until it ends well; one whose
    lock no one holds any more is over. Returns "image@host" for each disk removed."""
    swept = []
    for key, base in sorted(fleet.state.image_copies().items()):
        image, _, host = key.partition("@")
        try:
            found = site_images.sweep(fleet, image, host, base)
        except VmmgrError:
            continue  # it does not answer: the next pass
        except Exception as err:  # noqa: BLE001 - one copy's surprise must not end the pass
            report.event(f"a copy of image {image} to {host} not swept: {err}", host=host,
                         kind="error")
            continue
        if found is None:
            continue  # a copy to that storage runs
        if found:
            report.event(f"a copy of image {image} cut short removed from {host}", host=host,
                         kind="repair")
            swept.append(key)
    return swept


def sweep_addresses(fleet: Fleet, report, rows: list[dict]) -> list[str]:
    """Free the addresses of VMs that are nowhere: no host defines one, it has no save and no
    files, and no operation holds it (a create killed after allocating and before laying any
    disk, a destroy cut short after the undefine). Nothing else would: no view lists such a name. By `destroy`,
    under the VM's lock, which decides nothing while a host that may hold it does not answer.
    A VM's files, and its disks on hosts, are left for the operator (`vm destroy`): a disk may
    hold someone's work.
    Returns the addresses freed."""
    pool = pool_for(fleet.paths, fleet.state.r)
    if pool is None:
        return []
    known = {r["name"] for r in rows}  # a host that does not answer keeps its rows
    freed = []
    for ip, vm in sorted(pool.in_use().items()):
        if vm in known or fleet.state.holder("vm", vm) or fleet.is_suspended(vm) \
                or fleet.leftovers(vm):
            continue
        try:
            if fleet.find_all(vm, strict=True):  # first without the lock: a silent host skips
                continue
            # Not one of the brief checks a request waits for: it may destroy (the edge's
            # route too), so a request meeting it is refused at once, as by any operation.
            with fleet.lock_vm(vm, f"sweep of {vm}'s address", patient=False):
                if (fleet.find_all(vm, strict=True) or fleet.is_suspended(vm)
                        or fleet.leftovers(vm) or pool.address_of(vm) != ip):
                    continue  # created, saved or freed since the rows were read
                if any(vm in local_disks.held(h.conn) for h in fleet.hosts()
                       if h.record.state != "reclaimed"):
                    continue  # a disk of its own on a host: the operator's to destroy
                fleet.destroy(vm)  # the same lock, nested
        except (VmmgrError, redis.RedisError):
            continue  # locked, or a host (or the store) does not answer: the next pass
        except Exception as err:  # noqa: BLE001 - one VM's surprise must not end the pass
            report.event(f"{vm}: its address {ip} not swept: {err}", vm=vm, kind="error")
            continue
        report.event(f"{vm}: its address {ip} freed (no host defines it, and it has no save)",
                     vm=vm, kind="repair")
        freed.append(ip)
    return freed


def repair_records(fleet: Fleet, report, rows: list[dict]) -> list[str]:
    """Make each VM's record say what its view row says (a host that does not answer keeps
    its rows as they were, so its VMs' records are not taken for gone)."""
    state = fleet.state
    truth = {r["name"]: ("", "suspended") if r["host"] == "-" else (r["host"], r["state"])
             for r in rows}
    records = state.vms()
    repaired = []
    for vm, (host, now) in truth.items():
        rec = records.get(vm, {})
        if state.holder("vm", vm) or rec.get("state") == "postcopy-paused":
            continue  # an operation is changing it, or the post-copy recovery owns it
        if (rec.get("host"), rec.get("state")) != (host, now):
            was = f"{rec.get('state')} on {rec.get('host') or '-'}" if rec else "unrecorded"
            state.set_vm(vm, host=host, state=now, target="")
            report.event(f"{vm}: record repaired: was {was}, libvirt says {now} on {host or '-'}",
                         vm=vm or "", kind="repair")
            repaired.append(vm)
    for vm in set(records) - set(truth):
        if state.holder("vm", vm):
            continue
        try:
            # Asked again, every host, under the VM's lock: a VM created or resumed since the
            # rows were read, or held by a host that does not answer, keeps its record (its
            # spec, its usage).
            if fleet.find_all(vm, strict=True):  # first without the lock: a silent host skips
                continue
            with fleet.lock_vm(vm, f"{HOUSEKEEPING}check of {vm}'s record"):
                if fleet.find_all(vm, strict=True) or fleet.is_suspended(vm):
                    continue
                state.forget_vm(vm)
        except (VmmgrError, redis.RedisError):
            continue  # busy, or a host (or the store) does not answer: the next pass
        report.event(f"{vm}: record removed: libvirt knows no such VM", vm=vm, kind="repair")
        repaired.append(vm)
    return sorted(repaired)


def repair_addresses(fleet: Fleet, report, rows: list[dict]) -> list[str]:
    """Record again the address a VM carries in its definition (running or saved) when the
    store has no allocation for it (a store restored from an old copy, or lost): else a create
    could hand the same address out twice. Under the VM's lock, from its definition as it is
    then (a row read before a destroy or a re-create finished must not bring an address back).
    An address the store gives to another VM is reported (hourly), never taken from it."""
    pool = pool_for(fleet.paths, fleet.state.r)
    if pool is None:
        return []
    holds = set(pool.in_use().values())
    repaired = []
    for row in rows:
        vm, ip = row["name"], row.get("address") or ""
        if not ip or vm in holds or not pool.contains(ip):
            continue  # no address, or one recorded for it already: the store's stands
        try:
            with fleet.lock_vm(vm, f"{HOUSEKEEPING}record of {vm}'s address"):
                if _defined_address(fleet, vm) != ip or pool.address_of(vm):
                    continue  # changed since the rows were read
                holder = pool.claim(ip, vm)
        except (VmmgrError, redis.RedisError):
            continue  # locked (an operation is changing it) or unreachable: the next pass
        if holder:
            if fleet.state.r.set(f"vmmgr:address-clash:{vm}", ip, nx=True, ex=3600):
                report.event(f"{vm} runs with {ip}, which the store gives to {holder}: one of "
                             "them must get another address (vm destroy and create it)", vm=vm,
                             kind="repair")
            continue
        report.event(f"{vm}: its address {ip} recorded again (the store had lost it)", vm=vm,
                     kind="repair")
        repaired.append(vm)
    _report_upgrade_conflicts(fleet, report, pool)
    return repaired


def _report_upgrade_conflicts(fleet: Fleet, report, pool) -> None:
    """An older vmmgr's allocation file whose address the store gives to another VM is left
    for the operator (`<ip>.conflict`): say so in the event log, once an hour, until it goes."""
    conflicts = pool.conflicts(fleet.paths.storage / "addresses")
    owners = pool.in_use() if conflicts else {}  # (read only when there is something to say)
    for ip, old in conflicts.items():
        if fleet.state.r.set(f"vmmgr:address-conflict:{ip}", old, nx=True, ex=3600):
            report.event(f"storage/addresses/{ip}.conflict: an older vmmgr gave {ip} to {old}, "
                         f"the store gives it to {owners.get(ip, 'no one now')}; one of them "
                         "must get another address, then remove the file", vm=old,
                         kind="repair")


def _defined_address(fleet: Fleet, vm: str) -> str | None:
    """The address in the VM's definition: on the host that holds it, or in its save."""
    guest = fleet.find(vm)
    if guest is not None:
        return address_of(guest.xml(inactive=True))
    save = fleet.state.save_of(vm)
    if save is not None and save["address"]:
        return save["address"]
    try:
        return address_of((fleet.paths.saves / vm / "domain.xml").read_text())
    except (OSError, ET.ParseError):  # no save, or one cut short
        return None


def repair_edge(fleet: Fleet, report, rows: list[dict]) -> list[str]:
    """Make the edge route every running VM's address to the host libvirt says holds it."""
    edge, pool = Edge.load(fleet.paths, fleet.state), pool_for(fleet.paths, fleet.state.r)
    if edge is None or pool is None:
        return []
    # A move under way routes its own VM at its switch-over; repairing around it could undo
    # that. So: only when nothing moves (a VM lock, a host being emptied, a libvirt job).
    try:
        if any(fleet.state.holder("vm", vm) for vm in pool.in_use().values()) or any(
                h.record.state == "draining" or any(read_each(h.guests(), lambda g: g.has_job()))
                for h in fleet.hosts()):
            return []
    except VmmgrError:
        return []  # a host does not answer: its VMs' routes stay as they are
    where = {r["name"]: r["host"] for r in rows if r["state"] == "running"}
    placement = {ip: where[vm] for ip, vm in pool.in_use().items() if vm in where}
    changed = edge.sync(placement)
    for host in changed:
        report.event(f"edge routes to {host} repaired", host=host, kind="repair")
    return changed


def release_stale_holds(fleet: Fleet, report) -> list[str]:
    """Let go what the edge holds for a VM no one moves (a worker died mid switch-over, or a
    release failed): each to wherever the VM's address is routed now. Returns the addresses."""
    edge, pool = Edge.load(fleet.paths, fleet.state), pool_for(fleet.paths, fleet.state.r)
    if edge is None or pool is None or not edge.can_hold:
        return []
    try:
        held, owners = edge.held(), pool.in_use()
    except VmmgrError as err:
        report.event(f"could not ask the edge what it holds: {err}", kind="repair")
        return []
    released = []
    for ip in held:
        vm = owners.get(ip)
        try:
            if vm:
                # Under the VM's lock: a move that started since `held` was read must not lose
                # the hold it just took. A locked VM may be switching over: its move releases,
                # or its lock lapses and a later pass does.
                with fleet.lock_vm(vm, f"{HOUSEKEEPING}release of the packets the edge "
                                   f"holds for {vm}"):
                    edge.release(ip)
            else:
                edge.release(ip)
        except (VmmgrError, redis.RedisError):  # Conflict (locked) is a VmmgrError
            continue  # the next pass tries again
        report.event(f"packets held at the edge for {ip} released (no move under way)",
                     vm=vm or "", kind="repair")
        released.append(ip)
    return released


def snapshot_hosts(fleet: Fleet) -> None:
    hosts = {}
    for h in fleet.hosts():
        try:
            cap = h.capacity()
            hosts[h.name] = {"state": h.record.state, "reachable": True, **asdict(cap)}
        except VmmgrError as err:
            hosts[h.name] = {"state": h.record.state, "reachable": False, "error": str(err)}
    fleet.state.set_hosts(hosts)
    up = [h for h in hosts.values() if h["reachable"]]
    fleet.state.sample_capacity(sum(h["used_memory_mib"] for h in up),
                                sum(h["memory_mib"] for h in up))
