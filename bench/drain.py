"""Benchmark: how long draining a host takes, parallel moves against one at a time.

    ./run bench-drain

On the lab: N counter VMs (128 MiB) on host1, N = 1, 2, 4, 8; `drain host1` with at most two moves
into each target host at once (vmmgr's default) and with one move at a time. Writes
bench/results/drain.json and drain.md.
"""

import json
import time
from pathlib import Path

from vmmgr import workloads
from vmmgr.fleet import Fleet
from vmmgr.images import ensure_builtin
from vmmgr.lab import Lab
from vmmgr.paths import lab_paths
from vmmgr.operations import LocalReport
from vmmgr.reclaim import enable, evacuate
from vmmgr.spec import make_spec

RESULTS = Path(__file__).resolve().parent / "results"
MODES = {"parallel": {"per_target": 2, "parallel": 4}, "one at a time": {"per_target": 1, "parallel": 1}}


def main() -> None:
    paths = lab_paths()
    lab = Lab(paths, log=lambda m: print(f"  {m}", flush=True))
    started = not lab.running_hosts()
    records = lab.up(3)
    rows = []
    try:
        image = ensure_builtin(paths.images)
        line = workloads.cmdline("counter", {"interval": "0.2"})
        with Fleet(paths) as fleet:
            report_to = LocalReport(fleet)
            for n in (1, 2, 4, 8):
                for mode, knobs in MODES.items():
                    names = [f"drain{i}" for i in range(n)]
                    for name in names:
                        fleet.create(make_spec(name, memory_mib=128, vcpus=1, kernel=image.kernel,
                                               initrd=image.initrd, cmdline=line,
                                               image_root=paths.images), "host1")
                    time.sleep(4 + n)  # let them boot
                    report = evacuate(fleet, "host1", False, report_to, **knobs)
                    assert len(report.migrated) == n, report
                    rows.append({"vms": n, "mode": mode, "seconds": report.seconds})
                    print(f"{n} VMs, {mode}: {report.seconds} s", flush=True)
                    for name in names:
                        fleet.destroy(name)
                    enable(fleet, "host1", report_to)
    finally:
        if started:
            lab.down()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "drain.json").write_text(json.dumps({"accel": records[0].accel, "rows": rows},
                                                   indent=2) + "\n")
    md = [f"Drain time of host1 (lab, {records[0].accel}, 128 MiB counter VMs):", "",
          "| VMs | parallel (2 per target) | one at a time | speed-up |", "|---|---|---|---|"]
    for n in (1, 2, 4, 8):
        p = next(r["seconds"] for r in rows if r["vms"] == n and r["mode"] == "parallel")
        s = next(r["seconds"] for r in rows if r["vms"] == n and r["mode"] == "one at a time")
        md.append(f"| {n} | {p} s | {s} s | {s / p:.2f}× |")
    (RESULTS / "drain.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
