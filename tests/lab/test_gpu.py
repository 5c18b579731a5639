"""VMs with a passed-through device (the lab's stand-in GPU: an ivshmem device in peer role, one
on host1, one on host2, none on host3) are never live-migrated: they move by guest hibernation —
the guest agent is asked to hibernate, the guest writes its memory to its swap disk on shared
storage and powers off, and the VM boots on a host with a free equivalent device, where its
kernel restores the image. The counter must continue exactly: no gap, no repeat."""

import json
import time

import pytest

from vmmgr import overview
from vmmgr.lab import LAB_GPU_MODEL
from vmmgr.state import FleetState
from vmmgr.suspend import find_suspended

from .conftest import assert_contiguous, cli, ticks, wait_ticks, where_defined

GPU_VM_MIB = 256  # hibernating needs room for the image's copy: 128 MiB is too tight here


@pytest.fixture
def gpu_vm(make_vm, fleet, paths):
    def make(name, host, **params):
        make_vm(name, host=host, memory=GPU_VM_MIB, gpu=LAB_GPU_MODEL, **params)
        wait_ticks(paths, name, 5)
        if params.get("agent") != "off":
            until(lambda: "state='connected'" in fleet.locate(name).xml(), 60,
                  f"{name}'s guest agent never connected")
    return make


@pytest.fixture
def host1_back(lab):
    yield
    cli("host", "enable", "host1", check_code=0)


def until(check, timeout, what):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def moves_by(fleet, vm) -> dict:
    return next(r for r in overview.vm_rows(fleet) if r["name"] == vm)["moves_by"]


def test_reclaim_moves_a_gpu_vm_by_guest_hibernation(gpu_vm, fleet, paths, host1_back):
    gpu_vm("gpu1", "host1")
    how = moves_by(fleet, "gpu1")
    assert how["mode"] == "guest hibernation" and "on host2" in how["reason"]
    assert "guest hibernation" in cli("vm", "show", "gpu1", check_code=0).stdout
    # Asked to live-migrate, it is refused before anything starts.
    proc = cli("migrate", "gpu1", "--to", "host2")
    assert proc.returncode == 4 and "cannot be live-migrated" in proc.stderr

    report = json.loads(cli("host", "reclaim", "host1", "--json", check_code=0).stdout)
    assert report["hibernated"] == ["gpu1"] and report["migrated"] == []
    assert report["failed"] == {} and report["suspended"] == []
    assert where_defined(fleet, "gpu1") == ["host2"]
    assert fleet.locate("gpu1").state() == "running"
    assert FleetState(paths.redis_url()).migrations("gpu1") == []  # no live migration tried
    seen = len(ticks(paths, "gpu1"))
    wait_ticks(paths, "gpu1", seen + 5, timeout=90)
    assert_contiguous(ticks(paths, "gpu1"))  # carried on where it stopped, on host2
    assert ticks(paths, "gpu1")[0] == 0


def test_no_free_device_parks_the_vm_until_one_frees(gpu_vm, fleet, paths, host1_back):
    gpu_vm("gpu2", "host1")
    gpu_vm("holder", "host2")  # the only other device
    report = json.loads(cli("host", "reclaim", "host1", "--json", check_code=0).stdout)
    assert report["suspended"] == ["gpu2"] and report["hibernated"] == []
    parked = find_suspended(fleet, "gpu2")
    assert parked.mode == "guest" and parked.parked and parked.device_model == LAB_GPU_MODEL
    assert where_defined(fleet, "gpu2") == []  # not running anywhere, not lost: on storage
    before = ticks(paths, "gpu2")
    time.sleep(6)  # a reconcile passes: still no device, still parked
    assert find_suspended(fleet, "gpu2") is not None and ticks(paths, "gpu2") == before

    fleet.destroy("holder")  # host2's device frees: beat's reconcile resumes gpu2 there
    until(lambda: where_defined(fleet, "gpu2") == ["host2"], 90, "gpu2 was not resumed")
    wait_ticks(paths, "gpu2", len(before) + 5, timeout=90)
    assert_contiguous(ticks(paths, "gpu2"))


def test_a_silent_guest_agent_fails_clearly_and_the_vm_keeps_running(gpu_vm, fleet, paths,
                                                                     host1_back):
    gpu_vm("mute", "host1", agent="off")
    proc = cli("vm", "suspend", "mute")
    assert proc.returncode == 6, proc.stderr
    assert "mute did not hibernate" in proc.stderr and "not connected" in proc.stderr
    assert "it keeps running on host1" in proc.stderr
    # Reclaim cannot move it either: it is reported, and left running where it was.
    report = json.loads(cli("host", "reclaim", "host1", "--json").stdout)
    assert "did not hibernate" in report["failed"]["mute"]
    assert where_defined(fleet, "mute") == ["host1"]
    assert fleet.locate("mute").state() == "running"
    assert find_suspended(fleet, "mute") is None
    seen = len(ticks(paths, "mute"))
    wait_ticks(paths, "mute", seen + 3)
    assert_contiguous(ticks(paths, "mute"))


def test_an_image_that_does_not_restore_is_reported_lost_not_resumed(gpu_vm, fleet, paths):
    """Before: the guest booted afresh from a hibernation image its kernel could not use, and
    the resume said "resumed", its memory lost in silence."""
    gpu_vm("lostimg", "host1")
    cli("vm", "suspend", "lostimg", check_code=0)
    done = json.loads(cli("vm", "resume", "lostimg", "--host", "host2", "--json",
                          check_code=0).stdout)
    assert done["restored"] is True  # its first line on host2 is the counter going on
    until(lambda: fleet.locate("lostimg").agent_connected(), 60, "the agent did not come back")

    cli("vm", "suspend", "lostimg", check_code=0)
    before = ticks(paths, "lostimg")
    assert_contiguous(before)  # the first move lost nothing
    # The swap header's signature back to a plain swap area's: the kernel finds no image.
    with open(fleet.swap_disk_path("lostimg"), "r+b") as disk:
        disk.seek(4096 - 10)
        assert disk.read(10).rstrip(b"\0") == b"S1SUSPEND"  # hibernated: the kernel's mark
        disk.seek(4096 - 10)
        disk.write(b"SWAPSPACE2")
    proc = cli("vm", "resume", "lostimg", "--host", "host1")
    assert proc.returncode == 1, proc.stderr
    assert "its hibernation image did not restore" in proc.stderr
    assert "what it had in memory is lost" in proc.stderr
    assert where_defined(fleet, "lostimg") == ["host1"]  # it runs: never left stopped
    assert fleet.locate("lostimg").state() == "running"
    wait_ticks(paths, "lostimg", len(before) + 3, timeout=90)
    assert ticks(paths, "lostimg")[len(before)] == 0  # counting again from the start
    events = [e for e in FleetState(paths.redis_url()).events(50, vm="lostimg")
              if "did not restore" in e["message"]]
    assert any(e["kind"] == "error" for e in events), events
