"""Benchmark: placement decisions over a simulated fleet of 1,000 hosts holding 20,000 VMs.

    ./run bench-placement

Pure functions only (no hypervisor): how long one `choose_host` decision takes over every host's
capacity, and how long `plan_evacuation` takes to plan a reclaim of the fullest host. Target: one
decision under 100 ms. Writes bench/results/placement.json and placement.md.
"""

import json
import random
import statistics
import time
from pathlib import Path

from vmmgr.host import Capacity
from vmmgr.placement import choose_host
from vmmgr.reclaim import VMSize, plan_evacuation

RESULTS = Path(__file__).resolve().parent / "results"
HOSTS, VMS, SEED = 1000, 20000, 7


def fleet(rng: random.Random) -> tuple[dict[str, Capacity], dict[str, list[VMSize]]]:
    """1,000 hosts of 256-512 GiB and 64-128 vCPUs, 20,000 VMs of 1-16 GiB placed on them."""
    sizes = {f"h{i:04d}": (rng.choice([256, 384, 512]) * 1024, rng.choice([64, 96, 128]))
             for i in range(HOSTS)}
    vms = {h: [] for h in sizes}
    used = {h: [0, 0] for h in sizes}
    names = list(sizes)
    for i in range(VMS):
        vm = VMSize(f"vm{i:05d}", rng.choice([1, 2, 4, 8, 16]) * 1024, rng.choice([1, 2, 4]))
        for _ in range(20):  # a random host with room (the simulated fleet is ~60 % full)
            h = rng.choice(names)
            if used[h][0] + vm.memory_mib <= sizes[h][0] and used[h][1] + vm.vcpus <= sizes[h][1]:
                vms[h].append(vm)
                used[h][0] += vm.memory_mib
                used[h][1] += vm.vcpus
                break
    caps = {h: Capacity(sizes[h][0], sizes[h][1], used[h][0], used[h][1],
                        tuple(v.name for v in vms[h])) for h in sizes}
    return caps, vms


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    rng = random.Random(SEED)
    caps, vms = fleet(rng)
    placed = sum(len(v) for v in vms.values())
    one = timed(lambda: choose_host(caps, 8192, 4), 200)
    fullest = max(caps, key=lambda h: caps[h].used_memory_mib)
    others = {h: c for h, c in caps.items() if h != fullest}
    plan = timed(lambda: plan_evacuation(vms[fullest], others, deadline=True), 20)
    report = {
        "hosts": HOSTS, "vms_placed": placed,
        "choose_host_ms": {"p50": round(statistics.median(one), 3), "max": round(max(one), 3)},
        "plan_evacuation": {"host": fullest, "vms": len(vms[fullest]),
                            "p50_ms": round(statistics.median(plan), 2), "max_ms": round(max(plan), 2)},
        "target_ms": 100,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "placement.json").write_text(json.dumps(report, indent=2) + "\n")
    md = (f"Placement over {HOSTS} simulated hosts holding {placed} VMs (pure functions):\n\n"
          f"| decision | p50 | max | target |\n|---|---|---|---|\n"
          f"| choose_host (one VM, every host considered) | {report['choose_host_ms']['p50']} ms "
          f"| {report['choose_host_ms']['max']} ms | < 100 ms |\n"
          f"| plan_evacuation ({len(vms[fullest])} VMs of the fullest host onto the other "
          f"{HOSTS - 1}) | {report['plan_evacuation']['p50_ms']} ms "
          f"| {report['plan_evacuation']['max_ms']} ms | – |\n")
    (RESULTS / "placement.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
