"""The lab's WAN latency where the kernel has no `sch_netem` (this machine's): a delay line in
user space. Each host of a multi-site lab gets a TUN device (`wan0`) routed to the hosts of the
other sites; this process reads what a host sends into its `wan0`, holds each packet for the
WAN's one-way delay (dropping the WAN's loss), and writes it into the far host's `wan0`, where the
kernel receives it as from the wire. The WAN's rate stays the kernel's: an `htb` on `wan0`, as on
the link (see lab_wan.py), so a packet is shaped first and then delayed, as netem under htb does.

The devices carry virtio-net headers with TCP segmentation offload, so the kernel hands over
segments of up to 64 KiB and cuts them into frames only on the far side: a few thousand packets a
second at 1 Gbit/s, which one Python loop keeps up with. The devices go with this process (they
are not persistent), and their routes with them: without it, what crosses sites falls back to the
link, at the WAN's rate without its latency. The loss is drawn per segment handed over (up to
64 KiB, many frames), as netem drops on a device with segmentation offload.

    python -m vmmgr.lab_delay --delay-ms 20 --loss-pct 0 --ready FILE vwan-host1=10.77.0.11 ...
"""

import argparse
import errno
import fcntl
import heapq
import os
import random
import select
import struct
import sys
import time
from pathlib import Path

TUNSETIFF, TUNSETOFFLOAD = 0x400454CA, 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN = 0x01, 0x02, 0x04, 0x08
VNET_HDR = 10  # struct virtio_net_hdr, before every packet
READ_SIZE = VNET_HDR + 65536 + 256  # the largest segment the kernel hands a TUN device
QUEUE_LIMIT = 64 << 20  # bytes held at once (a 1 Gbit/s WAN's 0.5 s): beyond it, dropped
GONE = (errno.EBADFD, errno.ENODEV, errno.EIO)  # the device's namespace was deleted


def destination(packet: bytes) -> str | None:
    """The IPv4 destination of a packet read from the device (None: not IPv4)."""
    if len(packet) < VNET_HDR + 20 or packet[VNET_HDR] >> 4 != 4:
        return None
    return ".".join(str(b) for b in packet[VNET_HDR + 16:VNET_HDR + 20])


class DelayLine:
    """Packets in flight, each due `delay_s` after it was sent; a `loss` fraction (drawn per
    packet) and what would hold more than `limit_bytes` dropped. Same delay for all: they leave
    in order."""

    def __init__(self, delay_s: float, loss: float = 0.0, limit_bytes: int = QUEUE_LIMIT,
                 rng: random.Random | None = None):
        self.delay_s, self.loss, self.limit_bytes = delay_s, loss, limit_bytes
        self.rng = rng or random.Random()
        self._heap: list[tuple[float, int, object, bytes]] = []
        self._seq = 0
        self.held = 0  # bytes
        self.dropped = 0

    def send(self, now: float, out, packet: bytes) -> bool:
        if (self.held + len(packet) > self.limit_bytes
                or (self.loss and self.rng.random() < self.loss)):
            self.dropped += 1
            return False
        self._seq += 1
        self.held += len(packet)
        heapq.heappush(self._heap, (now + self.delay_s, self._seq, out, packet))
        return True

    def due(self, now: float) -> list[tuple[object, bytes]]:
        """The packets whose time has come, in the order they were sent."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, _, to, packet = heapq.heappop(self._heap)
            self.held -= len(packet)
            out.append((to, packet))
        return out

    def wait_s(self, now: float) -> float | None:
        """How long until the next packet is due (None: nothing in flight)."""
        return max(0.0, self._heap[0][0] - now) if self._heap else None


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI
                                           | IFF_VNET_HDR))
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN)
    return fd


def run(devices: dict[str, str], line: DelayLine, ready: Path) -> None:
    """Carry packets between the devices (name -> the address of the host it will belong to)."""
    fd_of_ip = {ip: open_tun(name) for name, ip in devices.items()}
    ready.write_text("".join(f"{name}\n" for name in devices))
    poller = select.poll()
    for fd in fd_of_ip.values():
        poller.register(fd, select.POLLIN)
    while True:
        wait = line.wait_s(time.monotonic())
        for fd, events in poller.poll(None if wait is None else max(1, int(wait * 1000 + 0.999))):
            if events & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                poller.unregister(fd)  # its host's namespace went, and the device with it
                continue
            for _ in range(256):  # a burst, then the due packets again
                try:
                    packet = os.read(fd, READ_SIZE)
                except BlockingIOError:
                    break
                except OSError as err:
                    if err.errno in GONE:
                        poller.unregister(fd)
                        break
                    continue  # one packet the device could not give: the next may come
                out = fd_of_ip.get(destination(packet))
                if out is not None and out != fd:
                    line.send(time.monotonic(), out, packet)
        for out, packet in line.due(time.monotonic()):
            try:
                os.write(out, packet)
            except OSError:
                pass  # the far host went: the packet is lost, as on a wire


def main(argv: list[str] | None = None) -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--delay-ms", type=float, required=True, help="one way")
    args.add_argument("--loss-pct", type=float, default=0.0)
    args.add_argument("--ready", type=Path, required=True, help="written once the devices exist")
    args.add_argument("devices", nargs="+", metavar="NAME=IP")
    opts = args.parse_args(argv)
    devices = dict(d.split("=", 1) for d in opts.devices)
    run(devices, DelayLine(opts.delay_ms / 1000, opts.loss_pct / 100), opts.ready)


if __name__ == "__main__":
    sys.exit(main())
