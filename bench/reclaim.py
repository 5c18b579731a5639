"""Benchmark: a reclaim against a deadline, vmmgr's planner against naive strategies, side by side.

    ./run bench-reclaim [--deadlines 30,120] [--link-mbit 400] [--repeats N]

host1 of the lab holds a mixed set whose RAM nears the host's 1024 MiB: two idle counters, a light
dirtier (4 MiB/s), a heavy one (64 MiB/s, faster than the shaped link sends) and a two-VM job. For
each deadline and each strategy the same set is created afresh on host1, and host1 is reclaimed
through the same executor (`deadline_run.reclaim_by`) with that deadline:

  plan           vmmgr's deadline planner (measured dirty rates, link and storage bandwidth)
  all-at-once    every VM with room migrates, all at once
  one-at-a-time  every VM with room migrates, one after another
  suspend-all    every VM is saved to storage, all at once

Reported per run: VMs safe before the deadline, VMs kept running (migrated), the time the last VM
was safe, that time against the physical limit (total RAM / the better of the link's and the
storage's measured bandwidth), and whether the plan said before it started that it would be late.
Every VM is then checked (counters contiguous, dirtiers without a CORRUPT line) and removed.
Writes bench/results/reclaim.json, reclaim.md and reclaim.png.
"""

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from lab_ring import lab_ring
from migration import measure_link_mibps, shape_links, verify

from vmmgr import deadline, deadline_run, operations, workloads
from vmmgr.fleet import Fleet
from vmmgr.images import ensure_builtin
from vmmgr.migration import migrate
from vmmgr.policy import DEFAULT_POLICY, get_policy
from vmmgr.spec import make_spec

RESULTS = Path(__file__).resolve().parent / "results"
STRATEGIES = ("plan", *deadline.NAIVE)
VMS = [  # name, workload, params, MiB, group
    ("br-idle1", "counter", {"interval": "0.2"}, 128, ""),
    ("br-idle2", "counter", {"interval": "0.2"}, 128, ""),
    ("br-light", "dirtier", {"rate": "4", "mib": "32"}, 192, ""),
    ("br-heavy", "dirtier", {"rate": "64", "mib": "64"}, 256, ""),
    ("br-job0", "counter", {"interval": "0.2"}, 128, "job"),
    ("br-job1", "counter", {"interval": "0.2"}, 128, "job"),
]
MiB = 2**20


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--deadlines", default="30,120", help="seconds, comma-separated")
    args.add_argument("--link-mbit", type=int, default=400, help="shape the inter-host link")
    args.add_argument("--strategies", default=",".join(STRATEGIES))
    args.add_argument("--repeats", type=int, default=1,
                      help="rounds of every strategy, interleaved (TCG timing varies run to run)")
    opts = args.parse_args()
    runs = []
    with lab_ring() as (paths, records, ring):
        try:
            shape_links(ring, opts.link_mbit)
            link = measure_link_mibps()
            storage = measure_storage_mibps(paths.storage)
            with Fleet(paths) as fleet:
                stream = measure_stream_mibps(fleet, paths)
                # what a fleet that has moved VMs before knows (`vmmgr:rates`: the share of
                # memory a move sends, its time outside the copy), one stream's rate, and the
                # link's and the storage's totals as measured here
                rates = replace(deadline_run.measured_rates(fleet.state.r),
                                link_mibps=min(stream, link), link_total_mibps=link,
                                storage_mibps=storage)
                print(f"link {link:.0f} MiB/s (shaped to {opts.link_mbit} Mbit/s), one "
                      f"migration stream {stream:.0f} MiB/s, a move sends "
                      f"{rates.sent_fraction:.2f} of the memory and spends "
                      f"{rates.overhead_s:.1f} s outside the copy; storage {storage:.0f} MiB/s, "
                      f"accelerator {records[0].accel}", flush=True)
                for seconds in [float(d) for d in opts.deadlines.split(",")]:
                    for round_ in range(opts.repeats):
                        for strategy in opts.strategies.split(","):
                            runs.append({**run_one(fleet, paths, strategy, seconds, rates),
                                         "round": round_})
        finally:
            shape_links(ring, 0)
    total = sum(v[3] for v in VMS)
    report = {"accel": records[0].accel, "link_mibps": round(link, 1),
              "stream_mibps": round(stream, 1), "sent_fraction": rates.sent_fraction,
              "overhead_s": rates.overhead_s,
              "link_shaped_mbit": opts.link_mbit, "storage_mibps": round(storage, 1),
              "total_ram_mib": total,
              "physical_limit_s": round(total / max(link, storage), 1), "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "reclaim.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "reclaim.md").write_text(markdown(report))
    plot(report, RESULTS / "reclaim.png")
    print(markdown(report))
    return 0


def run_one(fleet, paths, strategy: str, seconds: float, rates) -> dict:
    image = ensure_builtin(paths.images)
    for name, wl, params, mib, group in VMS:
        if fleet.find(name):
            fleet.destroy(name)
        fleet.create(make_spec(name, memory_mib=mib, vcpus=1, kernel=image.kernel,
                               initrd=image.initrd, cmdline=workloads.cmdline(wl, params),
                               image_root=paths.images, workload=wl, group=group), "host1")
    time.sleep(10)  # boot and start the workloads
    report = operations.LocalReport(fleet, lambda m: print(f"    {m}", flush=True))
    try:
        out = deadline_run.reclaim_by(fleet, "host1", time.time() + seconds, report,
                                      rates=rates, strategy=strategy)
        safe_in_time = [v for v, at in out.safe_at.items() if at <= out.deadline_s]
        operations.enable_host(fleet, report, "host1")  # parked VMs resume for the checks
        time.sleep(4)
        checks = {name: verify(paths, name, wl) for name, wl, *_ in VMS}
    finally:
        for name, *_ in VMS:
            if fleet.find(name):
                fleet.destroy(name)
        fleet.inventory.set_state("host1", "active")
    row = {"strategy": strategy, "deadline_s": seconds, "vms": len(VMS),
           "safe_in_time": len(safe_in_time), "kept_running": len(out.migrated),
           "last_safe_s": max(out.safe_at.values()) if out.safe_at else None,
           "said_late": "cannot save everything" in out.plan,
           "plan": out.plan, "safe_at": out.safe_at, "failed": out.failed,
           "verified": all(ok for ok, _ in checks.values()),
           "checks": {n: detail for n, (_, detail) in checks.items()}}
    print(f"  {strategy:13} {seconds:5.0f} s: {row['safe_in_time']}/{row['vms']} safe in time, "
          f"{row['kept_running']} kept running, last safe at {row['last_safe_s']} s, "
          f"verified {row['verified']}", flush=True)
    return row


def measure_stream_mibps(fleet, paths) -> float:
    """A 128 MiB counter moved alone around the ring, as a fleet's earlier moves go: each teaches
    `vmmgr:rates` (`FleetState.learn_move`). Returns the rate QEMU measured on the wire for the
    one stream (under TCG the CPU may bound it below the link), the median of the moves."""
    image = ensure_builtin(paths.images)
    name = "br-warmup"
    if fleet.find(name):
        fleet.destroy(name)
    fleet.state.r.delete(deadline_run.RATES)  # learnt afresh on this lab
    fleet.create(make_spec(name, memory_mib=128, vcpus=1, kernel=image.kernel,
                           initrd=image.initrd, cmdline=workloads.cmdline("counter", {}),
                           image_root=paths.images, workload="counter"), "host1")
    try:
        time.sleep(8)
        rates = [migrate(fleet, name, to, policy=get_policy(DEFAULT_POLICY)).link_mibps
                 for to in ("host2", "host3", "host1")]
        return sorted(rates)[1]
    finally:
        fleet.destroy(name)


def measure_storage_mibps(storage: Path, mib: int = 256) -> float:
    """Sequential write to the shared storage, flushed: what a save's image write meets."""
    path = storage / ".bench-write"
    block = os.urandom(MiB)
    t0 = time.monotonic()
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.monotonic() - t0
    path.unlink()
    return mib / elapsed


def markdown(report) -> str:
    head = (f"Reclaim benchmark: host1 holds {len(VMS)} VMs, {report['total_ram_mib']} MiB in all "
            f"(idle, light, heavy, a two-VM job), accelerator {report['accel']}; link "
            f"{report['link_mibps']} MiB/s (shaped to {report['link_shaped_mbit']} Mbit/s), "
            f"one migration stream {report.get('stream_mibps', '–')} MiB/s, a move sends "
            f"{report.get('sent_fraction', 1.0):g} of the memory and spends "
            f"{report.get('overhead_s', '–')} s outside the copy (learnt from 3 moves), "
            f"storage {report['storage_mibps']} MiB/s; physical limit (RAM ÷ the better "
            f"bandwidth) {report['physical_limit_s']} s.\n\n")
    rounds = max(r.get("round", 0) for r in report["runs"]) + 1
    if rounds > 1:
        head += (f"{rounds} rounds of every strategy, interleaved; each cell sums or spans "
                 f"the rounds (last safe: each round's, in order).\n\n")
    rows = ["| deadline | strategy | safe in time | all safe in | kept running | last safe "
            "| ÷ physical limit (worst) | said late before starting | checks |",
            "|---|---|---|---|---|---|---|---|---|"]
    cells: dict[tuple, list] = {}
    for r in report["runs"]:
        cells.setdefault((r["deadline_s"], r["strategy"]), []).append(r)
    for (deadline_s, strategy), rs in cells.items():
        lasts = [r["last_safe_s"] for r in rs if r["last_safe_s"] is not None]
        worst = f"{max(lasts) / report['physical_limit_s']:.1f} ×" if lasts else "–"
        rows.append(
            f"| {deadline_s:.0f} s | {strategy} "
            f"| {sum(r['safe_in_time'] for r in rs)}/{sum(r['vms'] for r in rs)} "
            f"| {sum(r['safe_in_time'] == r['vms'] for r in rs)}/{len(rs)} rounds "
            f"| {sum(r['kept_running'] for r in rs)}/{sum(r['vms'] for r in rs)} "
            f"| {', '.join(f'{x} s' for x in lasts) or '–'} | {worst} "
            f"| {sum(r['said_late'] for r in rs)}/{len(rs)} "
            f"| {'ok' if all(r['verified'] for r in rs) else 'FAILED'} |")
    return head + "\n".join(rows) + "\n"


def plot(report, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    deadlines = sorted({r["deadline_s"] for r in report["runs"]})
    fig, axes = plt.subplots(1, len(deadlines), figsize=(6 * len(deadlines), 4), squeeze=False)
    for ax, d in zip(axes[0], deadlines):
        colours = {s: f"C{i}" for i, s in enumerate(STRATEGIES)}
        labelled = set()
        for r in (x for x in report["runs"] if x["deadline_s"] == d):
            times = sorted(r["safe_at"].values())
            first = r["strategy"] not in labelled
            labelled.add(r["strategy"])
            ax.step([0] + times, range(len(times) + 1), where="post", alpha=0.8,
                    color=colours.get(r["strategy"]), label=r["strategy"] if first else None)
        ax.axvline(d, color="red", linestyle="--", label="deadline")
        ax.axvline(report["physical_limit_s"], color="grey", linestyle=":",
                   label="physical limit")
        ax.set_xlabel("seconds from the notice")
        ax.set_ylabel("VMs safe")
        ax.set_title(f"deadline {d:.0f} s")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
