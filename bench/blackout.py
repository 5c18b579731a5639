"""Benchmark: where a migration's blackout goes, from QEMU's own downtime trace events, for a
plain `virsh migrate --live --p2p` (QEMU's default 300 ms limit) and vmmgr's policy, side by side.

    ./run bench-blackout [--moves 10]

One 128 MiB counter VM is defined with QEMU's trace events switched on (`-trace`, through
libvirt's qemu:commandline, beside vmmgr's own QEMU options: the events are the benchmark's only
addition to how vmmgr defines a VM), and moved
around the lab ring, the method alternating. Each QEMU writes its events to its domain log on its
own host; both hosts share this machine's clock, so the source's and the destination's events
line up. A move's blackout is cut at QEMU's downtime checkpoints:
  stop cpus     src-downtime-start -> src-vm-stopped (the vCPUs leave the guest)
  final ram     -> src-iterable-saved (the RAM still pending at the switch-over, sent paused)
  devices       -> src-non-iterable-saved (device state)
  load          -> dst-precopy-loadvm-completed (the destination has read and loaded it all)
  dst start     -> dst-precopy-bh-vm-started
  libvirt       the rest of libvirt's measured downtime: the source's libvirtd learning that
                QEMU completed, its Finish call to the destination, the destination's `cont`
with the RAM pending when QEMU decided to switch over (its last `migrate_pending_exact`).
Writes bench/results/blackout.json and blackout.md.
"""

import argparse
import json
import re
import sys
import time
from pathlib import Path

import libvirt

from vmmgr.fleet import Fleet
from vmmgr.migration import migrate
from vmmgr.policy import DEFAULT_POLICY, get_policy

from hop import create_counter, raw_hop
from lab_ring import lab_ring

RESULTS = Path(__file__).resolve().parent / "results"
VM = "blackout-probe"
TRACED = ("vmstate_downtime_checkpoint", "migrate_pending_exact")
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
CHECKPOINTS = ("src-downtime-start", "src-vm-stopped", "src-iterable-saved",
               "src-non-iterable-saved", "dst-precopy-loadvm-completed",
               "dst-precopy-bh-vm-started")
PHASES = ("stop cpus", "final ram", "devices", "load", "dst start", "libvirt")
EVENT = re.compile(r"^\d+@(\d+\.\d+):(\w+) (.*)$")
MiB = 2**20


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--moves", type=int, default=10, help="moves per method")
    opts = args.parse_args()
    moves: dict[str, list[dict]] = {"plain": [], "vmmgr": []}
    with lab_ring() as (paths, records, ring):
        with Fleet(paths) as fleet:
            create_counter(fleet, paths, VM, ring[0])
            restart_traced(fleet.host(ring[0]).conn, VM)
            time.sleep(8)  # boot and start counting
            for i in range(opts.moves):
                for method in (("plain", "vmmgr") if i % 2 == 0 else ("vmmgr", "plain")):
                    src = fleet.locate(VM).host_name
                    dst = ring[(ring.index(src) + 1) % len(ring)]
                    logs = {side: qemu_log(paths, host) for side, host in (("src", src), ("dst", dst))}
                    marks = {side: log.stat().st_size if log.exists() else 0
                             for side, log in logs.items()}
                    if method == "plain":
                        downtime = raw_hop(fleet, VM, src, dst)["downtime_ms"]
                    else:
                        downtime = migrate(fleet, VM, dst, policy=get_policy(DEFAULT_POLICY)).downtime_ms
                    time.sleep(0.3)  # QEMU's last lines reach its log
                    move = cut(read_events(logs["src"], marks["src"]),
                               read_events(logs["dst"], marks["dst"]), downtime)
                    moves[method].append(move)
                    print(f"move {i + 1:2} {method:5}: {src}->{dst} downtime {downtime} ms, "
                          f"pending {move['pending_mib']} MiB", flush=True)
                    time.sleep(1)
            fleet.destroy(VM)
    report = summarize(moves, records[0].accel)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "blackout.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "blackout.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def restart_traced(conn, vm: str) -> None:
    """Redefine the VM with QEMU's trace events on, and start it again with them: the migrated
    definition carries them, so every destination's QEMU traces too."""
    dom = conn.lookupByName(vm)
    xml = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
    args = "".join(f"<qemu:arg value='-trace'/><qemu:arg value='{e}'/>" for e in TRACED)
    if "<qemu:commandline>" in xml:  # vmmgr's own QEMU options: the trace events join them
        xml = xml.replace("<qemu:commandline>", f"<qemu:commandline>{args}", 1)
    else:
        xml = xml.replace("<domain ", f"<domain xmlns:qemu='{QEMU_NS}' ", 1).replace(
            "</domain>", f"<qemu:commandline>{args}</qemu:commandline></domain>")
    dom.destroy()
    conn.defineXML(xml)
    dom.create()


def qemu_log(paths, host: str) -> Path:
    return paths.home / "lab" / "hosts" / host / "log" / "qemu" / f"{VM}.log"


def read_events(log: Path, offset: int) -> list[tuple[float, str, str]]:
    """(unix time, event, arguments) of the trace lines written after `offset`."""
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return [(float(m[1]), m[2], m[3].strip()) for m in map(EVENT.match, text.splitlines()) if m]


def cut(src: list, dst: list, downtime_ms: int | None) -> dict:
    """One move's blackout in phases (ms), from its source's and destination's events."""
    at = {}
    for t, name, args in src + dst:
        if name == "vmstate_downtime_checkpoint" and args in CHECKPOINTS:
            at[args] = t  # the last of each: a move has one switch-over
    start = at.get("src-downtime-start")
    pending = [int(args.split()[3]) for t, name, args in src
               if name == "migrate_pending_exact" and start is not None and t <= start]
    if len(at) < len(CHECKPOINTS):
        return {"phases_ms": None, "downtime_ms": downtime_ms, "pending_mib": None}
    marks = [at[c] for c in CHECKPOINTS]
    phases = {name: round((b - a) * 1000, 1) for name, a, b in zip(PHASES, marks, marks[1:])}
    qemu_ms = (marks[-1] - marks[0]) * 1000
    phases["libvirt"] = round(downtime_ms - qemu_ms, 1) if downtime_ms is not None else None
    return {"phases_ms": phases, "downtime_ms": downtime_ms, "qemu_blackout_ms": round(qemu_ms, 1),
            "pending_mib": round(pending[-1] / MiB, 1) if pending else None}


def p50(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def summarize(moves: dict, accel: str) -> dict:
    rows = {}
    for method, ms in moves.items():
        cut_ = [m for m in ms if m["phases_ms"]]
        rows[method] = {
            "moves": len(ms), "traced": len(cut_),
            "downtime_ms_p50": p50(m["downtime_ms"] for m in ms),
            "qemu_blackout_ms_p50": p50(m["qemu_blackout_ms"] for m in cut_),
            "pending_mib_p50": p50(m["pending_mib"] for m in cut_),
            "phases_ms_p50": {k: p50(m["phases_ms"][k] for m in cut_) for k in PHASES},
        }
    return {"accel": accel, "policy": DEFAULT_POLICY, "methods": rows, "moves": moves}


def markdown(r) -> str:
    lines = [
        f"Blackout benchmark: 128 MiB counter VM, accelerator {r['accel']}, QEMU's downtime trace "
        "events on both hosts; plain virsh (QEMU's 300 ms limit) against vmmgr's "
        f"`{r['policy']}` policy, moved alternately in one run. p50s (so the phases need not sum).",
        "",
        "| method | moves (traced) | libvirt downtime | RAM pending at switch-over | "
        + " | ".join(PHASES) + " |",
        "|---|---|---|---|" + "---|" * len(PHASES)]
    for method, row in r["methods"].items():
        lines.append(
            f"| {method} | {row['moves']} ({row['traced']}) | {row['downtime_ms_p50']} ms | "
            f"{row['pending_mib_p50']} MiB | "
            + " | ".join(f"{row['phases_ms_p50'][k]} ms" for k in PHASES) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
