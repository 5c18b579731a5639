"""The lab's stable-address network: an edge, a client outside it, WireGuard from the edge to
every host (wireguard-go: the lab has no kernel module).

    client (vmmgr-client, 10.80.0.2) -- edge (vmmgr-edge: 10.80.0.1 outside, 10.77.0.2 on the
    inter-host bridge, wg-edge 10.79.0.1) == WireGuard == hostN (wg-hostN 10.79.0.1N)

On a host the guest bridge serves the gateway 10.78.0.1 as a /32; each local guest has a /32
route to the bridge (libvirt's qemu hook adds it when the VM starts or arrives and removes it
when it leaves); whatever the guests send elsewhere goes into the tunnel to the edge. The edge
sends each guest /32 down the tunnel of the host that holds the VM now (`edge.Edge`), and
source-NATs what guests send outside. Interface names carry the host's name because
wireguard-go's control sockets (/run/wireguard/<if>.sock) are not per network namespace.

Guests never reach the management plane (Redis, libvirtd, sshd, the storage, other hosts): what
a guest sends may go only to another local guest or into the tunnel, never to the host itself;
at the edge, what comes out of the tunnels may go only outside or back into a tunnel. The same
rules as the `kvm_host` and `edge` roles' nftables files, written with iptables here.
"""

import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from .addresses import NetworkConfig
from .edge import EdgeConfig, Peer
from .errors import VmmgrError
from .paths import Paths

EDGE_NS, CLIENT_NS = "vmmgr-edge", "vmmgr-client"
EDGE_BRIDGE_IP = "10.77.0.2"
EDGE_MAC = "02:76:6d:01:00:fe"  # fixed, as the hosts' are (see lab.host_mac)
OUTSIDE_EDGE_IP, OUTSIDE_CLIENT_IP = "10.80.0.1", "10.80.0.2"
TUNNEL = "10.79.0"
POOL, GATEWAY = "10.78.0.0/24", "10.78.0.1"
WG_PORT = 51820
GUEST_BRIDGE = "br-guest"
GUEST_TABLE = "100"  # guests' traffic that is not for a local guest: into the tunnel


def hook_script() -> bytes:
    return resources.files("vmmgr").joinpath("host_files/qemu-hook.sh").read_bytes()


def edge_hold_script() -> bytes:
    return resources.files("vmmgr").joinpath("host_files/edge-hold.sh").read_bytes()


class LabNetwork:
    def __init__(self, paths: Paths, bridge: str, log=lambda msg: None):
        self.paths = paths
        self.bridge = bridge  # the inter-host bridge in the root namespace
        self.keys = paths.home / "wireguard"
        self.log = log

    def up(self, hosts: dict[str, tuple[str, str, int]]) -> None:
        """hosts: name -> (namespace, inter-host IP, index). Idempotent."""
        NetworkConfig(POOL, GATEWAY).save(self.paths)
        if EDGE_NS not in _namespaces():
            self._make_edge()
        edge_key = self._key("edge")
        _wg_interface(EDGE_NS, "wg-edge", f"{TUNNEL}.1/24", edge_key, listen=True)
        _ns(EDGE_NS, "ip", "route", "replace", POOL, "dev", "wg-edge")
        # The same script the edge role runs at boot (vmmgr-edge-hold.service).
        _ns(EDGE_NS, "sh", "-c", edge_hold_script().decode())
        peers = {}
        for name, (ns, ip, index) in hosts.items():
            key = self._key(name)
            tunnel_ip = f"{TUNNEL}.{10 + index}"
            _wg_interface(ns, f"wg-{name}", f"{tunnel_ip}/24", key, listen=True)
            _ns(ns, "wg", "set", f"wg-{name}", "peer", _pub(edge_key), "endpoint",
                f"{EDGE_BRIDGE_IP}:{WG_PORT}", "allowed-ips", "0.0.0.0/0",
                "persistent-keepalive", "25")
            self._route_guests(ns, f"wg-{name}")
            peers[name] = Peer(_pub(key), tunnel_ip, f"{ip}:{WG_PORT}")
        config = EdgeConfig(command=["ip", "netns", "exec", EDGE_NS], interface="wg-edge",
                            peers=peers, hold_interface="vmhold")
        config.save(self.paths)
        for name, peer in peers.items():
            _ns(EDGE_NS, "wg", "set", "wg-edge", "peer", peer.public_key, "endpoint",
                peer.endpoint, "allowed-ips", f"{peer.tunnel_ip}/32")

    def _make_edge(self) -> None:
        self.log("starting the edge and the outside client")
        for ns in (EDGE_NS, CLIENT_NS):
            _run(["ip", "netns", "add", ns])
            _ns(ns, "ip", "link", "set", "lo", "up")
        _run(["ip", "link", "add", EDGE_NS, "type", "veth", "peer", "name", "eth0", "netns",
              EDGE_NS])
        _run(["ip", "link", "set", EDGE_NS, "master", self.bridge, "up"])
        _ns(EDGE_NS, "ip", "link", "set", "eth0", "address", EDGE_MAC)  # fixed (see lab.py)
        _ns(EDGE_NS, "ip", "addr", "add", f"{EDGE_BRIDGE_IP}/24", "dev", "eth0")
        _ns(EDGE_NS, "ip", "link", "set", "eth0", "up")
        _run(["ip", "-n", EDGE_NS, "link", "add", "out0", "type", "veth", "peer", "name",
              "eth0", "netns", CLIENT_NS])
        _ns(EDGE_NS, "ip", "addr", "add", f"{OUTSIDE_EDGE_IP}/24", "dev", "out0")
        _ns(EDGE_NS, "ip", "link", "set", "out0", "up")
        _ns(CLIENT_NS, "ip", "addr", "add", f"{OUTSIDE_CLIENT_IP}/24", "dev", "eth0")
        _ns(CLIENT_NS, "ip", "link", "set", "eth0", "up")
        # The outside knows the guests' addresses are behind the edge, nothing more.
        _ns(CLIENT_NS, "ip", "route", "add", POOL, "via", OUTSIDE_EDGE_IP)
        _forward_without_redirects(EDGE_NS)
        # Connections the guests open to the outside leave with the edge's address.
        _ns(EDGE_NS, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", POOL, "-o", "out0",
            "-j", "MASQUERADE")
        # Out of the tunnels: outside or into a tunnel; never the management network (eth0)
        # nor the edge itself.
        _ns(EDGE_NS, "iptables", "-A", "FORWARD", "-i", "wg-edge", "-o", "out0", "-j", "ACCEPT")
        _ns(EDGE_NS, "iptables", "-A", "FORWARD", "-i", "wg-edge", "-o", "wg-edge", "-j", "ACCEPT")
        # ... or into the hold, for a guest whose switch-over is under way (it goes on into a
        # tunnel from there).
        _ns(EDGE_NS, "iptables", "-A", "FORWARD", "-i", "wg-edge", "-o", "vmhold", "-j", "ACCEPT")
        _ns(EDGE_NS, "iptables", "-A", "FORWARD", "-i", "wg-edge", "-j", "DROP")
        _ns(EDGE_NS, "iptables", "-A", "INPUT", "-i", "wg-edge", "-s", POOL, "-j", "DROP")
        # The outside cannot pass for a guest.
        _ns(EDGE_NS, "iptables", "-A", "FORWARD", "-i", "out0", "-s", POOL, "-j", "DROP")
        # What a release sends back in through vmhold-out is the second pass of packets the
        # edge already tracked (and de-NATed): tracked again, a reply to a connection a guest
        # opened would look like a new flow clashing with its own NAT entry, and be dropped.
        _ns(EDGE_NS, "iptables", "-t", "raw", "-A", "PREROUTING", "-i", "vmhold-out", "-j",
            "NOTRACK")

    def _route_guests(self, ns: str, wg_if: str) -> None:
        _forward_without_redirects(ns, GUEST_BRIDGE)
        # What the edge held through a VM's switch-over arrives at once, before the host has
        # the VM's MAC. (The kvm_host role sets `default`, read when the bridge is made at
        # boot; a network namespace has no `default` of its own, so the lab sets the bridge's.)
        _ns(ns, "sysctl", "-qw", f"net.ipv4.neigh.{GUEST_BRIDGE}.unres_qlen_bytes=4194304")
        _isolate_guests(ns, wg_if)
        rules = _ns(ns, "ip", "rule", "show")
        if f"from {POOL} lookup main suppress_prefixlength 0" not in rules:
            # Local guests (their /32s in the main table) first, everything else to the edge.
            _ns(ns, "ip", "rule", "add", "from", POOL, "lookup", "main",
                "suppress_prefixlength", "0", "priority", "100")
            _ns(ns, "ip", "rule", "add", "from", POOL, "lookup", GUEST_TABLE, "priority", "101")
        _ns(ns, "ip", "route", "replace", "default", "dev", wg_if, "table", GUEST_TABLE)

    def _key(self, name: str) -> Path:
        """The private key file of `name`, made once, readable by root only."""
        self.keys.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.keys / f"{name}.key"
        if not path.exists():
            key = _run(["wg", "genkey"]).strip()
            path.touch(mode=0o600)
            path.write_text(key + "\n")
        return path

    def remove_keys(self) -> None:
        subprocess.run(["rm", "-rf", str(self.keys)], check=False)
        self.paths.network_config.unlink(missing_ok=True)
        EdgeConfig.remove(self.paths)
        for sock in Path("/run/wireguard").glob("wg-*.sock"):
            sock.unlink(missing_ok=True)


def _forward_without_redirects(ns: str, *interfaces: str) -> None:
    """Forwarding on, ICMP redirects off (the same sysctls as the Ansible roles): a host routes
    a packet between two of its guests back out of the guest bridge, and a redirect would teach
    the sender the other guest's MAC as a next hop, a shortcut that breaks when either moves
    (seen on the lab: a TCP connection between two guests stalled for good after a move)."""
    _ns(ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    for conf in ("all", "default", *interfaces):  # the kernel ORs `all` with each interface's
        _ns(ns, "sysctl", "-qw", f"net.ipv4.conf.{conf}.send_redirects=0")


def _isolate_guests(ns: str, wg_if: str) -> None:
    """A host's guests reach other local guests and the tunnel to the edge, nothing else: not
    the host (its libvirtd, sshd), not the management network (Redis, storage, other hosts).
    The guests' policy route looks up the main table first, which knows the management network,
    so this is what keeps them off it."""
    chain = "VMMGR-GUESTS"
    if _run_ok(["ip", "netns", "exec", ns, "iptables", "-N", chain]):
        for rule in (["-o", GUEST_BRIDGE, "-j", "ACCEPT"], ["-o", wg_if, "-j", "ACCEPT"],
                     ["-j", "DROP"]):
            _ns(ns, "iptables", "-A", chain, *rule)
    for hook, target in (("FORWARD", chain), ("INPUT", "DROP")):
        if not _run_ok(["ip", "netns", "exec", ns, "iptables", "-C", hook, "-i", GUEST_BRIDGE,
                        "-j", target]):
            _ns(ns, "iptables", "-I", hook, "-i", GUEST_BRIDGE, "-j", target)


def _run_ok(cmd: list[str]) -> bool:
    return subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL).returncode == 0


def _wg_interface(ns: str, name: str, cidr: str, key: Path, listen: bool) -> None:
    links = _ns(ns, "ip", "-o", "link", "show")
    if f" {name}:" not in links:
        _make_wg_link(ns, name)
        _ns(ns, "ip", "addr", "add", cidr, "dev", name)
    args = ["wg", "set", name, "private-key", str(key)]
    if listen:
        args += ["listen-port", str(WG_PORT)]
    _ns(ns, *args)
    _ns(ns, "ip", "link", "set", name, "up")


def _make_wg_link(ns: str, name: str) -> None:
    """The kernel's WireGuard where the kernel has it, wireguard-go otherwise (this lab)."""
    kernel = subprocess.run(["ip", "-n", ns, "link", "add", name, "type", "wireguard"],
                            capture_output=True, stdin=subprocess.DEVNULL)
    if kernel.returncode == 0:
        return
    # wireguard-go daemonizes; it lives in the namespace and dies with it (`lab down`). On
    # Linux it refuses to run without this variable (it would rather see the kernel module).
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LOG_LEVEL": "error",
           "WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD": "1"}
    # Its output goes to a file, not a pipe: the daemon would hold a pipe open for ever.
    with tempfile.TemporaryFile() as err:
        proc = subprocess.run(["ip", "netns", "exec", ns, "wireguard-go", name], env=env,
                              stdin=subprocess.DEVNULL, stdout=err, stderr=err, timeout=30)
        if proc.returncode != 0:
            err.seek(0)
            raise VmmgrError(f"wireguard-go {name} in {ns}: {err.read().decode().strip()}")


def _pub(key: Path) -> str:
    return subprocess.run(["wg", "pubkey"], input=key.read_text(), capture_output=True,
                          text=True, check=True).stdout.strip()


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line]


def _ns(ns: str, *cmd: str) -> str:
    return _run(["ip", "netns", "exec", ns, *cmd])


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise VmmgrError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return proc.stdout
