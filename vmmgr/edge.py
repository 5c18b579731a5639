"""The edge's routing: each VM's /32 goes down the WireGuard tunnel of the host that holds it.

WireGuard routes by AllowedIPs: giving an address to one peer takes it from any other, in one
`wg set`. So moving a VM's address is one command at the edge, made the moment the VM pauses on
its source for the switch-over (the migration engine calls `route` from libvirt's lifecycle
event; what arrives meanwhile waits on the target until the VM resumes there).

The edge is described by `$VMMGR_HOME/edge.json` (`lab up` writes it): its WireGuard interface,
the command prefix that runs a command there, and each host's peer. The lab's prefix enters the
edge's network namespace (`ip netns exec vmmgr-edge`); a real edge is reached the same way over
SSH (`["ssh", "-o", "BatchMode=yes", "-o", "ControlMaster=auto", "-o", "ControlPersist=600",
"root@edge1"]`: the kept-open connection makes a route change one round trip).

SSH hands its arguments to a shell on the edge as one line, so every argument is quoted for that
shell, and every address is checked (netaddr) before it goes anywhere near a command: an address
comes from a file name on shared storage, which a compromised host could choose.

**Holding a VM's packets through its switch-over** (`hold`, `release`). An edge set up with
`host_files/edge-hold.sh` has a veth pair, `vmhold` and `vmhold-out`. To hold a VM's address, its
/32 is routed into `vmhold` through a next hop that never answers ARP: the kernel queues what
comes for it in that neighbour entry (bounded in bytes, the oldest dropped first when full; all
of it dropped if the hold outlasts the neighbour's probes: see the script). To release it, the /32
goes (back) to the tunnels and the next hop is given the MAC of `vmhold-out`: the kernel sends the
queue out of `vmhold`, in order, it comes back in through `vmhold-out` and is routed like any
packet, down the tunnel of the host the VM is routed to now. Each VM has its own next hop in
169.254.0.0/16 (its address's low 16 bits), so releasing one lets no other VM's packets go.
"""

import json
import os
import shlex
import subprocess
import time
from dataclasses import asdict, dataclass, field

import netaddr

from .errors import InvalidRequest, VmmgrError
from .locks import Lease
from .paths import Paths

LOCK_WAIT = 60  # s a route change waits for another one to finish
COMMAND_TIMEOUT = 30  # s
HOLD_OUT_MAC = "02:76:6d:68:6f:6c"  # vmhold-out's, set by edge-hold.sh: where a release sends


@dataclass(frozen=True)
class Peer:
    public_key: str
    tunnel_ip: str
    endpoint: str


@dataclass(frozen=True)
class EdgeConfig:
    command: list[str]  # prefix that runs a command on the edge
    interface: str
    peers: dict[str, Peer] = field(default_factory=dict)
    hold_interface: str = ""  # "vmhold" where edge-hold.sh ran; "": the edge cannot hold

    @staticmethod
    def path(paths: Paths):
        return paths.home / "edge.json"

    @classmethod
    def load(cls, paths: Paths) -> "EdgeConfig | None":
        try:
            data = json.loads(cls.path(paths).read_text())
        except FileNotFoundError:
            return None
        return cls(data["command"], data["interface"],
                   {h: Peer(**p) for h, p in data["peers"].items()},
                   data.get("hold_interface", ""))

    def save(self, paths: Paths) -> None:
        self.path(paths).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def remove(cls, paths: Paths) -> None:
        cls.path(paths).unlink(missing_ok=True)


def host_address(ip: str) -> str:
    """`ip` if it is one IPv4 address written the usual way, else InvalidRequest."""
    try:
        if isinstance(ip, str) and str(netaddr.IPAddress(ip, version=4,
                                                         flags=netaddr.INET_PTON)) == ip:
            return ip
    except (netaddr.AddrFormatError, ValueError, TypeError):
        pass
    raise InvalidRequest(f"not an IPv4 address: {ip!r}")


def hold_gateway(ip: str) -> str:
    """The next hop that holds `ip`'s packets: never answered, one per VM (its low 16 bits)."""
    value = int(netaddr.IPAddress(host_address(ip)))
    return f"169.254.{(value >> 8) & 0xFF}.{value & 0xFF}"


class Edge:
    def __init__(self, config: EdgeConfig, state):
        self.config = config
        self.state = state  # the fleet's store: route changes from every node take turns there

    @classmethod
    def load(cls, paths: Paths, state) -> "Edge | None":
        config = EdgeConfig.load(paths)
        return cls(config, state) if config else None

    def route(self, ip: str, host: str) -> None:
        """Send `ip` to `host` from now on (and no longer anywhere else)."""
        host_address(ip)
        peer = self._peer(host)
        with self._locked():
            allowed = self.routes_by_host().get(host, set()) | {ip}
            self._set_allowed(peer, allowed)

    def unroute(self, ip: str) -> None:
        host_address(ip)
        with self._locked():
            for host, ips in self.routes_by_host().items():
                if ip in ips:
                    self._set_allowed(self._peer(host), ips - {ip})

    @property
    def can_hold(self) -> bool:
        return bool(self.config.hold_interface)

    def hold(self, ip: str) -> None:
        """From now on queue what comes for `ip` at the edge, until `release`."""
        dev = self._hold_interface()
        self._run("ip", "route", "replace", f"{host_address(ip)}/32", "via", hold_gateway(ip),
                  "dev", dev, "onlink")

    def release(self, ip: str) -> None:
        """Send what was held for `ip`, in order, to wherever the tunnels route it now, and
        route what comes next there too. Nothing held: nothing happens."""
        dev, gateway = self._hold_interface(), hold_gateway(ip)
        # One round trip: the route first (else the released queue would come straight back).
        self._run("sh", "-c", f"ip route del {host_address(ip)}/32 dev {dev} 2>/dev/null; "
                  f"ip neigh replace {gateway} lladdr {HOLD_OUT_MAC} dev {dev} nud permanent "
                  f"&& ip neigh del {gateway} dev {dev}")

    def held(self) -> list[str]:
        """The addresses held now."""
        if not self.can_hold:
            return []
        out = self._run("ip", "-4", "route", "show", "dev", self._hold_interface())
        return [line.split()[0].removesuffix("/32") for line in out.splitlines()
                if line.strip()]

    def _hold_interface(self) -> str:
        dev = self.config.hold_interface
        if not dev:
            raise VmmgrError("this edge cannot hold packets (no hold_interface in edge.json)")
        if not dev.replace("-", "").isalnum() or len(dev) > 15:
            raise VmmgrError(f"edge.json: not an interface name: {dev!r}")
        return dev

    def sync(self, placement: dict[str, str]) -> list[str]:
        """Make the edge route exactly `placement` (address -> host); returns what changed."""
        changed = []
        for ip in placement:
            host_address(ip)
        with self._locked():
            now = self.routes_by_host()
            for host, peer in self.config.peers.items():
                want = {ip for ip, h in placement.items() if h == host}
                if want != now.get(host, set()):
                    self._set_allowed(peer, want)
                    changed.append(host)
        return changed

    def routes(self) -> dict[str, str]:
        """address -> host, as the edge routes now."""
        return {ip: host for host, ips in self.routes_by_host().items() for ip in ips}

    def routes_by_host(self) -> dict[str, set[str]]:
        by_key = {p.public_key: (h, p) for h, p in self.config.peers.items()}
        out = self._wg("show", self.config.interface, "allowed-ips")
        routes: dict[str, set[str]] = {}
        for line in out.splitlines():
            key, _, rest = line.partition("\t")
            if key not in by_key:
                continue
            host, peer = by_key[key]
            routes[host] = {a.removesuffix("/32") for a in rest.split()
                            if a.endswith("/32") and a != f"{peer.tunnel_ip}/32"}
        return routes

    def peers(self) -> list[dict]:
        """Each host's tunnel: endpoint, last handshake, the VM addresses routed down it."""
        handshakes = {}
        for line in self._wg("show", self.config.interface, "latest-handshakes").splitlines():
            key, _, when = line.partition("\t")
            handshakes[key] = int(when or 0)
        routes = self.routes_by_host()
        now = time.time()
        return [{"host": h, "endpoint": p.endpoint, "tunnel_ip": p.tunnel_ip,
                 "handshake": f"{int(now - handshakes[p.public_key])} s ago"
                 if handshakes.get(p.public_key) else "never",
                 "addresses": sorted(routes.get(h, ()))}
                for h, p in sorted(self.config.peers.items())]

    def _set_allowed(self, peer: Peer, ips: set[str]) -> None:
        allowed = ",".join([f"{host_address(peer.tunnel_ip)}/32"]
                           + [f"{host_address(ip)}/32" for ip in sorted(ips)])
        self._wg("set", self.config.interface, "peer", peer.public_key, "allowed-ips", allowed)

    def _peer(self, host: str) -> Peer:
        try:
            return self.config.peers[host]
        except KeyError:
            raise VmmgrError(f"the edge has no tunnel to host {host!r}") from None

    def _wg(self, *args: str) -> str:
        return self._run("wg", *args)

    def _run(self, *args: str) -> str:
        cmd = [*self.config.command, *self._quoted(list(args))]
        try:  # an edge that does not answer must not stall a migration's monitor
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL, timeout=COMMAND_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise VmmgrError(f"edge: {' '.join(args)}: {err}") from None
        if proc.returncode != 0:
            raise VmmgrError(f"edge: {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def _quoted(self, args: list[str]) -> list[str]:
        """An SSH prefix joins the arguments into a line for the edge's shell: quote each one.
        Any other prefix (`ip netns exec`) passes them on as they are."""
        if self.config.command and os.path.basename(self.config.command[0]) == "ssh":
            return [shlex.quote(a) for a in args]
        return args

    def _locked(self) -> Lease:
        # Read-modify-write of a peer's AllowedIPs: moves from every node (a drain's parallel
        # moves, reconcile) take turns, through the fleet's store.
        return Lease(self.state, "edge", "routes", f"edge-{os.getpid()}-{time.monotonic_ns()}",
                     "a route change at the edge", wait=LOCK_WAIT)
