"""Benchmark: the stall a client outside the edge sees when the VM it downloads from moves.

    ./run bench-stall [--moves N]

On the lab: a server VM streams at 8 MiB/s to a client in the outside namespace (through the
edge and WireGuard) while the VM is live-migrated around the ring N times (default 12). For each
move: the migration's blackout (QEMU's downtime) beside the longest receive gap the client saw
while that move ran. Target: stall <= blackout + 200 ms and <= 0.5 s, zero resets. Writes
bench/results/stall.json and stall.md.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from vmmgr import console, workloads
from vmmgr.addresses import pool_for
from vmmgr.fleet import Fleet
from vmmgr.images import ensure_builtin
from vmmgr.lab import Lab
from vmmgr.lab_net import CLIENT_NS
from vmmgr.migration import migrate
from vmmgr.paths import lab_paths
from vmmgr.spec import make_spec

RESULTS = Path(__file__).resolve().parent / "results"
CLIENT = Path(__file__).resolve().parent.parent / "tests" / "lab" / "net_client.py"
VM, RATE = "bench-stall", 8


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("--moves", type=int, default=12)
    moves = args.parse_args().moves
    paths = lab_paths()
    lab = Lab(paths, log=lambda m: print(f"  {m}", flush=True))
    started = not lab.running_hosts()
    records = lab.up(3)
    ring = [r.name for r in records]
    mib = RATE * (moves * 5 + 10)  # enough stream for every move, a few seconds apart
    rows = []
    try:
        image = ensure_builtin(paths.images)
        line = workloads.cmdline("server", {"mib": str(mib), "rate": str(RATE)})
        with Fleet(paths) as fleet:
            if fleet.find(VM):
                fleet.destroy(VM)
            fleet.create(make_spec(VM, memory_mib=128, vcpus=1, kernel=image.kernel,
                                   initrd=image.initrd, cmdline=line, image_root=paths.images,
                                   workload="server"), ring[0])
            while b"serving" not in console.read(paths.consoles, VM):
                time.sleep(0.2)
            address = pool_for(paths).address_of(VM)
            client = subprocess.Popen(["ip", "netns", "exec", CLIENT_NS, sys.executable,
                                       str(CLIENT), address, "8080"], stdout=subprocess.PIPE,
                                      text=True)
            windows = []
            for i in range(moves):
                time.sleep(3)
                target = ring[(i + 1) % len(ring)]
                t0 = time.monotonic()
                result = migrate(fleet, VM, target)
                windows.append((t0, time.monotonic(), result))
                print(f"move {i + 1}: -> {target}, blackout {result.downtime_ms} ms", flush=True)
            seen = json.loads(client.communicate(timeout=mib / RATE + 120)[0])
            fleet.destroy(VM)
    finally:
        if started:
            lab.down()
    for t0, t1, result in windows:
        stall = max((g for end, g in seen["gaps"] if t0 <= end <= t1 + 2), default=0.0)
        rows.append({"source": result.source, "target": result.target,
                     "blackout_ms": result.downtime_ms, "stall_ms": round(stall * 1000)})
    stalls = [r["stall_ms"] for r in rows]
    blackouts = [r["blackout_ms"] for r in rows]
    within = sum(r["stall_ms"] <= min(r["blackout_ms"] + 200, 500) for r in rows)
    summary = {"accel": records[0].accel, "moves": moves, "mib": mib,
               "bytes": seen["bytes"], "reset": seen["error"],
               "stall_p50_ms": statistics.median(stalls), "stall_max_ms": max(stalls),
               "blackout_p50_ms": statistics.median(blackouts),
               "blackout_max_ms": max(blackouts), "within_target": within, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "stall.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = [f"Stall seen outside the edge per move (lab, {summary['accel']}, {moves} moves, "
          f"{RATE} MiB/s stream, one TCP connection; reset: {seen['error'] or 'none'}):", "",
          "| | p50 | max |", "|---|---|---|",
          f"| stall seen by the client | {summary['stall_p50_ms']} ms | {summary['stall_max_ms']} ms |",
          f"| migration blackout | {summary['blackout_p50_ms']} ms | {summary['blackout_max_ms']} ms |",
          "", f"{within}/{moves} moves within the target (stall <= blackout + 200 ms and <= 500 ms)."]
    (RESULTS / "stall.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
