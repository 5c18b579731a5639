"""The lab's sites: its hosts grouped into sites, and a WAN between sites (latency, rate, loss)
on the links between hosts of different sites; within a site, the plain LAN.

Each host shapes what it sends to a host of another site (so a round trip crosses the delay
twice): an `htb` qdisc on its link, a class at the WAN's rate that only the filters for far hosts
reach, and netem under that class for the latency and loss. A kernel without `sch_netem` (this
machine's, see the README) gets them from a delay line in user space instead (lab_delay.py),
behind the same `htb` on a device of its own (`WAN_DEV`). The edge stays one hop from every site.
Pure functions build the commands."""

from dataclasses import asdict, dataclass

WAN_DEV = "wan0"  # the delay line's device in each host, where the kernel has no netem


@dataclass(frozen=True)
class Wan:
    delay_ms: float = 20.0  # one way: 40 ms round trip
    rate_mbit: float = 200.0
    loss_pct: float = 0.0

    def __post_init__(self):
        if self.delay_ms < 0 or self.rate_mbit <= 0 or not 0 <= self.loss_pct < 100:
            raise ValueError("a WAN needs delay >= 0 ms, rate > 0 Mbit/s and loss in [0, 100) %")

    def as_dict(self) -> dict:
        return asdict(self)

    def words(self) -> str:
        loss = f", {self.loss_pct:g} % loss" if self.loss_pct else ""
        return f"{2 * self.delay_ms:g} ms RTT at {self.rate_mbit:g} Mbit/s{loss}"


def site_names(hosts: int, sites: int) -> list[str]:
    """Each host's site (host i at index i-1): consecutive hosts share a site, as evenly as may be."""
    if not 1 <= sites <= hosts:
        raise ValueError(f"{sites} sites for {hosts} hosts: each site needs a host")
    if sites == 1:
        return [""] * hosts  # one site: the fleet names none
    return [f"site{i * sites // hosts + 1}" for i in range(hosts)]


def shaping(dev: str, far: list[str], wan: Wan | None) -> list[list[str]]:
    """The `tc` commands that make `dev` send to the addresses in `far` at the WAN's rate (and
    everything else as before); with no WAN or no far host, the commands that take any shaping
    away. The latency and loss are `latency`'s, on the WAN's class."""
    clear = [["tc", "qdisc", "del", "dev", dev, "root"]]
    if wan is None or not far:
        return clear
    cmds = clear + [
        ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
        # The LAN: far above what a veth carries here, so only the WAN class shapes.
        ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
         "rate", "40gbit", "quantum", "200000"],
        ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb",
         "rate", f"{wan.rate_mbit:g}mbit", "quantum", "60000"],
    ]
    for ip in far:
        cmds.append(["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio",
                     "1", "u32", "match", "ip", "dst", f"{ip}/32", "flowid", "1:20"])
    return cmds


def latency(dev: str, wan: Wan) -> list[str] | None:
    """netem under the WAN's class: its delay and loss (None: neither asked for)."""
    if not wan.delay_ms and not wan.loss_pct:
        return None
    cmd = ["tc", "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "netem",
           "limit", "10000", "delay", f"{wan.delay_ms:g}ms"]
    return cmd + (["loss", f"{wan.loss_pct:g}%"] if wan.loss_pct else [])
