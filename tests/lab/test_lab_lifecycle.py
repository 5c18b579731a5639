"""The lab itself: hosts that are really separate, idempotent up, repair, and a clean down.

Runs before the other lab tests (file order) with its own two-host lab.
"""

import os
import subprocess

import libvirt
import pytest

from vmmgr.lab import GUEST_BRIDGE, GUEST_GATEWAY_MAC, Lab, lab_host

from .conftest import cli, wait_ticks


def lab_leftovers() -> list[str]:
    out = []
    out += [l for l in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
            .stdout.splitlines() if l.startswith("vmmgr-")]
    out += [l for l in subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                                      text=True).stdout.splitlines() if ": vmmgr-" in l]
    for name in ("libvirtd", "qemu-system-x86", "wireguard-go", "redis-server", "celery"):
        for line in subprocess.run(["pgrep", "-af", name], capture_output=True, text=True).stdout.splitlines():
            if not is_zombie(int(line.split()[0])):  # dead, waiting for PID 1 to reap it
                out.append(line)
    return out


def is_zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True  # gone already


@pytest.fixture
def small_lab(paths):
    lab = Lab(paths)
    lab.down()
    try:
        yield lab
    finally:
        lab.down()


def test_lab_up_status_repair_and_down(small_lab, paths):
    records = small_lab.up(2)
    assert [r.name for r in records] == ["host1", "host2"]
    assert records[0].accel in ("kvm", "tcg")

    # Each host is its own machine: hostname, host UUID, libvirtd; same guest gateway everywhere.
    uuids, hostnames = set(), set()
    for r in records:
        conn = libvirt.open(r.uri)
        try:
            hostnames.add(conn.getHostname())
            uuids.add(conn.getCapabilities().split("<uuid>")[1].split("</uuid>")[0])
        finally:
            conn.close()
        link = subprocess.run(["ip", "-n", f"vmmgr-{r.name}", "-o", "addr", "show", GUEST_BRIDGE],
                              capture_output=True, text=True, check=True).stdout
        assert "10.78.0.1/32" in link
        mac = subprocess.run(["ip", "-n", f"vmmgr-{r.name}", "-o", "link", "show", GUEST_BRIDGE],
                             capture_output=True, text=True, check=True).stdout
        assert GUEST_GATEWAY_MAC in mac
    assert hostnames == {"host1", "host2"} and len(uuids) == 2

    status = cli("lab", "status", "--json", check_code=0).stdout
    assert status.count('"reachable": true') == 2

    # Idempotent: a second `up` keeps the same daemons.
    pids = [s.libvirtd_pid for s in small_lab.status()]
    small_lab.up(2)
    assert [s.libvirtd_pid for s in small_lab.status()] == pids

    # A VM, then a crashed daemon: `up` repairs the broken host only.
    cli("vm", "create", "life1", "--host", "host1", check_code=0)
    wait_ticks(paths, "life1", 2)
    os.kill(pids[1], 9)
    assert not small_lab.status()[1].reachable
    small_lab.up(2)
    after = small_lab.status()
    assert after[0].libvirtd_pid == pids[0] and after[0].vms == 1
    assert after[1].reachable and after[1].libvirtd_pid != pids[1]

    # Down removes every namespace, link, daemon and QEMU process, even with a VM running.
    cli("lab", "down", check_code=0)
    assert lab_leftovers() == []
    assert cli("lab", "status").stdout.strip() == "the lab is down"


def test_down_cleans_up_after_a_crashed_run(small_lab):
    """A namespace and link left without any state file are found by their prefix."""
    h = lab_host(7)
    subprocess.run(["ip", "netns", "add", h.namespace], check=True)
    subprocess.run(["ip", "link", "add", h.namespace, "type", "veth", "peer", "name", "eth0",
                    "netns", h.namespace], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", h.namespace, "sleep", "300"])
    try:
        small_lab.down()
        assert lab_leftovers() == []
        assert sleeper.wait(10) != 0  # killed with the namespace
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
