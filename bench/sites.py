"""Benchmark: a disk-backed VM with a local disk moved between sites over the lab's WAN.

    ./run bench-sites [--moves 4] [--wans 40:1000,80:100]

The lab: three hosts in two sites (host1 and host2 in site1, host3 in site2), the WAN between the
sites at each setting (round trip in ms : rate in Mbit/s; the latency by the kernel's netem, or
by the lab's delay line where the kernel has none: the report says if it was not applied). One Debian VM
(512 MiB, `--local-disk`, 64 MiB of random data written on its disk) moves host1 -> host3 ->
host1 ..., `--moves` counted moves per method and WAN setting:
  plain       one stream, nothing compressed
  compressed  two zstd-compressed multifd streams
  vmmgr       the default policy as vmmgr runs it: the streams chosen by what the last move over
              the WAN measured (policy.for_link: compressed below 40 MiB/s, else one stream)
The disk goes first (libvirt's mirror of the overlay; the base image is on both sites), then the
memory. The physical limit of a move is what had to cross, the disk data libvirt copied and the
memory QEMU sent in the plain moves (the same guest and data for both methods), over the WAN's
rate. Reported per setting and method: QEMU's total (from the start to the guest running on the
target, the disk phase included) at the p50 against that limit, how much of it went before the
first byte was sent (libvirt starting the target's QEMU and the disk's mirror) and the rest
against the limit, the blackout p50 / p99 and the bytes on the wire. The data's checksum is verified after each setting. Writes
bench/results/sites.json and sites.md.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from images import IMAGE, wait_ssh
from lab_ring import lab_ring
from migration import pct

from vmmgr import image_build, local_disks, seed
from vmmgr.addresses import pool_for
from vmmgr.fleet import Fleet
from vmmgr.lab import Lab
from vmmgr.lab_net import CLIENT_NS
from vmmgr.lab_wan import Wan
from vmmgr.migration import migrate
from vmmgr.policy import get_policy

RESULTS = Path(__file__).resolve().parent / "results"
VMMGR = Path(sys.executable).parent / "vmmgr"
VM, MEMORY_MIB, DATA_MIB = "bench-site", 512, 64
POLICIES = {"plain": get_policy(None, parallel_connections=1),
            "compressed": get_policy(None, parallel_connections=2, postcopy=False),
            "vmmgr": get_policy(None)}
NEAR, FAR = "host1", "host3"  # site1, site2


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--moves", type=int, default=4, help="counted moves per method and WAN")
    args.add_argument("--wans", default="40:1000,80:100", help="RTT_MS:MBIT,... between sites")
    opts = args.parse_args()
    wans = [Wan(delay_ms=float(rtt) / 2, rate_mbit=float(rate))
            for rtt, rate in (w.split(":") for w in opts.wans.split(","))]
    runs, checks = [], []
    with lab_ring() as (paths, records, ring), tempfile.TemporaryDirectory() as tmp:
        lab = Lab(paths, log=lambda m: print(f"  {m}", flush=True))
        env = os.environ | {"VMMGR_HOME": str(paths.home)}
        image_build.build(paths.images, IMAGE, log=lambda m: print(f"  {m}", flush=True))
        key = Path(tmp) / "key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                       check=True)
        with Fleet(paths) as fleet:
            try:
                if fleet.find(VM) or fleet.is_suspended(VM):
                    fleet.destroy(VM)
                subprocess.run([str(VMMGR), "vm", "create", VM, "--image", IMAGE, "--memory",
                                str(MEMORY_MIB), "--host", NEAR, "--ssh-key", f"{key}.pub",
                                "--local-disk"], env=env, check=True, capture_output=True,
                               timeout=300)
                if wait_ssh(paths, key, VM, time.monotonic(), 600) is None:
                    raise RuntimeError(f"{VM} never answered SSH")
                written = ssh(paths, key, f"head -c {DATA_MIB << 20} /dev/urandom > data; sync; "
                                          "sha256sum data")
                for wan in wans:
                    lab.up(3, sites=2, wan=wan)
                    latency = lab.sites()[2]
                    fleet.state.r.delete("vmmgr:links")  # nothing carried over between settings
                    runs += bench_wan(fleet, wan, latency, opts.moves)
                    checks.append(ssh(paths, key, "sync; echo 3 | sudo -n tee "
                                      "/proc/sys/vm/drop_caches >/dev/null 2>&1; "
                                      "sha256sum data") == written)
                    print(f"  data after {wan.words()}: "
                          f"{'intact' if checks[-1] else 'CHANGED'}", flush=True)
                held = [h for h in ring if local_disks.find(fleet.host(h).conn, VM)]
            finally:
                if fleet.find(VM) or fleet.is_suspended(VM):
                    fleet.destroy(VM)
                lab.up(3, sites=1)
                fleet.state.r.delete("vmmgr:links")
        accel = records[0].accel
    report = {"accel": accel, "memory_mib": MEMORY_MIB, "data_mib": DATA_MIB,
              "moves": opts.moves, "runs": runs, "data_intact": all(checks),
              "disk_held_by": held}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sites.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "sites.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["data_intact"] and len(held) == 1 else 1


def ssh(paths, key: Path, command: str) -> str:
    address = pool_for(paths).address_of(VM)
    proc = subprocess.run(
        ["ip", "netns", "exec", CLIENT_NS, "ssh", "-i", str(key), "-o", "BatchMode=yes",
         "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
         "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR", f"{seed.USER}@{address}", command],
        capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise RuntimeError(f"ssh {command!r}: {proc.stderr.strip()}")
    return proc.stdout


def bench_wan(fleet, wan: Wan, latency: bool, moves: int) -> list[dict]:
    done: dict[str, list[dict]] = {m: [] for m in POLICIES}
    for method, policy in POLICIES.items():
        for i in range(moves):
            src = fleet.locate(VM).host_name
            dst = FAR if src != FAR else NEAR
            first: list[int] = []  # libvirt's clock at the first poll that saw bytes sent

            def seen(p) -> None:
                if not first and (p.processed_bytes or p.disk_processed_bytes):
                    first.append(p.elapsed_ms)
            r = migrate(fleet, VM, dst, policy=policy, on_progress=seen)
            move = {"total_ms": r.total_ms, "wall_ms": r.wall_ms, "downtime_ms": r.downtime_ms,
                    "first_byte_ms": first[0] if first else None,
                    "disk_mib": round(r.disk_bytes / 2**20, 1),
                    "memory_mib": round((r.bytes_transferred - r.disk_bytes) / 2**20, 1),
                    "streams": r.streams, "postcopy": r.postcopy}
            done[method].append(move)
            print(f"{wan.words():28} {method:10} move {i + 1}: {src}->{dst} {move}", flush=True)
    rate_mibps = wan.rate_mbit * 1e6 / 8 / 2**20
    # What had to cross: the disk as copied, and the memory as the plain moves sent it.
    memory_mib = pct([m["memory_mib"] for m in done["plain"]], 50) or 0
    out = []
    for method, moved in done.items():
        disk_mib = pct([m["disk_mib"] for m in moved], 50)
        limit_s = (disk_mib + memory_mib) / rate_mibps
        total_ms = pct([m["total_ms"] for m in moved], 50)
        # Before the first byte: libvirt starts the target's QEMU and the disk's NBD mirror, a
        # cost of its own (seen no later than the poll after, every 0.2 s).
        started = [m for m in moved if m["first_byte_ms"] is not None]
        setup_ms = pct([m["first_byte_ms"] for m in started], 50)
        # Each move's own rest (medians of two columns may come from different moves); a lower
        # bound, as the first byte is seen only at the poll after it.
        rest_ms = pct([m["total_ms"] - m["first_byte_ms"] for m in started], 50)
        blackouts = [m["downtime_ms"] for m in moved if m["downtime_ms"] is not None]
        out.append({
            "wan": wan.as_dict(), "latency_applied": latency, "method": method,
            "moves": len(moved), "streams": sorted({m["streams"] for m in moved}),
            "total_ms_p50": total_ms, "limit_s": round(limit_s, 2),
            "ratio": round(total_ms / 1000 / limit_s, 2) if limit_s else None,
            "first_byte_ms_p50": setup_ms,
            "ratio_after_first_byte": round(rest_ms / 1000 / limit_s, 2)
            if limit_s and rest_ms is not None else None,
            "blackout_ms_p50": pct(blackouts, 50), "blackout_ms_p99": pct(blackouts, 99),
            "disk_mib_p50": disk_mib,
            "memory_mib_p50": pct([m["memory_mib"] for m in moved], 50),
            "detail": moved,
        })
    return out


def markdown(report) -> str:
    lines = [f"# Moves between sites ({report['accel']}; a {report['memory_mib']} MiB Debian VM "
             f"with a local disk, {report['data_mib']} MiB of data on it; {report['moves']} "
             "counted moves per setting and method)", "",
             "| WAN | method | streams | total p50 | limit | ratio | first byte after | "
             "ratio from it | blackout p50 / p99 | disk sent | memory sent |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        wan = Wan(**r["wan"])
        words = wan.words() if r["latency_applied"] else (
            f"{wan.rate_mbit:g} Mbit/s (the {2 * wan.delay_ms:g} ms RTT not applied: "
            "no netem, no delay line)")
        lines.append(f"| {words} | {r['method']} | {', '.join(map(str, r['streams']))} | "
                     f"{r['total_ms_p50'] / 1000:.1f} s | {r['limit_s']:.1f} s | "
                     f"{r['ratio']} × | {_s(r.get('first_byte_ms_p50'))} | "
                     f"{_times(r.get('ratio_after_first_byte'))} | "
                     f"{r['blackout_ms_p50']} / {r['blackout_ms_p99']} ms | "
                     f"{r['disk_mib_p50']} MiB | {r['memory_mib_p50']} MiB |")
    lines += ["", f"Data on the disk after every setting: "
              f"{'intact' if report['data_intact'] else 'CHANGED'}; the disk held by "
              f"{', '.join(report['disk_held_by']) or 'no host'} at the end.",
              "", "The limit: (disk data copied + memory the plain moves sent) ÷ the WAN's rate. "
              "First byte after: libvirt's clock when a poll (every 0.2 s) first saw bytes "
              "sent, the time it took to start the target's QEMU and the disk's mirror; the "
              "ratio from it: the rest of the total against the limit."]
    return "\n".join(lines) + "\n"


def _s(ms) -> str:
    return "-" if ms is None else f"{ms / 1000:.1f} s"


def _times(ratio) -> str:
    return "-" if ratio is None else f"{ratio} ×"


if __name__ == "__main__":
    sys.exit(main())
