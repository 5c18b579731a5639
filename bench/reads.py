"""Benchmark: reads over a simulated fleet state of 1,000 hosts and 20,000 VMs.

    ./run bench-reads

Listings, pages and API calls answer from the fleet's store (Redis), never by asking every host.
This fills a private Redis server (loopback, a free port) with the inventory, the reconcile's host
snapshot and the fleet view of 1,000 hosts holding 20,000 VMs (200 of them parked), then times, side
by side in one run: `vmmgr vm list --json` (the command in this process, through click, and the
whole process from exec to exit for reference), `GET /api/v1/vms` (a page of 1,000 rows: the
API pages its listing, the Link header naming the next), the fleet page `/` and a page of the VMs
page (Flask's test client: the app's own time, no network). Target: each under 200 ms (p50).
Writes bench/results/reads.json and reads.md.
"""

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.conftest import private_redis  # noqa: E402  (the suite's throwaway Redis server)
from vmmgr import view  # noqa: E402
from vmmgr.cli import cli  # noqa: E402
from vmmgr.fleet import VMInfo  # noqa: E402
from vmmgr.inventory import HostRecord, Inventory  # noqa: E402
from vmmgr.paths import Paths  # noqa: E402
from vmmgr.state import FleetState  # noqa: E402
from vmmgr.users import Users  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HOSTS, VMS, PARKED, SEED, RUNS = 1000, 20000, 200, 7, 15
TARGET_MS = 200


def fill(state: FleetState, rng: random.Random) -> None:
    inventory = Inventory(state.r)
    snapshot, rows = {}, []
    for i in range(HOSTS):
        name = f"h{i:04d}"
        memory, vcpus = rng.choice([256, 384, 512]) * 1024, rng.choice([64, 96, 128])
        inventory.add(HostRecord(name, f"qemu+tls://10.0.{i // 250}.{i % 250 + 1}/system",
                                 "kvm", memory, vcpus))
        snapshot[name] = {"state": "active", "reachable": True, "memory_mib": memory,
                          "vcpus": vcpus}
    for i in range(VMS):  # rows as the view writes them (view.guest_row, suspended_row)
        name, address = f"vm{i:05d}", f"10.{i // 65536 + 100}.{i // 256 % 256}.{i % 256}"
        memory, vcpus = rng.choice([1, 2, 4, 8]) * 1024, rng.choice([1, 2, 4])
        if i < PARKED:
            rows.append({"name": name, "host": "-", "state": "parked", "memory_mib": memory,
                         "vcpus": vcpus, "workload": "", "address": address,
                         "suspended_from": "h0000", "suspended_at": time.time()})
        else:
            rows.append(view.guest_row(VMInfo(name, f"h{rng.randrange(HOSTS):04d}", "running",
                                              memory, vcpus, "counter", address=address)))
    state.set_hosts(snapshot)
    state.replace_vm_views(rows)


def timed(fn, runs: int = RUNS) -> dict:
    """Wall time, and this process's CPU time (steadier on a shared machine; it leaves out
    Redis's own work, which the wall time includes)."""
    fn()  # warm: imports, template compilation, connection
    samples, cpu = [], []
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
    samples.sort()
    return {"p50_ms": round(statistics.median(samples), 1),
            "p95_ms": round(samples[int(0.95 * (len(samples) - 1))], 1),
            "max_ms": round(samples[-1], 1), "cpu_p50_ms": round(statistics.median(cpu), 1),
            "runs": runs}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, private_redis(tmp) as url:
        home = Paths(Path(tmp) / "home")
        home.home.mkdir()
        home.redis_url_file.write_text(url + "\n")
        state = FleetState(url)
        fill(state, random.Random(SEED))
        Users(home.users).add("bench", "bench password 123", "viewer")
        token = Users(home.users).new_token("bench")

        from webui import create_app
        app = create_app(home, TESTING=True, WTF_CSRF_ENABLED=False)
        api, page = app.test_client(), app.test_client()
        assert page.post("/login", data={"name": "bench", "password": "bench password 123"}
                         ).status_code == 302
        runner = CliRunner()

        def cli_list():
            out = runner.invoke(cli, ["--home", str(home.home), "vm", "list", "--json"])
            assert out.exit_code == 0 and len(json.loads(out.output)) == VMS, out.output[-500:]

        bearer = {"Authorization": f"Bearer {token}"}

        def api_list(url="/api/v1/vms"):
            resp = api.get(url, headers=bearer)
            assert resp.status_code == 200 and len(resp.get_json()) == 1000
            return resp

        def api_all():  # every page, following the Link headers
            url, seen = "/api/v1/vms", 0
            while url:
                resp = api.get(url, headers=bearer)
                seen += len(resp.get_json())
                link = resp.headers.get("Link")
                url = link[1:link.index(">")] if link else None
            assert seen == VMS

        def vms_page():
            resp = page.get("/vms?after=vm09999")
            assert resp.status_code == 200 and b'id="vm-vm10499"' in resp.data

        def fleet_page():
            resp = page.get("/")
            assert resp.status_code == 200 and b"h0999" in resp.data

        def cli_process():
            subprocess.run([str(Path(sys.executable).parent / "vmmgr"), "--home", str(home.home),
                            "vm", "list", "--json"], check=True, capture_output=True,
                           env=os.environ | {"VMMGR_HOME": str(home.home)})

        rows = {"vm list --json (command)": timed(cli_list),
                "GET /api/v1/vms (first page, 1,000 VMs)": timed(api_list),
                "GET /api/v1/vms?after=vm09999 (a middle page)": timed(
                    lambda: api_list("/api/v1/vms?after=vm09999")),
                "fleet page /": timed(fleet_page),
                "VMs page /vms?after=vm09999 (500 VMs)": timed(vms_page),
                "GET /api/v1/vms, all 20 pages (for reference)": timed(api_all, 5),
                "vm list --json (whole process, for reference)": timed(cli_process, 5)}
    report = {"hosts": HOSTS, "vms": VMS, "parked": PARKED, "target_ms": TARGET_MS,
              "results": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "reads.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# Reads over {HOSTS:,} hosts and {VMS:,} VMs ({PARKED} parked), from the store",
             "", "| read | p50 | p95 | max | CPU p50 (this process) | runs | under 200 ms (p50) |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        ok = "-" if "reference" in name else ("yes" if r["p50_ms"] < TARGET_MS else "NO")
        lines.append(f"| {name} | {r['p50_ms']} ms | {r['p95_ms']} ms | {r['max_ms']} ms | "
                     f"{r['cpu_p50_ms']} ms | {r['runs']} | {ok} |")
    (RESULTS / "reads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
