"""OS images for real: `vmmgr image build debian-12` from Debian's packages (cached), imports (a
damaged file refused with nothing left behind), and VMs from the image: booting with their own
bootloader and kernel, logging in, moving, stopping, starting, rebooting and hibernating with
nothing they wrote lost; the training demo, shortened."""

import json
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from vmmgr import console, local_disks, os_images, seed
from vmmgr.addresses import pool_for
from vmmgr.lab_net import CLIENT_NS

from .conftest import VMMGR, cli, consoles
from .test_faults import faults

BOOT_TIMEOUT_S = 600  # TCG: Debian's kernel, systemd and cloud-init's first boot take minutes


@pytest.fixture(scope="module")
def debian(paths):
    """The built image (the first run in a home builds it: several minutes)."""
    proc = cli("image", "build", "debian-12", check_code=0)
    assert "sha256" in proc.stdout
    return os_images.get(paths.images, "debian-12")


def test_the_build_is_cached_and_checksummed(paths, debian):
    started = time.monotonic()
    again = cli("image", "build", "debian-12", check_code=0)
    assert "up to date" in again.stderr and time.monotonic() - started < 30
    assert os_images.get(paths.images, "debian-12") == debian  # not rebuilt
    listed = json.loads(cli("image", "list", "--json", check_code=0).stdout)
    assert [i for i in listed if i["name"] == "debian-12"] == [debian.as_dict()]
    assert debian.recipe and debian.virtual_size == 3 * 2**30
    cli("image", "verify", "debian-12", check_code=0)


def test_import_takes_a_real_image_and_refuses_a_damaged_one(paths, debian, tmp_path):
    source = tmp_path / "cloud.qcow2"
    subprocess.run(["cp", "--sparse=always", str(os_images.disk_path(paths.images, "debian-12")),
                    str(source)], check=True)
    try:
        imported = cli("image", "import", "copy-of-debian", str(source), check_code=0)
        assert "sha256" in imported.stdout
        copy = os_images.get(paths.images, "copy-of-debian")
        assert copy.virtual_size == debian.virtual_size
        assert copy.source == "import of cloud.qcow2 (qcow2)"
        taken = cli("image", "import", "copy-of-debian", str(source), check_code=4)
        assert "exists" in taken.stderr

        with source.open("r+b") as f:  # its L1 table's offset, past the end of the file
            f.seek(40)
            f.write((1 << 50).to_bytes(8, "big"))
        damaged = cli("image", "import", "damaged", str(source), check_code=2)
        assert "cloud.qcow2" in damaged.stderr and "damaged" not in [
            i.name for i in os_images.list_images(paths.images)]
        assert not [p for p in os_images.root(paths.images).iterdir() if p.name.startswith(".")]
        unknown = cli("image", "remove", "no-such-image", check_code=3)
        assert "unknown image 'no-such-image'" in unknown.stderr
    finally:
        cli("image", "remove", "copy-of-debian")
    assert "copy-of-debian" not in [i.name for i in os_images.list_images(paths.images)]


def _ssh(key, address, command, timeout=60):
    """ssh to the VM's stable address from the lab's outside client, through the edge."""
    return subprocess.run(
        ["ip", "netns", "exec", CLIENT_NS, "ssh", "-i", str(key), "-o", "BatchMode=yes",
         "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
         "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR", f"{seed.USER}@{address}", command],
        capture_output=True, text=True, timeout=timeout)


def _wait_console(paths, vm, text, timeout=BOOT_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = console.read(consoles(paths), vm).decode(errors="replace")
        if text in seen:
            return seen
        time.sleep(3)
    raise AssertionError(f"{text!r} not on {vm}'s console in {timeout} s:\n{seen[-3000:]}")


def _boot_id(key, address):
    """The guest kernel's boot id once SSH answers (a new one after every boot)."""
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            proc = _ssh(key, address, "cat /proc/sys/kernel/random/boot_id", timeout=30)
        except subprocess.TimeoutExpired:
            continue
        if proc.returncode == 0:
            return proc.stdout.strip()
        time.sleep(3)
    raise AssertionError(f"no SSH on {address} in {BOOT_TIMEOUT_S} s")


WRITER = ("i=0; while [ ! -e stop ]; do head -c 1048576 /dev/urandom > chunk.$i; "
          "sha256sum chunk.$i >> sums; i=$((i+1)); sleep 0.3; done; sync; touch stopped")


def test_a_vm_from_the_image_logs_in_loses_nothing_and_stops_starts_and_reboots(
        lab, fleet, paths, debian, make_vm, tmp_path):
    """It boots the image with its own bootloader and Debian's kernel; its key, name and /32
    address come from the seed; a stream of checksummed files written while it is migrated
    three times and suspended and resumed once is all intact after `vm reboot`, with no
    filesystem error. Then the lifecycle: a clean stop keeps it (shut off, on its host, its disk
    and address kept); a reclaim moves the stopped VM's definition, not a running copy; start
    boots it where it now is, with what it wrote. Requests its state does not allow are refused
    with nothing changed."""
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    cli("vm", "create", "disk1", "--image", "debian-12", "--memory", "512", "--host", "host1",
        "--ssh-key", f"{key}.pub", check_code=0)
    make_vm("life2", host="host3")  # the built-in guest: no OS to ask to stop
    try:
        assert fleet.system_disk_path("disk1").is_file() and fleet.seed_path("disk1").is_file()
        booted = _wait_console(paths, "disk1", "finished at")  # cloud-init's last stage
        # BIOS -> MBR -> extlinux -> Debian's own cloud kernel -> systemd -> a serial getty
        assert "Linux version" in booted and "cloud-amd64" in booted and "systemd" in booted
        address = pool_for(paths).address_of("disk1")
        first = _ssh(key, address, f"hostname; ip -4 -o addr show eth0; "
                     f"nohup sh -c '{WRITER}' >/dev/null 2>&1 &")
        assert first.returncode == 0, first.stderr
        lines = first.stdout.splitlines()
        assert lines[0] == "disk1" and f"inet {address}/32" in lines[1]
        # `vm ssh`: the same login from the CLI, the VM's host key pinned from its console
        logged = cli("vm", "ssh", "disk1", "-i", str(key), "--", "hostname", "&&", "id", "-un",
                     check_code=0)
        assert logged.stdout.split() == ["disk1", seed.USER]
        assert address in (paths.home / "known_hosts" / "disk1").read_text()
        assert "unknown VM 'nodisk'" in cli("vm", "ssh", "nodisk", check_code=3).stderr

        for target in ("host2", "host3"):
            cli("migrate", "disk1", "--to", target, check_code=0)
        cli("vm", "suspend", "disk1", check_code=0)
        cli("vm", "resume", "disk1", "--host", "host1", check_code=0)
        cli("migrate", "disk1", "--to", "host2", check_code=0)
        assert fleet.locate("disk1").host_name == "host2"

        verify = ("touch stop; while [ ! -e stopped ]; do sleep 0.5; done; "
                  "sha256sum -c --quiet sums && wc -l < sums")
        written = _ssh(key, address, verify)
        assert written.returncode == 0, written.stdout + written.stderr
        chunks = int(written.stdout.split()[-1])
        assert chunks >= 10, written.stdout  # it wrote through the moves

        boot = _boot_id(key, address)
        cli("vm", "reboot", "disk1", check_code=0)
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while (rebooted := _boot_id(key, address)) == boot:
            assert time.monotonic() < deadline, "the VM did not reboot"
            time.sleep(3)
        check = ("sha256sum -c --quiet sums && wc -l < sums; "
                 "sudo journalctl -k -b | grep -ci 'ext4-fs error' || true")
        after = _ssh(key, address, check, timeout=120)
        assert after.returncode == 0, after.stdout + after.stderr
        assert after.stdout.split() == [str(chunks), "0"]

        assert "disk1 stopped on host2" in cli("vm", "stop", "disk1", check_code=0).stdout
        listed = {v["name"]: v for v in json.loads(cli("vm", "list", "--json").stdout)}
        assert (listed["disk1"]["host"], listed["disk1"]["state"]) == ("host2", "shutoff")
        for args, message in ((["vm", "stop", "disk1"], "stop needs it running"),
                              (["vm", "reboot", "disk1"], "reboot needs it running"),
                              (["vm", "ssh", "disk1", "--", "true"], "is not running"),
                              (["migrate", "disk1", "--to", "host1"], "is stopped on host2"),
                              (["vm", "suspend", "disk1"], "is stopped on host2"),
                              (["vm", "stop", "life2"], "built-in counter guest"),
                              (["vm", "start", "life2"], "start needs it shutoff"),
                              (["vm", "stop", "ghost"], "unknown VM 'ghost'")):
            proc = cli(*args)
            assert proc.returncode in (3, 4) and message in proc.stderr, (args, proc.stderr)
        assert [g.state() for g in fleet.find_all("disk1")] == ["shutoff"]

        report = json.loads(cli("host", "reclaim", "host2", "--json", check_code=0).stdout)
        assert report["migrated"] == ["disk1"] and not report["failed"], report
        copies = fleet.find_all("disk1")
        assert len(copies) == 1 and copies[0].host_name != "host2"
        assert copies[0].state() == "shutoff"  # moved as it was: nothing booted
        cli("host", "enable", "host2", check_code=0)

        started = cli("vm", "start", "disk1", check_code=0)
        assert f"disk1 running on {copies[0].host_name}" in started.stdout
        assert _boot_id(key, address) not in (boot, rebooted)
        again = _ssh(key, address, check, timeout=120)
        assert again.stdout.split() == [str(chunks), "0"], again.stdout + again.stderr
    finally:
        cli("host", "enable", "host2")
        cli("vm", "destroy", "disk1")
        cli("vm", "destroy", "life2")
    assert not any(p.exists() for p in fleet.vm_files("disk1"))
    assert os_images.verify(paths.images, "debian-12") == debian  # the image was never written


def test_bad_requests_for_a_vm_from_an_image_create_nothing(lab, fleet, paths, debian, tmp_path):
    key = tmp_path / "key.pub"
    key.write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBadBadBadBadBadBadBadBadBadBadBadBadBad0 t\n")
    unreadable = tmp_path / "missing.pub"
    cases = [
        (["--image", "no-such-image"], 3, "unknown image 'no-such-image'"),
        (["--image", "debian-12", "--disk-size", "1"], 2, "needs at least 3 GiB"),
        (["--image", "debian-12", "--ssh-key", str(unreadable)], 2, "cannot read the SSH key"),
        (["--image", "debian-12", "--ssh-key", str(tmp_path)], 2, "cannot read the SSH key"),
        (["--image", "debian-12", "--user-data", str(key)], 2, "must start with #cloud-config"),
        (["--image", "debian-12", "--workload", "counter"], 2, "either --image"),
    ]
    for args, code, message in cases:
        proc = cli("vm", "create", "bad1", "--memory", "512", *args, check_code=code)
        assert message in proc.stderr, (args, proc.stderr)
    assert fleet.find("bad1") is None and not any(p.exists() for p in fleet.vm_files("bad1"))


def test_a_disk_backed_vm_whose_worker_dies_mid_migration_ends_on_one_host_with_its_disk(
        lab, fleet, paths, debian, tmp_path):
    """The worker running its migration is SIGKILLed: once the lab is repaired and the fleet has
    settled, the VM runs on exactly one host, its record says where, and what it wrote before
    is on its disk."""
    c = faults.Lab3(lab, paths)
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    cli("vm", "create", "disk2", "--image", "debian-12", "--memory", "512", "--host", "host1",
        "--ssh-key", f"{key}.pub", check_code=0)
    try:
        _wait_console(paths, "disk2", "finished at")
        address = pool_for(paths).address_of("disk2")
        wrote = _ssh(key, address, "head -c 8388608 /dev/urandom > data; sync; sha256sum data")
        assert wrote.returncode == 0, wrote.stderr
        task = c.task_of(c.cli("migrate", "disk2", "--to", "host2", "--bandwidth", "20",
                               "--no-wait"))
        faults.wait(lambda: c.state.vm("disk2").get("state") == "migrating", 60,
                    "no migration began")
        time.sleep(1)
        c.kill_worker_of(task)
        lab.up(3)
        faults.settle(c, ["disk2"], timeout=300)
        copies = fleet.find_all("disk2")
        running = [g for g in copies if g.is_active() and g.state() == "running"]
        assert len(running) == 1 and len(copies) == 1, [f"{g.host_name}:{g.state()}"
                                                         for g in copies]
        faults.wait(lambda: (c.state.vm("disk2").get("state"), c.state.vm("disk2").get("host"))
                    == ("running", running[0].host_name), 60, "the record never agreed")
        after = _ssh(key, address, "sha256sum data")
        assert after.returncode == 0 and after.stdout == wrote.stdout, after.stdout + after.stderr
    finally:
        cli("vm", "destroy", "disk2")


def test_the_training_demo_moved_four_times_ends_with_bit_identical_losses(
        lab, fleet, paths, debian, tmp_path):
    """`vmmgr demo training`, shortened and across sites: two VMs train data-parallel over TCP
    while they are moved 4 times between three sites (each host its own, a WAN between them),
    their disks on their hosts' own storage and copied by every move (one move a reclaim with
    no room anywhere: suspended to disk with its disk, resumed by the fleet when room returns),
    an SSH session following the log throughout; their losses equal, bit for bit, those of a
    pair that never moved. Nothing is left behind, on storage or on any host's own."""
    plot = tmp_path / "losses.png"
    scratch = set(Path(tempfile.gettempdir()).glob("vmmgr-training-*"))
    proc = subprocess.run([VMMGR, "demo", "training", "--moves", "4", "--steps", "250",
                           "--sites", "3", "--local-disk", "--plot", str(plot)],
                          capture_output=True, text=True, timeout=1800)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert "3 hosts in 3 sites" in out and "disks on their hosts' own storage" in out
    assert "losses BIT-IDENTICAL after 4 moves" in out
    assert "losses: 250 steps moved, 250 never moved" in out
    assert "SSH session to train-a: held through every move" in out
    moves = [line.split() for line in out.splitlines()
             if line.startswith(("train-a ", "train-b "))]
    assert len(moves) == 4 and {m[1] for m in moves} == {"live", "reclaim"}, out
    assert {m[3] for m in moves} | {m[2] for m in moves} == {"host1", "host2", "host3"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for vm in ("train-a", "train-b", "still-a", "still-b", "filler-host1", "filler-host2"):
        assert fleet.find(vm) is None and not fleet.is_suspended(vm), vm
        assert not [h for h in fleet.hosts() if local_disks.find(h.conn, vm)], vm
    hosts = json.loads(cli("host", "list", "--json").stdout)
    assert {h["state"] for h in hosts} == {"active"}, hosts
    assert {h["site"] for h in hosts} == {""}, hosts  # the lab's one site again
    assert set(Path(tempfile.gettempdir()).glob("vmmgr-training-*")) == scratch  # its SSH key


def test_a_vm_from_the_image_with_a_device_moves_by_hibernating_into_its_own_kernel(
        lab, fleet, paths, debian, tmp_path):
    """A VM from debian-12 holding a (stand-in) GPU cannot be live-migrated. A reclaim of its
    host asks Debian's qemu-guest-agent to hibernate it into its swap disk, then boots it on the
    other host with a device, where the image's initramfs restores it: the same kernel session
    (its boot id), the process it ran still running and counting on, its device at the same
    guest PCI address."""
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    cli("vm", "create", "hib1", "--image", "debian-12", "--memory", "384", "--gpu", "lab-gpu",
        "--host", "host1", "--ssh-key", f"{key}.pub", check_code=0)
    look = ("cat /proc/sys/kernel/random/boot_id; kill -0 $(cat counter.pid) && echo alive; "
            "cat count; grep -l 0x1110 /sys/bus/pci/devices/*/device; "
            "awk 'NR > 1 { print $1 }' /proc/swaps")  # 0x1110: ivshmem, the stand-in's id
    try:
        _wait_console(paths, "hib1", "finished at")
        address = pool_for(paths).address_of("hib1")
        started = _ssh(key, address, "nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > count; "
                       "sleep 0.5; done' >/dev/null 2>&1 & echo $! > counter.pid; sleep 2; " + look)
        assert started.returncode == 0, started.stderr
        boot_id, alive, count, device, swap = started.stdout.split()
        assert alive == "alive" and device == "/sys/bus/pci/devices/0000:00:10.0/device"
        assert swap.startswith("/dev/vd")  # the seed's bootcmd made the swap disk swap

        report = json.loads(cli("host", "reclaim", "host1", "--json", check_code=0).stdout)
        assert report["hibernated"] == ["hib1"] and not report["failed"], report
        assert [g.host_name for g in fleet.find_all("hib1")] == ["host2"]
        _wait_console(paths, "hib1", "vmmgr: resuming from the hibernation image", timeout=60)
        after = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            after = _ssh(key, address, look, timeout=60)
            if after.returncode == 0:
                break
            time.sleep(3)
        assert after.returncode == 0, after.stderr
        boot_id2, alive2, count2, device2, swap2 = after.stdout.split()
        assert boot_id2 == boot_id, "it booted anew instead of resuming"
        assert alive2 == "alive" and int(count2) > int(count)
        assert device2 == device and swap2 == swap
    finally:
        cli("host", "enable", "host1")
        cli("vm", "destroy", "hib1")
    assert not any(p.exists() for p in fleet.vm_files("hib1"))
