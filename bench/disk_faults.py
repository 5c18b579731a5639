"""Benchmark: faults in the disk phase of a move between sites, each many times.

    ./run bench-disk-faults [--runs N] [--only NAME ...]

The lab with each host a site of its own (every move crosses a WAN) and one Debian VM whose disk
is on its host's own storage, 64 MiB of random data written on it and its checksum taken. Each
fault strikes two seconds into a move's disk phase (the disk copied at 5 MiB/s to one of the
other hosts, in turn: about 15 s), N times (default 3); the lab is repaired as an operator would
(`lab up`, or a daemon restarted as systemd would). Once the fleet has settled, the VM must run
on exactly one host, its record saying so within 60 s, its disk held by that host alone (the
move, or the reconcile's sweep once the other answers, takes back what it laid elsewhere) and
its data unchanged. tests/lab/test_local_disks.py runs each of these once. Writes
bench/results/disk-faults.json and disk-faults.md.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from faults import Lab3, settle, wait
from images import IMAGE, wait_ssh
from lab_ring import lab_ring

from vmmgr import image_build, local_disks, seed
from vmmgr.addresses import pool_for
from vmmgr.errors import VmmgrError
from vmmgr.fleet import Fleet
from vmmgr.lab import Lab
from vmmgr.lab_net import CLIENT_NS

RESULTS = Path(__file__).resolve().parent / "results"
VM, MEMORY_MIB, DATA_MIB = "bench-diskfault", 512, 64
HOSTS = ("host1", "host2", "host3")
FAULTS = {}  # name -> what strikes: (c, task, source, target)


def fault(name: str):
    def register(fn):
        FAULTS[name] = fn
        return fn
    return register


@fault("worker SIGKILLed in the disk phase")
def worker(c: Lab3, task: str, source: str, target: str) -> None:
    c.kill_worker_of(task)
    c.lab.up(3)  # its worker back (the sites as they were); its rerun, or recover, ends the move


@fault("target's libvirtd SIGKILLed in the disk phase, restarted")
def target_libvirtd(c: Lab3, task: str, source: str, target: str) -> None:
    os.kill(c.libvirtd_pid(target), signal.SIGKILL)
    wait(lambda: c.task_state(task) in ("SUCCESS", "FAILURE"), 180, "the move never ended")
    c.lab.restart_libvirtd(target)


@fault("source's libvirtd SIGKILLed in the disk phase, restarted")
def source_libvirtd(c: Lab3, task: str, source: str, target: str) -> None:
    os.kill(c.libvirtd_pid(source), signal.SIGKILL)
    time.sleep(2)
    c.lab.restart_libvirtd(source)  # its QEMU ran on meanwhile


@fault("WAN to the target cut in the disk phase, back 5 s later")
def wan_cut(c: Lab3, task: str, source: str, target: str) -> None:
    c.link(False, source=source, target=target)
    try:
        time.sleep(5)
    finally:
        c.link(True, source=source, target=target)


@fault("cancelled in the disk phase")
def cancelled(c: Lab3, task: str, source: str, target: str) -> None:
    try:
        c.cli("migrate", "cancel", VM)
    except RuntimeError as err:  # the move ended first: the verdict still holds
        return f"not cancelled: {err}"


def holders(fleet: Fleet) -> list[str]:
    """The hosts whose own storage holds a disk of the VM (asked of each host's libvirt)."""
    return [h for h in HOSTS if local_disks.find(fleet.host(h).conn, VM) is not None]


def where(fleet: Fleet) -> list[str]:
    return [g.host_name for g in fleet.find_all(VM)]


def ssh(paths, key: Path, command: str) -> str:
    proc = subprocess.run(
        ["ip", "netns", "exec", CLIENT_NS, "ssh", "-i", str(key), "-o", "BatchMode=yes",
         "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
         "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR",
         f"{seed.USER}@{pool_for(paths).address_of(VM)}", command],
        capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise RuntimeError(f"ssh {command!r}: {proc.stderr.strip()}")
    return proc.stdout


def data_sum(paths, key: Path) -> str:
    return ssh(paths, key, "sync; echo 3 | sudo -n tee /proc/sys/vm/drop_caches >/dev/null "
                           "2>&1; sha256sum data")


def strike(c: Lab3, fleet: Fleet, name: str, run: int, key: Path, written: str) -> dict:
    """One move cut short by the fault `name`, and the verdict once the fleet has settled. The
    target alternates between the two other hosts from one run to the next."""
    source = where(fleet)[0]
    target = [h for h in HOSTS if h != source][run % 2]
    t0 = time.monotonic()
    task = c.task_of(c.cli("migrate", VM, "--to", target, "--bandwidth", "5", "--no-wait"))
    wait(lambda: len(holders(fleet)) == 2, 60, "no disk was laid on the target")
    time.sleep(2)  # well into the copy (75 MiB at 5 MiB/s)
    note = FAULTS[name](c, task, source, target)
    error = ""

    def one_disk_where_it_runs() -> bool:
        try:
            return len(where(fleet)) == 1 and holders(fleet) == where(fleet)
        except VmmgrError:
            return False  # a host not answering yet
    try:
        settle(c, [VM], timeout=300)
        wait(one_disk_where_it_runs, 180, "a disk stayed on a host that does not hold the VM")
    except TimeoutError as err:
        error = str(err)
    try:
        copies = fleet.find_all(VM)
        running = [g.host_name for g in copies if g.is_active() and g.state() == "running"]
        disks = holders(fleet)
    except VmmgrError as err:  # a host still silent: no verdict to give
        return {"fault": name, "from": source, "to": target, "where": [], "disks": [],
                "error": str(err), "outcome": "unknown", "record_agrees_s": None,
                "data_ok": False, "moved": False, "note": note,
                "seconds": round(time.monotonic() - t0, 1)}
    out = {"fault": name, "from": source, "to": target, "note": note,
           "where": sorted(g.host_name for g in copies), "disks": disks, "error": error,
           "outcome": ("lost" if not copies else "twice" if len(copies) > 1
                       else "ok" if running else "stopped")}
    t1 = time.monotonic()
    try:
        wait(lambda: running and (c.state.vm(VM).get("state"), c.state.vm(VM).get("host"))
             == ("running", running[0]), 60, "the record never agreed")
        out["record_agrees_s"] = round(time.monotonic() - t1, 1)
    except TimeoutError:
        out["record_agrees_s"] = None
    try:
        out["data_ok"] = bool(running) and data_sum(c.paths, key) == written
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        out["data_ok"], out["error"] = False, out["error"] or str(err)
    out["moved"] = running == [target]
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--runs", type=int, default=3)
    args.add_argument("--only", nargs="*", help="faults to run (default: all)")
    opts = args.parse_args()
    names = [n for n in FAULTS if not opts.only or any(o.lower() in n.lower() for o in opts.only)]
    rows: list[dict] = []
    try:
        run(opts, names, rows)
    finally:
        write(rows, accel_of(rows), opts.runs)  # what ran, failure included
    return 0 if rows and all(r["outcome"] == "ok" and r["data_ok"] and not r["error"]
                             for r in rows) else 1


def accel_of(rows: list[dict]) -> str:
    return next((r["accel"] for r in rows if r.get("accel")), "?")


def run(opts, names: list[str], rows: list[dict]) -> None:
    with lab_ring() as (paths, records, _), tempfile.TemporaryDirectory() as tmp:
        lab = Lab(paths, log=lambda m: print(f"  {m}", flush=True))
        c = Lab3(lab, paths)
        image_build.build(paths.images, IMAGE, log=lambda m: print(f"  {m}", flush=True))
        key = Path(tmp) / "key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                       check=True)
        lab.up(3, sites=3)
        with Fleet(paths) as fleet:
            try:
                if fleet.find(VM) or fleet.is_suspended(VM):
                    c.cli("vm", "destroy", VM)
                c.cli("vm", "create", VM, "--image", IMAGE, "--memory", str(MEMORY_MIB),
                      "--host", HOSTS[0], "--ssh-key", f"{key}.pub", "--local-disk")
                if wait_ssh(paths, key, VM, time.monotonic(), 600) is None:
                    raise RuntimeError(f"{VM} never answered SSH")
                written = ssh(paths, key, f"head -c {DATA_MIB << 20} /dev/urandom > data; "
                                          "sync; sha256sum data")
                for name in names:
                    for i in range(opts.runs):
                        row = strike(c, fleet, name, i, key, written)
                        rows.append(row | {"accel": records[0].accel})
                        print(f"{name} #{i + 1}: {row['outcome']} on {row['where']}, disks on "
                              f"{row['disks']}, data {'ok' if row['data_ok'] else 'BAD'}, "
                              f"record {row['record_agrees_s']} s"
                              + (f" ({row['error']})" if row["error"] else ""), flush=True)
                        if row["outcome"] != "ok" or not row["data_ok"]:
                            raise RuntimeError(f"{name}: the VM did not come through: {row}")
            finally:
                if fleet.find(VM) or fleet.is_suspended(VM):
                    c.cli("vm", "destroy", VM)
                lab.up(3, sites=1)
                c.state.r.delete("vmmgr:links")  # what the moves measured of the WAN


def write(rows: list[dict], accel: str, runs: int) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "disk-faults.json").write_text(json.dumps({"accel": accel, "runs": rows},
                                                         indent=2) + "\n")
    md = [f"# Faults in the disk phase of a move between sites ({accel}; a {MEMORY_MIB} MiB "
          f"Debian VM, its disk on its host's own storage with {DATA_MIB} MiB of data; "
          f"{runs} runs each)", "",
          "| fault | runs | ok | lost | twice | stopped | data intact | disk only where it runs "
          "| moved | records agree (max) | time per run |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["fault"] for r in rows):
        mine = [r for r in rows if r["fault"] == name]
        count = lambda o: sum(r["outcome"] == o for r in mine)  # noqa: E731
        agree = [r["record_agrees_s"] for r in mine]
        md.append(f"| {name} | {len(mine)} | {count('ok')} | {count('lost')} | "
                  f"{count('twice')} | {count('stopped')} | "
                  f"{sum(r['data_ok'] for r in mine)}/{len(mine)} | "
                  f"{sum(r['disks'] == r['where'] for r in mine)}/{len(mine)} | "
                  f"{sum(r['moved'] for r in mine)}/{len(mine)} | "
                  f"{'never' if None in agree else f'{max(agree)} s'} | "
                  f"{statistics.mean(r['seconds'] for r in mine):.0f} s |")
    md += ["", "moved: the move finished on the target in spite of the fault (else the VM runs "
           "on where it was)."]
    (RESULTS / "disk-faults.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
