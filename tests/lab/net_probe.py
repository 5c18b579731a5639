"""Run in the lab's outside namespace: send ICMP echo requests to HOST every INTERVAL seconds for
SECONDS, then wait 2 s for late replies; print one JSON line: how many were sent, how many came
back, the longest round trip (ms). A request lost on the way (or its reply) never comes back; one
held somewhere comes back late. Needs root (a raw socket); the lab has no ping binary."""

import json
import os
import select
import socket
import struct
import sys
import time


def checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF


def echo_request(ident: int, seq: int) -> bytes:
    payload = b"vmmgr-probe-0123"
    header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    return struct.pack("!BBHHH", 8, 0, checksum(header + payload), ident, seq) + payload


def main() -> None:
    host, seconds, interval = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    # Replies to requests held at the edge come back in one burst: room for all of them.
    sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 8 << 20)
    ident = os.getpid() & 0xFFFF
    sent, rtt = {}, {}
    start = next_at = time.monotonic()
    wall0 = time.time()
    end = start + seconds
    while time.monotonic() < end + 2:
        now = time.monotonic()
        if now >= next_at and now < end:
            seq = len(sent) & 0xFFFF
            sock.sendto(echo_request(ident, seq), (host, 0))
            sent[seq] = now
            next_at += interval
        wait = max(0.0, min(next_at - time.monotonic(), 0.01))
        if select.select([sock], [], [], wait)[0]:
            packet = sock.recv(2048)
            ihl = (packet[0] & 0xF) * 4
            kind, _, _, who, seq = struct.unpack("!BBHHH", packet[ihl:ihl + 8])
            if kind == 0 and who == ident and seq in sent and seq not in rtt:
                rtt[seq] = time.monotonic() - sent[seq]
    print(json.dumps({"sent": len(sent), "received": len(rtt),
                      "max_rtt_ms": round(1000 * max(rtt.values(), default=0.0)),
                      "lost_at": [round(wall0 + sent[s] - start, 4) for s in sent if s not in rtt]}))


if __name__ == "__main__":
    main()
