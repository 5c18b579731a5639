"""Disks on a host's own storage (`vm create --local-disk`): the overlay of a VM from an OS image
kept on the host that runs it, and moved with it, never through shared storage. One Debian VM,
each host a site of its own, goes through every path that moves it: a live migration that
copies its disk first (progress in a disk phase), a migration cancelled in that phase, one to
a host whose site lacks the base image and has no room for it (refused, nothing left there),
one cancelled while the image is sent, one whose links are cut then (the sweep takes back what
arrived), one to a host with room (the image sent first, checksummed; the VM runs on the
copy), one whose worker is killed while it sends the image (the rerun sends it again), suspend
and resume on another host (whose storage lacks the image: sent first), a worker killed while a
suspend keeps the disk and while a resume loads it, a worker killed mid-copy, the target's
libvirtd killed and the link to the target cut mid-copy (the overlay left there removed by the
reconcile's sweep once it answers), the source's libvirtd killed mid-copy and restarted, a
stopped VM moved by a reclaim whose worker is killed while the disk is copied; after each, what
it wrote is whole and its disk is on the one host that holds it, and nowhere else."""

import json
import os
import re
import signal
import subprocess
import time
import xml.etree.ElementTree as ET

import pytest

from vmmgr import local_disks, os_images, site_consoles, suspend
from vmmgr.addresses import pool_for

from .conftest import cli, consoles, sent_image, site_saves
from .test_faults import faults
from .test_images import _boot_id, _ssh, _wait_console, debian  # noqa: F401 (its fixture)

HOSTS = ("host1", "host2", "host3")


def holders(fleet, vm) -> list[str]:
    """The hosts whose own storage holds a disk of the VM (asked of each host's libvirt)."""
    return [h for h in HOSTS if local_disks.find(fleet.host(h).conn, vm) is not None]


def placed(fleet, vm) -> list[str]:
    """`holders`, once asserted that each of them holds the VM's seed too, and no other host:
    the seed goes wherever the disk goes (hosts of different sites share no storage)."""
    disks = holders(fleet, vm)
    seeds = [h for h in HOSTS if local_disks.find(fleet.host(h).conn, vm,
                                                  local_disks.seed_volume_name(vm)) is not None]
    assert seeds == disks, f"{vm}: disk on {disks}, seed on {seeds}"
    return disks


def where(fleet, vm) -> list[str]:
    return [g.host_name for g in fleet.find_all(vm)]


def soon(check, what: str, timeout: float = 120) -> None:
    """Poll fast: the steps a fault must land in last a second or two."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def settled(c, fleet) -> None:
    """Recover has finished or undone what the killed worker left, and no one holds the VM: by
    the store's copy of its save (the folder is on its site's storage, out of this node's
    sight)."""
    def done() -> bool:
        save = c.state.save_of("local1")
        return (save is None or save["state"] == "saved") and not c.state.holder("vm", "local1")
    faults.wait(done, 300, "what the killed worker left was not settled")



# One Debian guest through every path in turn (each fault needs the state the last one left):
# about 11 minutes under TCG, more than the suite's default 600 s per test on a slow day.
@pytest.mark.timeout(1500)
def test_a_local_disk_moves_with_its_vm_on_every_path(lab, fleet, paths, debian, tmp_path):
    c = faults.Lab3(lab, paths)
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    for args, message in ((["--workload", "counter"], "go with --image"),
                          (["--image", "debian-12", "--gpu", "lab-gpu"], "no --local-disk")):
        refused = cli("vm", "create", "bad-local", "--local-disk", *args, check_code=2)
        assert message in refused.stderr, refused.stderr
    assert fleet.find("bad-local") is None and holders(fleet, "bad-local") == []

    hidden = None  # the pid of host3's libvirtd, whose view of the images is a tmpfs
    try:
        lab.up(3, sites=3)  # each host a site of its own: every move below crosses a WAN
        # A disk on its site's storage (no --local-disk) never leaves that site: a move to
        # another is refused before anything runs, and the VM runs on where it was.
        cli("vm", "create", "shared1", "--image", "debian-12", "--host", "host1", check_code=0)
        try:
            refused = cli("migrate", "shared1", "--to", "host2")
            assert (refused.returncode == 4 and re.search(
                r"shared1 moves only inside its site \(site1\), not to host2 in site site2: "
                r".*/disks/shared1.qcow2 is on its site's storage", refused.stderr)), refused
            assert where(fleet, "shared1") == ["host1"]
            assert fleet.locate("shared1").state() == "running"
        finally:
            cli("vm", "destroy", "shared1")
        assert fleet.find("shared1") is None
        cli("vm", "create", "local1", "--image", "debian-12", "--memory", "512", "--host",
            "host1", "--ssh-key", f"{key}.pub", "--local-disk", check_code=0)
        guest = fleet.locate("local1")
        [vda] = [d for d in local_disks.local_disks(guest.xml()) if d == "vda"]
        assert vda and placed(fleet, "local1") == ["host1"]
        # nothing of it on shared storage: its seed is in the host's pool, as its disk is
        assert not fleet.system_disk_path("local1").exists()
        assert not fleet.seed_path("local1").exists()
        [seed_file] = [d.find("source").get("file")
                       for d in ET.fromstring(guest.xml()).iterfind("./devices/disk")
                       if d.find("target").get("dev") == "vdb"]
        assert local_disks.is_local(seed_file), seed_file
        _wait_console(paths, "local1", "finished at")
        address = pool_for(paths).address_of("local1")

        def data_sum() -> str:
            got = _ssh(key, address, "sync; echo 3 | sudo -n tee /proc/sys/vm/drop_caches "
                                     ">/dev/null 2>&1; sha256sum data")
            assert got.returncode == 0, got.stdout + got.stderr
            return got.stdout

        wrote = _ssh(key, address, "head -c 67108864 /dev/urandom > data; sync; sha256sum data")
        assert wrote.returncode == 0, wrote.stderr
        written = wrote.stdout

        # Live: the disk first (a phase of its own in the progress), then the memory.
        moved = cli("migrate", "local1", "--to", "host2", "--bandwidth", "40", check_code=0)
        assert "(memory next)" in moved.stdout + moved.stderr
        assert where(fleet, "local1") == ["host2"] and placed(fleet, "local1") == ["host2"]
        assert data_sum() == written
        events = c.state.migrations("local1")[-1]["events"]
        assert any("local disk laid on host2" in e for e in events), events
        assert any("local disk removed from host1" in e for e in events), events

        # Cancelled in the disk phase: it runs on where it was, its disk whole, none left.
        task = c.task_of(c.cli("migrate", "local1", "--to", "host3", "--bandwidth", "5",
                               "--no-wait"))
        faults.wait(lambda: holders(fleet, "local1") == ["host2", "host3"], 60,
                    "no disk was laid on host3")
        time.sleep(1)
        assert c.state.vm("local1").get("state") == "migrating"
        cli("migrate", "cancel", "local1", check_code=0)
        faults.wait(lambda: c.task_state(task) == "FAILURE", 60, "the migration never ended")
        assert where(fleet, "local1") == ["host2"] and placed(fleet, "local1") == ["host2"]
        # nor the console segment made for host3's QEMU (on host3's site)
        assert [s.host for s in consoles(paths).segments("local1")] == ["host1", "host2"]
        on_host3 = site_consoles.ensure_pool(fleet.host("host3").conn, paths.consoles)
        on_host3.refresh(0)
        assert not [n for n in on_host3.listVolumes() if n.startswith("local1@")]
        assert fleet.locate("local1").state() == "running"
        assert data_sum() == written

        # A target whose site lacks the base image (a tmpfs over the images folder in host3
        # libvirtd's own mount namespace: its storage as another site's would be). With no room
        # for it: a clear error before anything moves; the VM runs on, nothing left there.
        hide = ["nsenter", "-t", str(c.libvirtd_pid("host3")), "-m"]
        subprocess.run([*hide, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs",
                        str(paths.images)], check=True)
        try:
            refused = cli("migrate", "local1", "--to", "host3")
            left = subprocess.run([*hide, "find", str(paths.images), "-type", "f"],
                                  capture_output=True, text=True, check=True).stdout
        finally:
            subprocess.run([*hide, "umount", str(paths.images)], check=True)
        assert refused.returncode != 0
        assert ("host3 lacks the base image" in refused.stderr and "could not receive it"
                in refused.stderr and "No space left on device" in refused.stderr
                and "the VM is still running on host2" in refused.stderr), refused.stderr
        assert left == "", left
        assert where(fleet, "local1") == ["host2"] and placed(fleet, "local1") == ["host2"]
        assert fleet.locate("local1").state() == "running"

        # With room: the move sends the image first (checksummed, progress in a phase of its
        # own), then the disk and the memory. The VM runs there on the copy; the tmpfs stays
        # until the end (host3 serves the steps below from it, or, its libvirtd restarted in
        # a fresh namespace, from storage holding the same image).
        hidden = c.libvirtd_pid("host3")
        subprocess.run([*hide, "mount", "-t", "tmpfs", "-o", "size=1200m", "tmpfs",
                        str(paths.images)], check=True)

        def on_host3() -> str:
            return subprocess.run([*hide, "find", str(paths.images), "-type", "f"],
                                  capture_output=True, text=True, check=True).stdout

        def copied_sum() -> str:
            disk = os_images.disk_path(paths.images, "debian-12")
            return subprocess.run([*hide, "sha256sum", str(disk)], capture_output=True,
                                  text=True, check=True).stdout.split()[0]

        # Cancelled while the image is being sent (before the move has a libvirt job): it
        # ends there; nothing of the image is left, the VM runs on.
        task = c.task_of(c.cli("migrate", "local1", "--to", "host3", "--no-wait"))
        soon(lambda: on_host3() != "", "the base image was never being sent")
        time.sleep(1)
        cli("migrate", "cancel", "local1", check_code=0)
        faults.wait(lambda: c.task_state(task) == "FAILURE", 60, "the move went on")
        said = json.loads(c.state.task(task)["outcome"])
        assert "cancelled while host3 received its base image" in said["message"], said
        assert on_host3() == "" and placed(fleet, "local1") == ["host2"]
        assert where(fleet, "local1") == ["host2"]
        # this move and the refused one took back the console segments they had numbered
        assert [s.host for s in consoles(paths).segments("local1")] == ["host1", "host2"]

        # The links to host3 cut while the image is sent: the move fails (the VM runs on),
        # and what arrived cannot be taken back then; the reconcile's sweep removes it once
        # host3 answers again.
        task = c.task_of(c.cli("migrate", "local1", "--to", "host3", "--no-wait"))
        soon(lambda: on_host3() != "", "the base image was never being sent")
        time.sleep(2)
        for source in ("host1", "host2"):
            c.link(False, source=source, target="host3")
        try:
            faults.wait(lambda: c.task_state(task) == "FAILURE", 120, "the move went on")
        finally:
            for source in ("host1", "host2"):
                c.link(True, source=source, target="host3")
        said = json.loads(c.state.task(task)["outcome"])
        assert ("could not receive it" in said["message"]
                and "still running on host2" in said["message"]), said
        faults.wait(lambda: on_host3() == "", 120, "the cut-short copy stayed on host3")
        faults.wait(lambda: any(  # (said once the sweep has ended)
            e["message"] == "a copy of image debian-12 cut short removed from host3"
            for e in c.state.events(count=500)), 30, "not the sweep's doing")
        assert where(fleet, "local1") == ["host2"] and placed(fleet, "local1") == ["host2"]

        # The fleet's view of host3 (the last reconcile's, which admission reads) can still say
        # unreachable just after the sweep (once in two runs over the 40 ms WAN, refused as
        # "host host3 is unreachable"; why was not traced): a later pass sees it answer.
        before = c.state.hosts().get("host3")
        faults.wait(lambda: c.state.hosts().get("host3", {}).get("reachable"), 30,
                    f"the fleet never saw host3 again (before the wait: {before})")
        moved = cli("migrate", "local1", "--to", "host3", check_code=0)
        assert "(disk and memory next)" in moved.stdout + moved.stderr
        events = c.state.migrations("local1")[-1]["events"]
        assert any("host3's storage lacks the base image debian-12" in e for e in events), events
        assert any("base image debian-12 sent to host3" in e and debian.sha256[:12] in e
                   for e in events), events
        print("sent:", [e for e in events if "sent to" in e])
        assert copied_sum() == debian.sha256
        assert where(fleet, "local1") == ["host3"] and placed(fleet, "local1") == ["host3"]
        assert data_sum() == written
        cli("migrate", "local1", "--to", "host2", check_code=0)
        assert where(fleet, "local1") == ["host2"] and placed(fleet, "local1") == ["host2"]

        def empty_host3() -> None:  # a fresh tmpfs: host3's storage without the image again
            subprocess.run([*hide, "umount", str(paths.images)], check=True)
            subprocess.run([*hide, "mount", "-t", "tmpfs", "-o", "size=1200m", "tmpfs",
                            str(paths.images)], check=True)
            assert on_host3() == ""

        # The worker SIGKILLed while the image is sent: the copy's lock lapses, and the task's
        # rerun sends it again from the start (the disk that arrived, without its record, is
        # never laid on) and finishes the move, or undoes it; one host runs the VM either way.
        empty_host3()
        task = c.task_of(c.cli("migrate", "local1", "--to", "host3", "--no-wait"))
        soon(lambda: on_host3() != "", "the base image was never being sent")
        time.sleep(2)
        c.kill_worker_of(task)
        lab.up(3)
        faults.wait(lambda: c.task_state(task) in ("SUCCESS", "FAILURE")
                    and not c.state.holder("vm", "local1"), 300, "the move never ended")
        print("base send killed, then:", c.task_state(task), where(fleet, "local1"))
        faults.wait(lambda: len(where(fleet, "local1")) == 1
                    and holders(fleet, "local1") == where(fleet, "local1"), 120,
                    "a disk stayed on a host that does not hold the VM")
        if where(fleet, "local1") == ["host3"]:
            assert copied_sum() == debian.sha256  # sent whole by the rerun
            cli("migrate", "local1", "--to", "host2", check_code=0)
        faults.wait(lambda: fleet.locate("local1").state() == "running", 60, "not running")
        assert where(fleet, "local1") == ["host2"] and data_sum() == written

        empty_host3()  # for the resume below to send it to

        # Suspended with its disk (beside its save, checksummed, on the storage of host2's
        # site, none other's), resumed on a host of another site whose storage lacks the base:
        # it is sent there first, from the host the VM left; the disk and the save image are
        # sent to host3 (checked), and nothing of the save is left on either site after.
        cli("vm", "suspend", "local1", check_code=0)
        kept = site_saves(lab, "site2") / "local1"
        assert (kept / "disk.qcow2").is_file() and (kept / "disk.qcow2").stat().st_mode & 0o077 == 0
        assert (kept / "seed.iso").is_file() and (kept / "seed.iso").stat().st_mode & 0o077 == 0
        assert set(json.loads((kept / "disk.json").read_text())) == {"sha256", "seed_sha256"}
        assert not (paths.saves / "local1").exists()  # the control node sees no site's
        assert c.state.save_of("local1")["record"]["site"] == "site2"
        assert placed(fleet, "local1") == [] and where(fleet, "local1") == []
        cli("vm", "resume", "local1", "--host", "host3", check_code=0)
        assert where(fleet, "local1") == ["host3"] and placed(fleet, "local1") == ["host3"]
        assert not kept.exists() and not sent_image(fleet, "host3", "local1")
        assert not (site_saves(lab, "site3") / "local1").exists()
        assert copied_sum() == debian.sha256
        assert data_sum() == written

        # A worker killed while a suspend keeps the disk beside the save, then one killed while
        # a resume loads it onto its target: recover finishes or undoes each (the sweep takes
        # back a half-loaded copy), and the VM resumes on host3 with what it wrote.
        kept = site_saves(lab, "site3") / "local1"  # host3's site's, where it is saved now
        task = c.task_of(c.cli("vm", "suspend", "local1", "--no-wait"))
        soon(lambda: (kept / "disk.qcow2.partial").exists(), "the disk was never being kept")
        c.kill_worker_of(task)
        print("suspend killed; kept then:", sorted(p.name for p in kept.iterdir()))
        lab.up(3)
        settled(c, fleet)
        assert (kept / "record.json").is_file() and (kept / "disk.json").is_file()
        faults.wait(lambda: holders(fleet, "local1") == [], 60, "the host kept its copy")
        task = c.task_of(c.cli("vm", "resume", "local1", "--host", "host3", "--no-wait"))
        soon(lambda: (kept / "claim.json").exists()
             and local_disks.find(fleet.host("host3").conn, "local1") is not None,
             "the disk was never being loaded")
        c.kill_worker_of(task)
        print("resume killed; kept then:", sorted(p.name for p in kept.iterdir()))
        lab.up(3)
        settled(c, fleet)
        print("resume settled:", where(fleet, "local1"), holders(fleet, "local1"),
              (kept / "record.json").is_file())
        if (kept / "record.json").is_file():  # undone before its restore (or rerun)
            faults.wait(lambda: holders(fleet, "local1") == [], 60,
                        "the half-loaded copy stayed on host3")
            cli("vm", "resume", "local1", "--host", "host3", check_code=0)
        assert where(fleet, "local1") == ["host3"] and placed(fleet, "local1") == ["host3"]
        faults.wait(lambda: fleet.locate("local1").state() == "running", 60, "not running")
        assert data_sum() == written

        # A worker killed while the disk is copied: one host runs it, the disk only there.
        task = c.task_of(c.cli("migrate", "local1", "--to", "host1", "--bandwidth", "10",
                               "--no-wait"))
        faults.wait(lambda: holders(fleet, "local1") == ["host1", "host3"], 60,
                    "no disk was laid on host1")
        c.kill_worker_of(task)
        lab.up(3)
        faults.settle(c, ["local1"], timeout=300)
        faults.wait(lambda: len(holders(fleet, "local1")) == 1, 120,
                    "a disk stayed on a host that does not hold the VM")
        running = where(fleet, "local1")
        assert len(running) == 1 and placed(fleet, "local1") == running
        faults.wait(lambda: (c.state.vm("local1").get("state"), c.state.vm("local1").get("host"))
                    == ("running", running[0]), 60, "the record never agreed")
        assert data_sum() == written

        # The disk phase cut short where the move cannot tidy up after itself: the target's
        # libvirtd killed (restarted as systemd would), then the link to the target cut. The VM
        # runs on where it was, its disk whole; the overlay the move laid on the target stays
        # until it answers again, and the reconcile's sweep removes it then.
        def swept_from(host: str) -> int:
            return sum(e["message"] == f"local1: stray local disk removed from {host}"
                       for e in c.state.events(count=500, vm="local1"))

        for fault in ("libvirtd", "link"):
            source = where(fleet, "local1")[0]
            target = next(h for h in HOSTS if h != source)
            swept_before = swept_from(target)  # (the same target both times)
            task = c.task_of(c.cli("migrate", "local1", "--to", target, "--bandwidth", "5",
                                   "--no-wait"))
            faults.wait(lambda: len(holders(fleet, "local1")) == 2, 60, "no disk was laid")
            time.sleep(2)  # well into the copy (75 MiB at 5 MiB/s)
            if fault == "libvirtd":
                os.kill(c.libvirtd_pid(target), signal.SIGKILL)
            else:
                c.link(False, source=source, target=target)
            try:  # its worker's tidy cannot reach the target: the sweep's to do
                faults.wait(lambda: c.task_state(task) == "FAILURE", 120,
                            f"the migration went on with the {fault} cut")
                said = json.loads(c.state.task(task)["outcome"])
                assert said["error"] == "MigrationFailed", said
                assert f"still running on {source}" in said["message"], said
            finally:
                if fault == "libvirtd":
                    lab.restart_libvirtd(target)
                else:
                    c.link(True, source=source, target=target)
            faults.wait(lambda: holders(fleet, "local1") == [source], 60,
                        f"the disk stayed on {target} after the {fault} came back")
            assert where(fleet, "local1") == [source]
            assert fleet.locate("local1").state() == "running"
            # (the sweep says so once it has let the VM go)
            faults.wait(lambda: swept_from(target) > swept_before, 30, fault)
            assert data_sum() == written

        # The source's libvirtd killed mid-copy, and restarted as systemd would: its QEMU runs
        # on meanwhile; libvirt, back, ends the move it can no longer drive. One host runs the
        # VM, and holds its disk; the other's is swept.
        source = where(fleet, "local1")[0]
        target = next(h for h in HOSTS if h != source)
        task = c.task_of(c.cli("migrate", "local1", "--to", target, "--bandwidth", "5",
                               "--no-wait"))
        faults.wait(lambda: len(holders(fleet, "local1")) == 2, 60, "no disk was laid")
        time.sleep(2)
        os.kill(c.libvirtd_pid(source), signal.SIGKILL)
        time.sleep(2)
        lab.restart_libvirtd(source)
        faults.wait(lambda: c.task_state(task) in ("SUCCESS", "FAILURE"), 300,
                    "the migration never ended")
        faults.settle(c, ["local1"], timeout=300)
        faults.wait(lambda: len(where(fleet, "local1")) == 1
                    and holders(fleet, "local1") == where(fleet, "local1"), 120,
                    "a disk stayed on a host that does not hold the VM")
        running = where(fleet, "local1")
        faults.wait(lambda: fleet.locate("local1").state() == "running", 60, "not running")
        faults.wait(lambda: (c.state.vm("local1").get("state"), c.state.vm("local1").get("host"))
                    == ("running", running[0]), 60, "the record never agreed")
        assert data_sum() == written

        # Stopped, its host reclaimed: the definition and the disk move; it boots there. The
        # reclaim's worker is SIGKILLed while the disk is copied host to host: its rerun (or
        # the sweep) leaves one definition, and the disk only where it is.
        boot = _boot_id(key, address)
        cli("vm", "stop", "local1", check_code=0)
        source = running[0]
        task = c.task_of(c.cli("host", "reclaim", source, "--no-wait"))
        soon(lambda: len(holders(fleet, "local1")) == 2, "the disk was never being copied")
        c.kill_worker_of(task)
        print("reclaim killed; disks on", holders(fleet, "local1"), "defined on",
              where(fleet, "local1"))
        lab.up(3)
        faults.wait(lambda: c.task_state(task) in ("SUCCESS", "FAILURE")
                    and not c.state.holder("vm", "local1"), 300, "the reclaim never ended")
        faults.wait(lambda: len(where(fleet, "local1")) == 1
                    and holders(fleet, "local1") == where(fleet, "local1"), 120,
                    "a disk stayed on a host that does not define the VM")
        print("reclaim settled:", c.task_state(task), where(fleet, "local1"))
        if where(fleet, "local1") == [source]:  # the rerun did not move it: reclaim again
            cli("host", "enable", source, check_code=0)
            report = json.loads(cli("host", "reclaim", source, "--json", check_code=0).stdout)
            assert report["migrated"] == ["local1"] and not report["failed"], report
        [target] = where(fleet, "local1")
        assert target != source and placed(fleet, "local1") == [target]
        assert fleet.locate("local1").state() == "shutoff"  # moved, never booted
        cli("host", "enable", source, check_code=0)
        cli("vm", "start", "local1", check_code=0)
        assert _boot_id(key, address) != boot
        assert data_sum() == written
    finally:
        if hidden:  # lazily: a QEMU there may still have the image open
            subprocess.run(["nsenter", "-t", str(hidden), "-m", "umount", "-l",
                            str(paths.images)])
        for h in HOSTS:
            cli("host", "enable", h)
        cli("vm", "destroy", "local1")
        lab.up(3, sites=1)
        c.state.r.delete("vmmgr:links")  # what the moves measured of the WAN
    assert placed(fleet, "local1") == [] and not (paths.saves / "local1").exists()
    assert not list((lab.root / "sites").glob("*/saves/local1"))
    assert os_images.verify(paths.images, "debian-12") == debian  # the base was never written
