"""Benchmark: the migration streams vmmgr chooses by the link, against one stream, side by side.

    ./run bench-link [--moves 6] [--rates 100,1000]

For each link rate, every lab host's inter-host link is shaped to it (tc tbf) and three 128 MiB
counter VMs are moved around the ring, one move each in turn:
  one      the default policy pinned to one stream (parallel_connections=1, as an operator would)
  multifd  the default policy pinned to two zstd-compressed multifd streams, whatever the link
  auto     the default policy as vmmgr runs it: by what the last move over the same link measured,
           two zstd-compressed multifd streams below 40 MiB/s, else one (policy.for_link)
A first lap of the VMs, not counted, measures every link of the ring. Reported per rate and
method: QEMU's migration time and the caller's wall time (p50), blackout, the streams used and the
wire rate QEMU measured; multifd and auto against one stream at the p50s. Every counter must stay
contiguous. Writes bench/results/link.json and link.md.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from lab_ring import lab_ring
from migration import pct, shape_links, verify

from vmmgr import workloads
from vmmgr.fleet import Fleet
from vmmgr.images import ensure_builtin
from vmmgr.migration import migrate
from vmmgr.policy import get_policy
from vmmgr.spec import make_spec

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = {"one": get_policy(None, parallel_connections=1),
            "multifd": get_policy(None, parallel_connections=2, postcopy=False),
            "auto": get_policy(None)}


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--moves", type=int, default=6, help="counted moves per method and rate")
    args.add_argument("--rates", default="100,1000", help="link rates, Mbit/s")
    opts = args.parse_args()
    rates = [int(r) for r in opts.rates.split(",")]
    runs = []
    with lab_ring() as (paths, records, ring), Fleet(paths) as fleet:
        try:
            for mbit in rates:
                shape_links(ring, mbit)
                runs += bench_rate(fleet, paths, ring, mbit, opts.moves)
        finally:
            shape_links(ring, 0)
            fleet.state.r.delete("vmmgr:links")
        accel = records[0].accel
    report = {"accel": accel, "moves": opts.moves, "memory_mib": 128, "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "link.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "link.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all(r["contiguous"] for r in runs) else 1


def bench_rate(fleet, paths, ring, mbit: int, moves: int) -> list[dict]:
    fleet.state.r.delete("vmmgr:links")  # measured afresh at this rate
    image = ensure_builtin(paths.images)
    vms = {m: f"bench-link-{m}" for m in POLICIES}
    for vm in vms.values():
        if fleet.find(vm) or fleet.is_suspended(vm):
            fleet.destroy(vm)
        fleet.create(make_spec(vm, memory_mib=128, vcpus=1, kernel=image.kernel,
                               initrd=image.initrd, image_root=paths.images, workload="counter",
                               cmdline=workloads.cmdline("counter", {"interval": "0.2"})), ring[0])
    time.sleep(8)  # boot and start counting
    done: dict[str, list[dict]] = {m: [] for m in POLICIES}
    try:
        for i in range(len(ring) + moves):  # the first lap measures every link
            for method, vm in vms.items():
                src = fleet.locate(vm).host_name
                dst = ring[(ring.index(src) + 1) % len(ring)]
                t0 = time.monotonic()
                r = migrate(fleet, vm, dst, policy=POLICIES[method])
                wall_ms = round((time.monotonic() - t0) * 1000)
                counted = i >= len(ring)
                print(f"{mbit:5} Mbit/s {method:4} {'move' if counted else 'lap '} {i + 1:2}: "
                      f"{src}->{dst} streams {r.streams} total {r.total_ms} ms wall {wall_ms} ms "
                      f"blackout {r.downtime_ms} ms wire {r.link_mibps} MiB/s", flush=True)
                if counted:
                    done[method].append({"total_ms": r.total_ms, "wall_ms": wall_ms,
                                         "downtime_ms": r.downtime_ms, "streams": r.streams,
                                         "wire_mibps": r.link_mibps, "postcopy": r.postcopy,
                                         "bytes": r.bytes_transferred})
        time.sleep(3)
        checks = {m: verify(paths, vm, "counter") for m, vm in vms.items()}
    finally:
        for vm in vms.values():
            fleet.destroy(vm)
    out = []
    for method, moved in done.items():
        out.append({
            "link_mbit": mbit, "method": method, "moves": len(moved),
            "streams": sorted({m["streams"] for m in moved}),
            "total_ms_p50": pct([m["total_ms"] for m in moved], 50),
            "wall_ms_p50": pct([m["wall_ms"] for m in moved], 50),
            "blackout_ms_p50": pct([m["downtime_ms"] for m in moved
                                    if m["downtime_ms"] is not None], 50),
            "wire_mibps_p50": pct([m["wire_mibps"] for m in moved], 50),
            "contiguous": checks[method][0], "verification": checks[method][1],
            "detail": moved,
        })
    return out


def markdown(report) -> str:
    lines = [f"# Migration streams by link ({report['accel']}, {report['memory_mib']} MiB counter "
             f"VMs, {report['moves']} counted moves per method and rate)", "",
             "| link | method | streams | QEMU time p50 | wall p50 | blackout p50 | wire p50 "
             "| counter |", "|---|---|---|---|---|---|---|---|"]
    by = {(r["link_mbit"], r["method"]): r for r in report["runs"]}
    for r in report["runs"]:
        lines.append(f"| {r['link_mbit']} Mbit/s | {r['method']} | "
                     f"{', '.join(map(str, r['streams']))} | {r['total_ms_p50']} ms | "
                     f"{r['wall_ms_p50']} ms | {r['blackout_ms_p50']} ms | "
                     f"{r['wire_mibps_p50']} MiB/s | {r['verification']} |")
    lines += ["", "÷ one stream at the p50s (below 1: faster than one stream):", ""]
    for mbit in sorted({r["link_mbit"] for r in report["runs"]}):
        one = by.get((mbit, "one"))
        for method in ("multifd", "auto"):
            r = by.get((mbit, method))
            if one and r and one["total_ms_p50"] and one["wall_ms_p50"]:
                lines.append(f"- {mbit} Mbit/s, {method}: QEMU time "
                             f"{r['total_ms_p50'] / one['total_ms_p50']:.2f} ×, "
                             f"wall {r['wall_ms_p50'] / one['wall_ms_p50']:.2f} ×")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
