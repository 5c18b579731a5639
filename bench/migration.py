"""Benchmark: plain `virsh migrate --live` against vmmgr's default policy, side by side on the lab.

    ./run bench [--moves 10] [--timeout 45]

Three workloads on the built-in guest, each moved around the lab ring N times by each method:
  idle   the counter (128 MiB guest), full link speed
  light  dirtier at 4 MiB/s over 32 MiB (192 MiB guest), full link speed
  heavy  dirtier at 64 MiB/s over 64 MiB (192 MiB guest) on a link capped at 24 MiB/s (both
         methods get the cap): the guest dirties memory more than twice as fast as the link sends
Plain is `virsh migrate --live --p2p --persistent --undefinesource` with QEMU's defaults, aborted
with `virsh domjobabort` if it has not finished within the completion timeout. Every move is
checked: the counter's console must stay contiguous; the dirtier verifies each page it rewrites
and must print no CORRUPT line and never restart.

The physical limit of a move is the guest's RAM divided by the link's bandwidth, measured here
with a TCP stream between two lab hosts (for heavy: the cap). Writes bench/results/migration.json,
migration.md and migration.png.

`--link-mbit N` shapes every lab host's inter-host link to N Mbit/s (tc tbf) for the run, as on
real hosts where the network is the bottleneck: on the bare veth (~2 GiB/s) a TCG guest's
migration is bound by QEMU's CPU, not by the link. Results then go to migration-<N>mbit.*.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from vmmgr import console, workloads
from vmmgr.errors import MigrationFailed
from vmmgr.fleet import Fleet
from vmmgr.images import ensure_builtin
from vmmgr.lab import Lab, lab_host
from vmmgr.migration import MigrationResult, migrate, peer_uri
from vmmgr.paths import lab_paths
from vmmgr.policy import DEFAULT_POLICY, get_policy
from vmmgr.spec import make_spec

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = {
    "idle": {"workload": "counter", "params": {"interval": "0.2"}, "memory": 128, "cap": 0},
    "light": {"workload": "dirtier", "params": {"rate": "4", "mib": "32"}, "memory": 192, "cap": 0},
    "heavy": {"workload": "dirtier", "params": {"rate": "64", "mib": "64"}, "memory": 192, "cap": 24},
}
METHODS = ("plain", "vmmgr")
MiB = 2**20


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--moves", type=int, default=10)
    args.add_argument("--timeout", type=float, default=45, help="completion timeout per move, s")
    args.add_argument("--workloads", default=",".join(WORKLOADS))
    args.add_argument("--link-mbit", type=int, default=0, help="shape the inter-host link")
    args.add_argument("--replot", action="store_true",
                      help="only redraw migration.md and migration.png from migration.json")
    opts = args.parse_args()
    if opts.replot:
        report = json.loads((RESULTS / "migration.json").read_text())
        (RESULTS / "migration.md").write_text(markdown(report))
        plot(report, RESULTS / "migration.png")
        return 0

    paths = lab_paths()
    lab = Lab(paths, log=lambda m: print(f"  {m}", flush=True))
    started_lab = not lab.running_hosts()
    records = lab.up(3)
    ring = [r.name for r in records[:3]]
    uris = {r.name: r.uri for r in records}
    runs = []
    try:
        shape_links(ring, opts.link_mbit)
        link = measure_link_mibps()
        print(f"link between lab hosts: {link:.0f} MiB/s; accelerator {records[0].accel}", flush=True)
        with Fleet(paths) as fleet:
            for wname in opts.workloads.split(","):
                for method in METHODS:
                    runs.append(bench_one(fleet, paths, uris, ring, wname, method, opts, link))
    finally:
        shape_links(ring, 0)
        if started_lab:
            lab.down()
    report = {"accel": records[0].accel, "link_mibps": round(link, 1), "moves": opts.moves,
              "link_shaped_mbit": opts.link_mbit or None,
              "timeout_s": opts.timeout, "policy": DEFAULT_POLICY, "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    stem = f"migration-{opts.link_mbit}mbit" if opts.link_mbit else "migration"
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(report))
    plot(report, RESULTS / f"{stem}.png")
    print(markdown(report))
    return 0


def bench_one(fleet, paths, uris, ring, wname, method, opts, link) -> dict:
    w = WORKLOADS[wname]
    vm = f"bench-{wname}-{method}"
    if fleet.find(vm):
        fleet.destroy(vm)
    image = ensure_builtin(paths.images)
    spec = make_spec(vm, memory_mib=w["memory"], vcpus=1, kernel=image.kernel, initrd=image.initrd,
                     cmdline=workloads.cmdline(w["workload"], w["params"]),
                     image_root=paths.images, workload=w["workload"])
    fleet.create(spec, ring[0])
    time.sleep(8)  # boot and start the workload
    moves = []
    try:
        for i in range(opts.moves):
            src = fleet.locate(vm).host_name
            dst = ring[(ring.index(src) + 1) % len(ring)]
            move = (plain_move(fleet, uris, vm, src, dst, w["cap"], opts.timeout) if method == "plain"
                    else vmmgr_move(fleet, vm, dst, w["cap"], opts.timeout))
            moves.append(move)
            print(f"{wname:5} {method:5} move {i + 1:2}: {src}->{dst} "
                  f"{'ok' if move['converged'] else 'NOT CONVERGED'} total {move['total_ms']} ms "
                  f"blackout {move['downtime_ms']} ms", flush=True)
            time.sleep(1)
        time.sleep(3)
        verified, detail = verify(paths, vm, w["workload"])
    finally:
        fleet.destroy(vm)
    done = [m for m in moves if m["converged"]]
    blackouts = [m["downtime_ms"] for m in done if m["downtime_ms"] is not None]
    limit_mibps = min(link, w["cap"]) if w["cap"] else link
    limit_ms = w["memory"] / limit_mibps * 1000
    totals = [m["total_ms"] for m in done]
    return {
        "workload": wname, "method": method, "moves": len(moves), "converged": len(done),
        "total_ms_p50": pct(totals, 50), "blackout_ms_p50": pct(blackouts, 50),
        "blackout_ms_p99": pct(blackouts, 99),
        "sent_mib_p50": round(pct([m["bytes"] / MiB for m in done], 50) or 0, 1),
        "memory_verified": verified, "verification": detail,
        "physical_limit_ms": round(limit_ms), "ratio_to_limit_p50":
            round(pct(totals, 50) / limit_ms, 2) if totals else None,
        "postcopy_moves": sum(1 for m in moves if m.get("postcopy")),
        "detail": moves,
    }


def plain_move(fleet, uris, vm, src, dst, cap, timeout) -> dict:
    # the destination as the source's libvirtd dials it, over TLS when the hosts are set up so
    cmd = ["virsh", "-c", uris[src], "migrate", "--live", "--p2p", "--persistent",
           "--undefinesource", vm, peer_uri(uris[dst])]
    if fleet.host(dst).record.tls:
        cmd.append("--tls")
    if cap:
        cmd += ["--bandwidth", str(cap)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["virsh", "-c", uris[src], "domjobabort", vm], capture_output=True)
        proc.wait(60)
        return {"converged": False, "total_ms": int((time.monotonic() - t0) * 1000),
                "downtime_ms": None, "bytes": 0}
    if proc.returncode != 0:
        return {"converged": False, "total_ms": int((time.monotonic() - t0) * 1000),
                "downtime_ms": None, "bytes": 0, "error": proc.stderr.read().strip()}
    stats = fleet.host(dst).find_guest(vm).job_stats(completed=True)
    return {"converged": True, "total_ms": stats.get("time_elapsed"),
            "downtime_ms": stats.get("downtime"), "bytes": stats.get("data_processed", 0)}


def vmmgr_move(fleet, vm, dst, cap, timeout) -> dict:
    policy = get_policy(None, cap or None, completion_timeout_s=timeout)
    try:
        r: MigrationResult = migrate(fleet, vm, dst, policy=policy)
    except MigrationFailed as err:
        return {"converged": False, "total_ms": int(timeout * 1000), "downtime_ms": None,
                "bytes": 0, "error": str(err)}
    return {"converged": True, "total_ms": r.total_ms, "downtime_ms": r.downtime_ms,
            "bytes": r.bytes_transferred, "postcopy": r.postcopy}


def verify(paths, vm, workload) -> tuple[bool, str]:
    with Fleet(paths) as fleet:
        text = console.read(fleet.consoles, vm).decode(errors="replace").replace("\r", "")
    lines = text.splitlines()
    if workload == "counter":
        ticks = [int(l.split()[1]) for l in lines if l.startswith("tick ")]
        ok = bool(ticks) and ticks == list(range(ticks[0], ticks[0] + len(ticks)))
        return ok, f"{len(ticks)} ticks, contiguous: {ok}"
    corrupt = [l for l in lines if l.startswith("CORRUPT")]
    starts = sum(l.startswith("dirtier start") for l in lines)
    passes = [l for l in lines if "pass=" in l]
    ok = not corrupt and starts == 1 and len(passes) > 0
    return ok, f"{len(passes)} status lines, {len(corrupt)} CORRUPT, {starts} start(s)"


def pct(values, p):
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def shape_links(hosts: list[str], mbit: int) -> None:
    """Shape each lab host's inter-host link to `mbit` (0: remove the shaping)."""
    for name in hosts:
        ns = f"vmmgr-{name}"
        if mbit:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0",
                            "root", "tbf", "rate", f"{mbit}mbit", "burst", "256kb",
                            "latency", "50ms"], check=True)
        else:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"],
                           capture_output=True)


def measure_link_mibps(seconds: float = 2.0) -> float:
    """TCP throughput from lab host1 to host2 over the inter-host bridge, in MiB/s."""
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", lab_host(2).namespace, sys.executable, "-c",
         "import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
         f"s.bind(('{lab_host(2).ip}',5201));s.listen(1);c,_=s.accept();n=0\n"
         "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\nprint(n)"],
        stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    sender = (
        "import socket,time;s=socket.create_connection(('%s',5201));b=b'x'*(1<<20);"
        "t=time.monotonic()\nwhile time.monotonic()-t<%f: s.sendall(b)\ns.close();"
        "print(time.monotonic()-t)" % (lab_host(2).ip, seconds))
    out = subprocess.run(["ip", "netns", "exec", lab_host(1).namespace, sys.executable, "-c",
                          sender], capture_output=True, text=True, check=True).stdout
    elapsed = float(out.strip())
    received = int(receiver.communicate(timeout=30)[0].strip())
    return received / MiB / elapsed


def markdown(report) -> str:
    shaped = report.get("link_shaped_mbit")
    head = (f"Migration benchmark: {report['moves']} moves per row, accelerator {report['accel']}, "
            f"link {report['link_mibps']} MiB/s"
            f"{f' (shaped to {shaped} Mbit/s)' if shaped else ' (bare veth)'}, "
            f"completion timeout {report['timeout_s']:g} s, "
            f"vmmgr policy `{report['policy']}`.\n\n")
    rows = ["| workload | method | converged | total p50 | blackout p50 | blackout p99 | sent p50 "
            "| memory verified | total ÷ (RAM ÷ link) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        fmt = lambda v, unit="ms": "–" if v is None else f"{v} {unit}"
        rows.append(
            f"| {r['workload']} | {r['method']} | {r['converged']}/{r['moves']}"
            f"{' (' + str(r['postcopy_moves']) + ' post-copy)' if r['postcopy_moves'] else ''} "
            f"| {fmt(r['total_ms_p50'])} | {fmt(r['blackout_ms_p50'])} | {fmt(r['blackout_ms_p99'])} "
            f"| {r['sent_mib_p50']} MiB | {'yes' if r['memory_verified'] else 'NO'} "
            f"({r['verification']}) | {fmt(r['ratio_to_limit_p50'], '×')} |")
    return head + "\n".join(rows) + "\n"


def plot(report, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in report["runs"]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "total_ms_p50", "total time p50 (ms)"),
                           (axes[1], "blackout_ms_p50", "blackout p50 (ms)")):
        for i, method in enumerate(METHODS):
            vals = []
            for n in names:
                r = next(r for r in report["runs"] if r["workload"] == n and r["method"] == method)
                vals.append(r[key] or 0)
            xs = [j + i * 0.38 for j in range(len(names))]
            ax.bar(xs, vals, width=0.36, label=method)
            for x, n in zip(xs, names):
                r = next(r for r in report["runs"] if r["workload"] == n and r["method"] == method)
                if r["converged"] < r["moves"]:
                    ax.text(x, 0.04, f"{r['converged']}/{r['moves']}\nconverged", ha="center",
                            fontsize=8, color="red", transform=ax.get_xaxis_transform())
        ax.set_xticks([j + 0.19 for j in range(len(names))], names)
        ax.set_title(title)
        ax.set_yscale("log")
        ax.legend()
    link = (f"link {report['link_shaped_mbit']} Mbit/s" if report.get("link_shaped_mbit")
            else "bare veth link")
    fig.suptitle(f"plain virsh vs vmmgr ({report['policy']}), {report['moves']} moves each, "
                 f"{report['accel']}, {link}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
