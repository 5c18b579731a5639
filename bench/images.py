"""Benchmark: a VM from an OS image on the lab: boot-to-SSH time, and its live migrations
(blackout, total) beside the built-in guest's, in one run.

    ./run bench-images [--boots 3] [--moves 10]

Boot to SSH: `vmmgr vm create NAME --image debian-12 --memory 512` (CLI -> task -> done), then
the first successful `ssh` from the lab's outside client to the VM's stable address through the
edge, timed from the command's start; the VM is destroyed after each boot. Migration: one
disk-backed VM and one 128 MiB counter VM moved around the lab ring in turn with vmmgr's default
policy; the disk-backed VM's disk stays on shared storage, so only its memory moves. Writes
bench/results/images.json and images.md.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vmmgr import image_build, seed
from vmmgr.addresses import pool_for
from vmmgr.fleet import Fleet
from vmmgr.lab_net import CLIENT_NS
from vmmgr.migration import migrate
from vmmgr.policy import DEFAULT_POLICY, get_policy

from hop import create_counter
from lab_ring import lab_ring

RESULTS = Path(__file__).resolve().parent / "results"
VMMGR = Path(sys.executable).parent / "vmmgr"
IMAGE = "debian-12"
MEMORY_MIB = 512


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--boots", type=int, default=3)
    args.add_argument("--moves", type=int, default=10, help="moves per VM")
    opts = args.parse_args()
    boots, moves = [], {"disk-backed": [], "built-in": []}
    with lab_ring() as (paths, records, ring), tempfile.TemporaryDirectory() as tmp:
        env = {"VMMGR_HOME": str(paths.home), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        image_build.build(paths.images, IMAGE, log=lambda m: print(f"  {m}", flush=True))
        key = Path(tmp) / "key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                       check=True)
        with Fleet(paths) as fleet:
            for i in range(opts.boots):
                boots.append(boot_to_ssh(fleet, paths, env, key, f"img-boot{i}", ring[i % 3]))
                print(f"boot {i + 1}: {boots[-1]}", flush=True)
                fleet.destroy(f"img-boot{i}")
            make(env, key, "img-move", ring[0])
            wait_ssh(paths, key, "img-move", time.monotonic(), 600)
            create_counter(fleet, paths, "img-counter", ring[1])
            time.sleep(8)
            for i in range(opts.moves):
                for kind, vm in (("disk-backed", "img-move"), ("built-in", "img-counter")):
                    src = fleet.locate(vm).host_name
                    dst = ring[(ring.index(src) + 1) % 3]
                    r = migrate(fleet, vm, dst, policy=get_policy(DEFAULT_POLICY))
                    moves[kind].append({"total_ms": r.total_ms, "wall_ms": r.wall_ms,
                                        "downtime_ms": r.downtime_ms,
                                        "sent_mib": round(r.bytes_transferred / 2**20, 1)})
                    print(f"move {i + 1} {kind}: {src}->{dst} {moves[kind][-1]}", flush=True)
                    time.sleep(1)
            intact = wait_ssh(paths, key, "img-move", time.monotonic(), 60) is not None
            for vm in ("img-move", "img-counter"):
                fleet.destroy(vm)
    report = summarize(boots, moves, records[0].accel, intact)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "images.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "images.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def make(env, key: Path, vm: str, host: str) -> None:
    subprocess.run([str(VMMGR), "vm", "create", vm, "--image", IMAGE, "--memory",
                    str(MEMORY_MIB), "--host", host, "--ssh-key", f"{key}.pub"],
                   env=env, check=True, capture_output=True, text=True, timeout=300)


def boot_to_ssh(fleet, paths, env, key: Path, vm: str, host: str) -> dict:
    t0 = time.monotonic()
    make(env, key, vm, host)
    created = time.monotonic()
    ssh_at = wait_ssh(paths, key, vm, t0, 600)
    return {"host": host, "create_s": round(created - t0, 1),
            "ssh_s": round(ssh_at - t0, 1) if ssh_at else None}


def wait_ssh(paths, key: Path, vm: str, t0: float, timeout: float) -> float | None:
    """When `ssh` first ran a command in the VM (monotonic), or None."""
    address = pool_for(paths).address_of(vm)
    while time.monotonic() - t0 < timeout:
        proc = subprocess.run(
            ["ip", "netns", "exec", CLIENT_NS, "ssh", "-i", str(key), "-o", "BatchMode=yes",
             "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
             "-o", "ConnectTimeout=3", "-o", "LogLevel=ERROR", f"{seed.USER}@{address}", "true"],
            capture_output=True, timeout=30)
        if proc.returncode == 0:
            return time.monotonic()
        time.sleep(1)
    return None


def p(values, q):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def summarize(boots, moves, accel, intact) -> dict:
    rows = {kind: {"moves": len(ms), "total_ms_p50": p([m["total_ms"] for m in ms], 50),
                   "wall_ms_p50": p([m["wall_ms"] for m in ms], 50),
                   "blackout_ms_p50": p([m["downtime_ms"] for m in ms], 50),
                   "blackout_ms_p99": p([m["downtime_ms"] for m in ms], 99),
                   "sent_mib_p50": p([m["sent_mib"] for m in ms], 50)}
            for kind, ms in moves.items()}
    ssh = [b["ssh_s"] for b in boots if b["ssh_s"] is not None]
    return {"accel": accel, "policy": DEFAULT_POLICY, "image": IMAGE, "memory_mib": MEMORY_MIB,
            "boots": boots, "boot_to_ssh_s_median": statistics.median(ssh) if ssh else None,
            "ssh_after_moves": intact, "migration": rows, "moves": moves}


def markdown(r) -> str:
    lines = [
        f"Images benchmark: accelerator {r['accel']}, `{r['image']}` VMs of {r['memory_mib']} MiB, "
        f"vmmgr policy `{r['policy']}`.", "",
        "Boot to SSH (`vm create` to the first command run over SSH through the edge): "
        + ", ".join(f"{b['ssh_s']} s" for b in r["boots"])
        + f" (median {r['boot_to_ssh_s_median']} s; the create itself "
        + ", ".join(f"{b['create_s']} s" for b in r["boots"]) + ").", "",
        "| VM | moves | total p50 | wall p50 | blackout p50 / p99 | sent p50 |",
        "|---|---|---|---|---|---|"]
    for kind, row in r["migration"].items():
        lines.append(f"| {kind} | {row['moves']} | {row['total_ms_p50']} ms | "
                     f"{row['wall_ms_p50']} ms | {row['blackout_ms_p50']} / "
                     f"{row['blackout_ms_p99']} ms | {row['sent_mib_p50']} MiB |")
    lines += ["", f"SSH to the disk-backed VM after its moves: {'yes' if r['ssh_after_moves'] else 'NO'}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
