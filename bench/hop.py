"""Benchmark: the wall time of one hop as an operator waits for it, `vmmgr migrate start` (CLI ->
task API -> worker -> done) against a raw `virsh migrate --live --p2p` of the same kind of VM,
side by side on the lab, with the CLI's hop broken into phases.

    ./run bench-hop [--moves 10]

Two 128 MiB counter VMs, one per method, moved around the lab ring in turn (hop by hop, the
method that goes first alternating), so both see the same machine at the same time. Each move is
timed from the command's start to its exit. The CLI's hop is split by the times the task records
(submitted, started, ended) and the migration's own result (when libvirt's call began, its wall
time, QEMU's time):
  cli+checks   the CLI process starting, its imports, the request's checks, until queued
  queue        queued until a worker runs it
  worker pre   the task running until the migration starts (lock, fleet, policy)
  vmmgr call   the migration call's wall time beyond QEMU's own (define, monitor, switch-over)
  qemu         QEMU's time from start to the guest running on the target
  worker post  the migration done until the task's end is recorded (routes, records, events)
  result       the task ended until the CLI exits (its poll, printing, exit)
Both methods' hops are also cut where libvirt's lifecycle events fall on the two hosts (the
same for either method: the part of the hop that is libvirt's and QEMU's):
  prepare      the command started until the destination's QEMU runs (migrated in)
  copy         until the source pauses for the switch-over
  switch-over  until the guest resumes on the destination (the blackout as libvirt sees it)
  confirm      until the source's QEMU has stopped
  exit         until the command returns
Target (issue 16): the CLI hop <= 1.1 x raw virsh (reported for the p50s and the means). Writes bench/results/hop.json, hop.md.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import libvirt

from vmmgr import console, workloads
from vmmgr.fleet import Fleet
from vmmgr.images import ensure_builtin
from vmmgr.migration import peer_uri
from vmmgr.spec import make_spec
from vmmgr.state import FleetState

from lab_ring import lab_ring

RESULTS = Path(__file__).resolve().parent / "results"
VMMGR = Path(sys.executable).parent / "vmmgr"
PHASES = ("cli+checks", "queue", "worker pre", "vmmgr call", "qemu", "worker post", "result")


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--moves", type=int, default=10)
    opts = args.parse_args()
    raw, cli = [], []
    with lab_ring() as (paths, records, ring):
        # The CLI as installed: its bytecode cached (pip compiles it), whatever this shell says.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["VMMGR_HOME"] = str(paths.home)
        with Fleet(paths) as fleet:
            vms = {"raw": "hop-raw", "cli": "hop-cli"}
            for vm in vms.values():
                create_counter(fleet, paths, vm, ring[0])
            time.sleep(8)  # boot and start counting
            state = FleetState(paths.redis_url())
            for i in range(opts.moves):
                order = ("raw", "cli") if i % 2 == 0 else ("cli", "raw")
                for method in order:
                    vm = vms[method]
                    src = fleet.locate(vm).host_name
                    dst = ring[(ring.index(src) + 1) % len(ring)]
                    if method == "raw":
                        raw.append(raw_hop(fleet, vm, src, dst))
                    else:
                        cli.append(cli_hop(fleet, state, env, vm, src, dst))
                    print(f"move {i + 1:2} {method}: {src}->{dst} "
                          f"{(raw if method == 'raw' else cli)[-1]['wall_ms']} ms", flush=True)
                    time.sleep(1)
            time.sleep(2)
            contiguous = {m: counter_contiguous(paths, vm) for m, vm in vms.items()}
            for vm in vms.values():
                fleet.destroy(vm)
    report = summarize(raw, cli, contiguous, records[0].accel, opts.moves)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hop.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "hop.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def create_counter(fleet, paths, vm, host) -> None:
    if fleet.find(vm):
        fleet.destroy(vm)
    image = ensure_builtin(paths.images)
    fleet.create(make_spec(vm, memory_mib=128, vcpus=1, kernel=image.kernel, initrd=image.initrd,
                           cmdline=workloads.cmdline("counter", {"interval": "0.2"}),
                           image_root=paths.images, workload="counter"), host)


EVENTS = {("dst", libvirt.VIR_DOMAIN_EVENT_STARTED): "started",
          ("src", libvirt.VIR_DOMAIN_EVENT_SUSPENDED): "paused",
          ("dst", libvirt.VIR_DOMAIN_EVENT_RESUMED): "resumed",
          ("src", libvirt.VIR_DOMAIN_EVENT_STOPPED): "stopped"}
LIBVIRT_PHASES = ("prepare", "copy", "switch-over", "confirm", "exit")


class Timeline:
    """When libvirt's lifecycle events of one hop arrive (monotonic, the first of each)."""

    def __init__(self, fleet, vm, src, dst):
        self.hosts = {"src": fleet.host(src), "dst": fleet.host(dst)}
        self.vm, self.at, self.tokens = vm, {}, {}

    def __enter__(self):
        for side, host in self.hosts.items():
            self.tokens[side] = host.watch_lifecycle(
                self.vm, lambda event, detail, side=side: self.at.setdefault(
                    EVENTS.get((side, event)), time.monotonic()))
        return self

    def __exit__(self, *exc):
        time.sleep(0.2)  # the last events may trail the command's exit
        for side, token in self.tokens.items():
            self.hosts[side].unwatch(token)

    def phases_ms(self, t0: float, t_exit: float) -> dict | None:
        """The hop cut at the events; None when one did not come."""
        marks = [t0, *(self.at.get(k) for k in ("started", "paused", "resumed", "stopped"))]
        if None in marks:
            return None
        marks.append(max(t_exit, marks[-1]))
        return {name: round((b - a) * 1000)
                for name, a, b in zip(LIBVIRT_PHASES, marks, marks[1:])}


def raw_hop(fleet, vm, src, dst) -> dict:
    """virsh as an operator would type it, TLS as the hosts are set up."""
    cmd = ["virsh", "-c", fleet.host(src).uri, "migrate", "--live", "--p2p", "--persistent",
           "--undefinesource", vm, peer_uri(fleet.host(dst).uri)]
    if fleet.host(dst).record.tls:
        cmd.append("--tls")
    with Timeline(fleet, vm, src, dst) as timeline:
        t0 = time.monotonic()
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        t_exit = time.monotonic()
    stats = fleet.host(dst).find_guest(vm).job_stats(completed=True)
    return {"wall_ms": round((t_exit - t0) * 1000), "qemu_ms": stats.get("time_elapsed"),
            "downtime_ms": stats.get("downtime"), "libvirt_ms": timeline.phases_ms(t0, t_exit)}


def cli_hop(fleet, state: FleetState, env: dict, vm: str, src: str, dst: str) -> dict:
    with Timeline(fleet, vm, src, dst) as timeline:
        t0, m0 = time.time(), time.monotonic()
        proc = subprocess.run([str(VMMGR), "migrate", "start", vm, "--to", dst, "--json"],
                              env=env, capture_output=True, text=True, timeout=180)
        t_exit, m_exit = time.time(), time.monotonic()
    if proc.returncode != 0:
        raise SystemExit(f"vmmgr migrate failed: {proc.stderr.strip()}")
    result = json.loads(proc.stdout)
    task = state.task(re.search(r"task ([0-9a-f-]{36})", proc.stderr).group(1))
    submitted, started, ended = (float(task[k]) for k in ("submitted", "started", "ended"))
    call_start = result["started_at"]
    call_end = call_start + result["wall_ms"] / 1000
    phases = {
        "cli+checks": submitted - t0, "queue": started - submitted,
        "worker pre": call_start - started,
        "vmmgr call": (result["wall_ms"] - result["total_ms"]) / 1000,
        "qemu": result["total_ms"] / 1000, "worker post": ended - call_end,
        "result": t_exit - ended}
    return {"wall_ms": round((t_exit - t0) * 1000), "qemu_ms": result["total_ms"],
            "downtime_ms": result["downtime_ms"],
            "phases_ms": {k: round(v * 1000) for k, v in phases.items()},
            "libvirt_ms": timeline.phases_ms(m0, m_exit)}


def counter_contiguous(paths, vm) -> bool:
    with Fleet(paths) as fleet:
        text = console.read(fleet.consoles, vm).decode(errors="replace").replace("\r", "")
    ticks = [int(l.split()[1]) for l in text.splitlines() if l.startswith("tick ")]
    return bool(ticks) and ticks == list(range(ticks[0], ticks[0] + len(ticks)))


def p50(values):
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def summarize(raw, cli, contiguous, accel, moves) -> dict:
    raw_p50, cli_p50 = p50([m["wall_ms"] for m in raw]), p50([m["wall_ms"] for m in cli])
    return {
        "accel": accel, "moves": moves, "contiguous": contiguous,
        "raw_wall_ms_p50": raw_p50, "cli_wall_ms_p50": cli_p50,
        "ratio_p50": round(cli_p50 / raw_p50, 2),
        "ratio_mean": round(statistics.mean(m["wall_ms"] for m in cli)
                            / statistics.mean(m["wall_ms"] for m in raw), 2),
        "raw_qemu_ms_p50": p50([m["qemu_ms"] for m in raw]),
        "raw_outside_qemu_ms_p50": p50([m["wall_ms"] - m["qemu_ms"] for m in raw]),
        "cli_phases_ms_p50": {k: p50([m["phases_ms"][k] for m in cli]) for k in PHASES},
        "libvirt_phases_ms_p50": {
            method: {k: p50([m["libvirt_ms"][k] for m in moves if m["libvirt_ms"]])
                     for k in LIBVIRT_PHASES}
            for method, moves in (("raw", raw), ("cli", cli))},
        "raw": raw, "cli": cli,
    }


def markdown(r) -> str:
    lines = [
        f"Hop benchmark: {r['moves']} moves per method, 128 MiB counter VMs, accelerator "
        f"{r['accel']}, interleaved in one run. Counters contiguous: "
        + ", ".join(f"{k} {v}" for k, v in r["contiguous"].items()) + ".", "",
        "| method | wall p50 | QEMU p50 | outside QEMU |", "|---|---|---|---|",
        f"| raw `virsh migrate --live --p2p` | {r['raw_wall_ms_p50']} ms | "
        f"{r['raw_qemu_ms_p50']} ms | {r['raw_outside_qemu_ms_p50']} ms |",
        f"| `vmmgr migrate start` (CLI -> task -> done) | {r['cli_wall_ms_p50']} ms | "
        f"{r['cli_phases_ms_p50']['qemu']} ms | "
        f"{r['cli_wall_ms_p50'] - r['cli_phases_ms_p50']['qemu']} ms |", "",
        f"CLI hop ÷ raw virsh: **{r['ratio_p50']} ×** of the p50s, {r['ratio_mean']} × of the "
        "means (target ≤ 1.1 ×).", "",
        "The CLI hop's phases (p50 of each, so they need not sum to the wall p50):", "",
        "| " + " | ".join(PHASES) + " |", "|" + "---|" * len(PHASES),
        "| " + " | ".join(f"{r['cli_phases_ms_p50'][k]} ms" for k in PHASES) + " |", "",
        "Either hop cut at libvirt's lifecycle events on the two hosts (p50s):", "",
        "| method | " + " | ".join(LIBVIRT_PHASES) + " |", "|---|" + "---|" * len(LIBVIRT_PHASES),
        *(f"| {method} | " + " | ".join(f"{phases[k]} ms" for k in LIBVIRT_PHASES) + " |"
          for method, phases in r["libvirt_phases_ms_p50"].items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
