"""Benchmark: the stall a client outside the edge sees when the VM it downloads from moves.

    ./run bench-stall [--moves N]

On the lab: a server VM streams at 8 MiB/s to a client in the outside namespace (through the
edge and WireGuard) while the VM is live-migrated around the ring N times (default 12). For each
move: the migration's blackout (from the pause, QEMU's or vmmgr's, to the resume) beside the
longest receive gap the client saw while that move ran, how many of the ICMP echo requests the
client sent the VM every 2 ms during the move never came back (lost at a paused source), and
whether the edge held the VM's packets from before its pause. Targets: stall <= blackout +
200 ms and <= 0.5 s, zero resets; the edge's hold (issue 18): no probe lost and a stall <=
blackout + 30 ms. Writes bench/results/stall.json and stall.md.
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
PROBE = CLIENT.with_name("net_probe.py")
VM, RATE = "bench-stall", 8
PROBE_S, PROBE_INTERVAL = 5.0, 0.002  # a move takes 2.5-4 s here: it starts 1 s into the probe
MOVE_S = 12  # s of stream per move


def held_how(result) -> str:
    """Whether the edge held the VM's packets from before its pause (vmmgr/policy.py)."""
    held = next((i for i, e in enumerate(result.events) if "held at the edge" in e), None)
    paused = next((i for i, e in enumerate(result.events) if "source paused" in e), None)
    if held is None:
        return "not held"
    return "held before the pause" if paused is None or held < paused else "held too late"


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("--moves", type=int, default=12)
    moves = args.parse_args().moves
    paths = lab_paths()
    lab = Lab(paths, log=lambda m: print(f"  {m}", flush=True))
    started = not lab.running_hosts()
    records = lab.up(3)
    ring = [r.name for r in records]
    # Enough stream for every move: one takes 8-10 s here (3 s apart, the probe's 5 s, the
    # move). A move after the stream's end would see no stall at all (it once counted 5 of 12).
    mib = RATE * (moves * MOVE_S + 10)
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
            while b"serving" not in console.read(fleet.consoles, VM):
                time.sleep(0.2)
            address = pool_for(paths).address_of(VM)
            client = subprocess.Popen(["ip", "netns", "exec", CLIENT_NS, sys.executable,
                                       str(CLIENT), address, "8080"], stdout=subprocess.PIPE,
                                      text=True)
            windows, probes = [], []
            for i in range(moves):
                time.sleep(3)
                target = ring[(i + 1) % len(ring)]
                probe = subprocess.Popen(["ip", "netns", "exec", CLIENT_NS, sys.executable,
                                          str(PROBE), address, str(PROBE_S),
                                          str(PROBE_INTERVAL)], stdout=subprocess.PIPE, text=True)
                time.sleep(1)
                t0 = time.monotonic()
                result = migrate(fleet, VM, target)
                windows.append((t0, time.monotonic(), result))
                probes.append(json.loads(probe.communicate(timeout=PROBE_S + 30)[0]))
                lost = probes[-1]["sent"] - probes[-1]["received"]
                print(f"move {i + 1}: -> {target}, blackout {result.downtime_ms} ms, "
                      f"{lost} probes lost, {held_how(result)}", flush=True)
                if lost:
                    print("    " + "\n    ".join(result.events), flush=True)
            seen = json.loads(client.communicate(timeout=mib / RATE + 120)[0])
            fleet.destroy(VM)
    finally:
        if started:
            lab.down()
    for (t0, t1, result), probe in zip(windows, probes):
        if t1 + 2 > seen["last_byte_at"]:
            raise SystemExit(f"the stream ended before the move at {t0:.0f} s: make MOVE_S longer")
        stall = max((g for end, g in seen["gaps"] if t0 <= end <= t1 + 2), default=0.0)
        rows.append({"source": result.source, "target": result.target,
                     "hold": held_how(result),
                     "blackout_ms": result.downtime_ms, "stall_ms": round(stall * 1000),
                     "probes_lost": probe["sent"] - probe["received"],
                     "probe_max_rtt_ms": probe["max_rtt_ms"]})
    stalls = [r["stall_ms"] for r in rows]
    blackouts = [r["blackout_ms"] for r in rows]
    within = sum(r["stall_ms"] <= min(r["blackout_ms"] + 200, 500) for r in rows)
    # Issue 18's target for the edge's hold: nothing lost, a stall within the blackout + 30 ms.
    lossless = sum(r["probes_lost"] == 0 for r in rows)
    tight = sum(r["probes_lost"] == 0 and r["stall_ms"] <= r["blackout_ms"] + 30 for r in rows)
    summary = {"accel": records[0].accel, "moves": moves, "mib": mib,
               "bytes": seen["bytes"], "reset": seen["error"],
               "stall_p50_ms": statistics.median(stalls), "stall_max_ms": max(stalls),
               "blackout_p50_ms": statistics.median(blackouts),
               "blackout_max_ms": max(blackouts), "within_target": within,
               "held_before_pause": sum(r["hold"] == "held before the pause" for r in rows),
               "lossless": lossless, "within_hold_target": tight,
               "probe_interval_ms": PROBE_INTERVAL * 1000,
               "probes_lost_p50": statistics.median(r["probes_lost"] for r in rows),
               "probes_lost_max": max(r["probes_lost"] for r in rows), "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "stall.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = [f"Stall seen outside the edge per move (lab, {summary['accel']}, {moves} moves, "
          f"{RATE} MiB/s stream, one TCP connection; reset: {seen['error'] or 'none'}):", "",
          "| | p50 | max |", "|---|---|---|",
          f"| stall seen by the client | {summary['stall_p50_ms']} ms | {summary['stall_max_ms']} ms |",
          f"| migration blackout | {summary['blackout_p50_ms']} ms | {summary['blackout_max_ms']} ms |",
          f"| ICMP probes lost per move (one every {PROBE_INTERVAL * 1000:g} ms) | "
          f"{summary['probes_lost_p50']} | {summary['probes_lost_max']} |",
          "", f"{within}/{moves} moves within the target (stall <= blackout + 200 ms and <= 500 ms).",
          f"{summary['held_before_pause']}/{moves} moves held at the edge before the pause; "
          f"{lossless}/{moves} lost no probe; {tight}/{moves} within the edge hold's target "
          "(no probe lost, stall <= blackout + 30 ms)."]
    (RESULTS / "stall.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
