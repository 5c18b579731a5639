"""The lab itself: hosts that are really separate, idempotent up, repair, and a clean down.

Runs before the other lab tests (file order) with its own two-host lab.
"""

import json
import os
import socket
import subprocess
import sys
import threading

import libvirt
import pytest

from vmmgr.lab import (GUEST_BRIDGE, GUEST_GATEWAY_MAC, HOST_SYSCTLS, Lab, host_mac,
                       lab_host)
from vmmgr.lab_net import EDGE_MAC, EDGE_NS

from .conftest import cli, wait_ticks


SERVICES = ("libvirtd", "qemu-system-x86", "wireguard-go", "redis-server", "celery")


def service_pids() -> set[int]:
    """Every live process of the kinds the lab starts, the lab's or not."""
    pids = set()
    for name in SERVICES:
        for line in subprocess.run(["pgrep", "-f", name], capture_output=True,
                                   text=True).stdout.split():
            if not is_zombie(int(line)):  # dead, waiting for PID 1 to reap it
                pids.add(int(line))
    return pids


def lab_leftovers(before: set[int]) -> list[str]:
    """What the lab made and left: its namespaces and links, and any service process that was
    not running before it started (the machine's own Redis or libvirtd are not the lab's)."""
    out = []
    out += [l for l in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
            .stdout.splitlines() if l.startswith("vmmgr-")]
    out += [l for l in subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                                      text=True).stdout.splitlines() if ": vmmgr-" in l]
    for pid in service_pids() - before:
        try:
            out.append(f"{pid} " + open(f"/proc/{pid}/cmdline").read().replace("\0", " "))
        except OSError:
            continue  # it ended meanwhile
    return out


def nic_mac(namespace: str) -> str:
    """The MAC of a lab machine's NIC on the management network."""
    out = subprocess.run(["ip", "-j", "-n", namespace, "link", "show", "eth0"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]["address"]


def connects(namespace: str, ip: str, port: int = 16514, timeout: float = 3) -> bool:
    """Whether a TCP connect from `namespace` to ip:port (a host's libvirtd) completes at once."""
    code = f"import socket; socket.create_connection(({ip!r}, {port}), {timeout}).close()"
    return subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", code],
                          capture_output=True).returncode == 0


def is_zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True  # gone already


@pytest.fixture
def small_lab(paths):
    lab = Lab(paths)
    lab.down()
    lab.services_before = service_pids()
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
    assert [nic_mac(f"vmmgr-{r.name}") for r in records] == [host_mac(1), host_mac(2)]
    assert nic_mac(EDGE_NS) == EDGE_MAC
    for r in records:  # as the kvm_host role sets them (tests/unit/test_host_sysctls.py)
        for key, value in HOST_SYSCTLS.items():
            seen = subprocess.run(["ip", "netns", "exec", f"vmmgr-{r.name}", "sysctl", "-n", key],
                                  capture_output=True, text=True, check=True).stdout
            assert seen.split() == value.split(), key

    status = cli("lab", "status", "--json", check_code=0).stdout
    assert status.count('"reachable": true') == 2

    # Idempotent: a second `up` keeps the same daemons.
    pids = [s.libvirtd_pid for s in small_lab.status()]
    small_lab.up(2)
    assert [s.libvirtd_pid for s in small_lab.status()] == pids

    # A VM, then a crashed daemon: `up` repairs the broken host only.
    cli("vm", "create", "life1", "--host", "host1", check_code=0)
    wait_ticks(paths, "life1", 2)
    assert connects("vmmgr-host1", "10.77.0.12")  # host1 has host2's NIC in its ARP cache now
    os.kill(pids[1], 9)
    assert not small_lab.status()[1].reachable
    small_lab.up(2)
    after = small_lab.status()
    assert after[0].libvirtd_pid == pids[0] and after[0].vms == 1
    assert after[1].reachable and after[1].libvirtd_pid != pids[1]
    # Rebuilt with the NIC address it had: host1, which still has that address cached, reaches
    # it at once (a new random one was unreachable from there for 31 s or more).
    assert nic_mac("vmmgr-host2") == host_mac(2)
    assert connects("vmmgr-host1", "10.77.0.12")

    # Down removes every namespace, link, daemon and QEMU process, even with a VM running.
    cli("lab", "down", check_code=0)
    assert lab_leftovers(small_lab.services_before) == []
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
        assert lab_leftovers(small_lab.services_before) == []
        assert sleeper.wait(10) != 0  # killed with the namespace
    finally:
        if sleeper.poll() is None:
            sleeper.kill()


def test_the_lab_lives_beside_the_machines_own_services(small_lab, paths, tmp_path):
    """A Debian machine with libvirt-daemon-system and redis-server installed runs a libvirtd
    and a Redis of its own (and maybe VMs): the lab leaves them, and what they hold, alone."""
    system_redis = subprocess.Popen(
        ["redis-server", "--port", "6379", "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    system_qemu = subprocess.Popen(  # a VM the lab did not start
        ["qemu-system-x86_64", "-machine", "none", "-nodefaults", "-display", "none", "-S"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # A fleet's files in another home: the lab's down must not touch them.
    other = paths.home.parent / "vmmgr-test-other-fleet"
    parked = other / "storage" / "saves" / "prodvm"
    parked.mkdir(parents=True, exist_ok=True)
    (parked / "record.json").write_text('{"from_host": "kvm7"}')
    try:
        before = small_lab.services_before | {system_redis.pid, system_qemu.pid}
        small_lab.up(1)
        cli("vm", "create", "beside1", "--host", "host1", check_code=0)
        wait_ticks(paths, "beside1", 2)
        # A home that belongs to another fleet's store is refused, and left as it was.
        (other / "redis.url").write_text("redis://127.0.0.1:6379/0\n")
        proc = cli("--home", str(other), "lab", "up", "--hosts", "1")
        assert proc.returncode == 1 and "needs a home of its own" in proc.stderr, proc.stderr
        small_lab.down()
        assert system_redis.poll() is None and system_qemu.poll() is None
        assert lab_leftovers(before) == []
        assert (parked / "record.json").exists()
        assert not list(paths.consoles.glob("beside1@*"))  # the lab's own VM left nothing
        assert (other / "redis.url").read_text().strip() == "redis://127.0.0.1:6379/0"
    finally:
        for proc in (system_redis, system_qemu):
            proc.kill()
            proc.wait(10)
        subprocess.run(["rm", "-rf", str(other)], check=False)


class Capture:
    """Every TCP payload byte between two addresses seen on one interface of the root namespace
    (AF_PACKET): what a snooper on the network between two hosts would see of their traffic."""

    def __init__(self, ifname: str, between: tuple[str, str]):
        self.between = {socket.inet_aton(a) for a in between}
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 256 * 1024 * 1024)  # SO_RCVBUFFORCE
        self.sock.bind((ifname, 0))
        self.sock.settimeout(0.2)
        self.data = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self.sock.recv(262144)
            except socket.timeout:
                continue
            if len(frame) < 54 or frame[12:14] != b"\x08\x00" or frame[23] != 6:
                continue  # IPv4 TCP only
            if {frame[26:30], frame[30:34]} != self.between:
                continue  # e.g. the control plane's Redis: not the hosts' own traffic
            ip_len = (frame[14] & 0x0F) * 4
            tcp = 14 + ip_len
            payload = frame[tcp + (frame[tcp + 12] >> 4) * 4:]
            self.data += payload

    def stop(self) -> bytes:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        return bytes(self.data)


def _captured_migration(lab: Lab, paths, vm: str, marker: str) -> bytes:
    from vmmgr.fleet import Fleet
    from vmmgr.migration import migrate
    from vmmgr.policy import get_policy

    cli("vm", "create", vm, "--host", "host1", "--param", f"interval={marker}", check_code=0)
    wait_ticks(paths, vm, 2)
    # host1's link to the inter-host network; host1 <-> host2 carries libvirt's peer-to-peer
    # connection and QEMU's migration stream.
    capture = Capture("vmmgr-host1", (lab_host(1).ip, lab_host(2).ip))
    try:
        with Fleet(paths) as fleet:  # slowed, so that the capture keeps up with the stream
            migrate(fleet, vm, "host2", policy=get_policy(None, 48))
    finally:
        seen = capture.stop()
    cli("vm", "destroy", vm, check_code=0)
    return seen


def test_migration_streams_are_encrypted_unless_plain_tcp_is_asked_for(small_lab, paths):
    """A known string from the guest's memory (its kernel command line) crosses the wire in
    clear text with the plain opt-in, and never over TLS, where the lab's hosts have the
    kvm_host role's configuration (migrate_tls_force) and a migration without TLS is refused."""
    marker = "0.2137"
    secret = f"vmmgr.workload=counter vmmgr.interval={marker}".encode()

    small_lab.up(2, plain=True)
    plain = _captured_migration(small_lab, paths, "clear1", marker)
    assert len(plain) > 20 * 2**20, "the capture did not see the migration stream"
    assert secret in plain

    records = small_lab.up(2)  # TLS, the default: every host set up anew
    assert all(r.uri.startswith("qemu+tls://") and r.tls for r in records)
    tls = _captured_migration(small_lab, paths, "secret1", marker)
    assert len(tls) > 20 * 2**20, "the capture did not see the migration stream"
    # The stream's header: QEMU's magic and version (savevm.c). The magic alone, 4 bytes, turns
    # up by chance in about 1 of 40 captures of this much ciphertext (it did once).
    header = b"QEVM\x00\x00\x00\x03"
    print(f"\nTLS proof: plain TCP {len(plain) / 2**20:.1f} MiB seen between host1 and host2, "
          f"the guest's string {plain.count(secret)} times, the header {plain.count(header)} "
          f"times; TLS {len(tls) / 2**20:.1f} MiB, the string {tls.count(secret)} times, the "
          f"header {tls.count(header)} times")
    assert secret not in tls  # no guest memory
    assert header in plain and header not in tls  # not even the stream's header

    # The hosts run the production qemu.conf: a migration without TLS is refused by libvirt.
    cli("vm", "create", "notls1", "--host", "host1", check_code=0)
    conn = libvirt.open(records[0].uri)
    try:
        dom = conn.lookupByName("notls1")
        with pytest.raises(libvirt.libvirtError, match="only with VIR_MIGRATE_TLS"):
            dom.migrateToURI3(f"qemu+tls://{lab_host(2).ip}/system", {},
                              libvirt.VIR_MIGRATE_LIVE | libvirt.VIR_MIGRATE_PEER2PEER)
        assert dom.isActive()
    finally:
        conn.close()
