"""The lab's sites: its hosts grouped into sites, and a WAN between sites (netem: latency, rate,
loss) on the links between hosts of different sites; within a site, the plain LAN.

Each host shapes what it sends to a host of another site (so a round trip crosses the delay
twice): a `prio` qdisc on its link, a fourth band that only the filters for far hosts reach, and
netem on that band. The edge stays one hop from every site. Pure functions build the commands."""

from dataclasses import asdict, dataclass


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
    """The `tc` commands that make `dev` send to the addresses in `far` over `wan` (and nothing
    else); with no WAN or no far host, the commands that take any shaping away."""
    clear = [["tc", "qdisc", "del", "dev", dev, "root"]]
    if wan is None or not far:
        return clear
    netem = ["delay", f"{wan.delay_ms:g}ms", "rate", f"{wan.rate_mbit:g}mbit"]
    if wan.loss_pct:
        netem += ["loss", f"{wan.loss_pct:g}%"]
    cmds = clear + [
        # Bands 1-3 as pfifo_fast would use them; band 4 only for the filters below.
        ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "prio", "bands", "4",
         "priomap", *"1 2 2 2 1 2 0 0 1 1 1 1 1 1 1 1".split()],
        ["tc", "qdisc", "add", "dev", dev, "parent", "1:4", "handle", "40:", "netem",
         "limit", "10000", *netem],
    ]
    for ip in far:
        cmds.append(["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio",
                     "1", "u32", "match", "ip", "dst", f"{ip}/32", "flowid", "1:4"])
    return cmds
