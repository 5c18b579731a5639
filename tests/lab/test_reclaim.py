"""Reclaim and drain: a host is emptied and nothing on it is lost."""

import json
import subprocess
import time

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vmmgr.policy import POLICIES
from vmmgr.users import Users

from .conftest import VMMGR, assert_contiguous, cli, ticks, wait_ticks, where_defined

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


@pytest.fixture
def scrape(lab, paths):
    """GET /metrics of a console on the lab, as Prometheus would, with a viewer's token."""
    from webui import create_app

    users = Users(paths.users)
    users.add("metrics-scraper", "a long scraper password", "viewer", replace=True)
    token, client = users.new_token("metrics-scraper"), create_app(paths).test_client()

    def get() -> dict:
        r = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200, r.get_data(as_text=True)
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "metrics-scrape.txt").write_text(r.get_data(as_text=True))
        return {s.name + str(sorted(s.labels.items())): s.value
                for f in text_string_to_metric_families(r.get_data(as_text=True))
                for s in f.samples}
    yield get
    users.remove("metrics-scraper")


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get(name + str(sorted(labels.items())), 0.0)


def counters(make_vm, paths, names, host="host1"):
    for name in names:
        make_vm(name, host=host, interval=0.1)
    for name in names:
        wait_ticks(paths, name, 3)


def host_state(name):
    hosts = {h["name"]: h for h in json.loads(cli("host", "list", "--json", check_code=0).stdout)}
    return hosts[name]["state"]


def test_reclaim_moves_every_vm_when_others_have_room(make_vm, fleet, paths, scrape):
    names = ["rc1", "rc2", "rc3"]
    counters(make_vm, paths, names)
    before = scrape()
    try:
        report = json.loads(cli("host", "reclaim", "host1", "--json", check_code=0).stdout)
        assert sorted(report["migrated"]) == names and report["suspended"] == []
        # Prometheus sees the reclaim and its three migrations (counted by the workers that
        # did them, into the store), and the VMs' new hosts' room.
        after = scrape()
        grew = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)  # noqa: E731
        assert grew("vmmgr_evacuated_vms_total", kind="reclaim", outcome="migrated") == 3
        assert grew("vmmgr_evacuations_total", kind="reclaim") == 1
        assert sum(grew("vmmgr_migrations_total", outcome="completed", policy=p)
                   for p in [*POLICIES, "-"]) == 3
        assert grew("vmmgr_migration_blackout_seconds_count") == 3
        assert grew("vmmgr_migration_sent_bytes_total") > 3 * 1024 * 1024
        assert metric(after, "vmmgr_vms", state="running") >= 3
        assert host_state("host1") == "reclaimed"
        assert fleet.host("host1").guests() == []
        for name in names:
            assert where_defined(fleet, name)[0] in ("host2", "host3")
            wait_ticks(paths, name, len(ticks(paths, name)) + 3)
            assert ticks(paths, name)[0] == 0
            assert_contiguous(ticks(paths, name))
        # A reclaimed host takes nothing until enabled.
        proc = cli("migrate", "rc1", "--to", "host1")
        assert proc.returncode == 4 and "host host1 is reclaimed" in proc.stderr
    finally:
        cli("host", "enable", "host1", check_code=0)
    assert host_state("host1") == "active"


def test_reclaim_without_room_parks_vms_and_they_resume_when_capacity_returns(make_vm, fleet, paths):
    # host2 and host3 are full: nothing on host1 fits anywhere else.
    make_vm("full2", host="host2", workload="idle", memory=1024)
    make_vm("full3", host="host3", workload="idle", memory=1024)
    names = ["pk1", "pk2"]
    counters(make_vm, paths, names)
    # A stopped VM too (shut off, still defined on host1): nothing to save, but its definition
    # must not go with the host.
    make_vm("pkoff", host="host1")
    fleet.host("host1").find_guest("pkoff").destroy()
    try:
        report = json.loads(cli("host", "reclaim", "host1", "--json", check_code=0).stdout)
        assert sorted(report["suspended"]) == [*names, "pkoff"] and report["migrated"] == []
        assert report["failed"] == {}, report
        assert host_state("host1") == "reclaimed"
        frozen = {n: ticks(paths, n) for n in names}
        listed = {v["name"]: v for v in json.loads(cli("vm", "list", "--json").stdout)}
        assert all(listed[n]["state"] == "parked" for n in names)
        assert (listed["pkoff"]["state"], listed["pkoff"]["host"]) == ("stopped", "-")
        for n in [*names, "pkoff"]:
            assert where_defined(fleet, n) == []
        assert json.loads((paths.saves / "pkoff" / "record.json").read_text())["mode"] == "stopped"

        # Capacity returns (memory frees on host2): with no command, the periodic reconcile
        # resumes the parked VMs there.
        cli("vm", "destroy", "full2", check_code=0)
        deadline = time.monotonic() + 60
        while any(where_defined(fleet, n) != ["host2"] for n in names):
            assert time.monotonic() < deadline, "the parked VMs did not resume by themselves"
            time.sleep(0.5)
        for n in names:
            seen = wait_ticks(paths, n, len(frozen[n]) + 3)
            assert seen[: len(frozen[n])] == frozen[n]
            assert_contiguous(seen)  # exactly where it stopped: no gap, no repeat
        # The stopped VM comes back to a host with room as it was: defined there, not booted.
        deadline = time.monotonic() + 60
        while where_defined(fleet, "pkoff") != ["host2"]:
            assert time.monotonic() < deadline, "the stopped VM's definition did not come back"
            time.sleep(0.5)
        assert fleet.host("host2").find_guest("pkoff").state() == "shutoff"
        # defined there before its resume has ended: its record says so once it has
        while fleet.state.vm("pkoff")["state"] == "resuming":
            assert time.monotonic() < deadline, "the stopped VM's resume never ended"
            time.sleep(0.2)
        assert fleet.state.vm("pkoff")["state"] == "shutoff" and not (paths.saves / "pkoff").exists()
        assert "pkoff running on host2" in cli("vm", "start", "pkoff", check_code=0).stdout
    finally:
        cli("host", "enable", "host1")


def test_drain_waits_for_room_instead_of_suspending(make_vm, fleet, paths):
    make_vm("dr1", host="host3", interval=0.1)
    make_vm("wall1", host="host1", workload="idle", memory=1024)
    make_vm("wall2", host="host2", workload="idle", memory=1024)
    wait_ticks(paths, "dr1", 3)
    drain = subprocess.Popen([VMMGR, "host", "drain", "host3", "--json", "--timeout", "60"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(4)
        assert drain.poll() is None  # waiting: nowhere to go, and it does not suspend
        assert where_defined(fleet, "dr1") == ["host3"] and not fleet.is_suspended("dr1")
        assert host_state("host3") == "draining"
        cli("vm", "destroy", "wall2", check_code=0)  # room appears on host2
        out, err = drain.communicate(timeout=60)
    finally:
        if drain.poll() is None:
            drain.kill()
        cli("host", "enable", "host3")
    assert drain.returncode == 0, err
    assert json.loads(out)["migrated"] == ["dr1"]
    assert where_defined(fleet, "dr1") == ["host2"]
    assert_contiguous(ticks(paths, "dr1"))


def test_reclaim_refuses_unknown_hosts(lab):
    proc = cli("host", "reclaim", "host9")
    assert proc.returncode == 3 and "unknown host 'host9'" in proc.stderr
    assert cli("host", "enable", "nowhere").returncode == 3


def test_a_notice_empties_a_host_before_its_deadline_moving_a_job_as_one(make_vm, fleet, paths):
    """A file notice (as a cloud's would arrive) with a 45 s deadline on host1, which holds an
    idle VM, a dirtier and a two-VM job. Room elsewhere is short: host2 has 384 MiB free and
    host3 128, so placement finds room for one rank of the job but not both. Every VM is safe
    before the deadline; the job's ranks go the same way (both parked, not one running while its
    peer waits), and when host1 is back they resume together and count on exactly."""
    make_vm("nt-full2", host="host2", workload="idle", memory=640)
    make_vm("nt-full3", host="host3", workload="idle", memory=896)
    make_vm("nt-dirty", host="host1", workload="dirtier", memory=256, rate=20, mib=48)
    make_vm("nt-idle", host="host1", interval=0.1)
    try:
        for rank in ("nt-r0", "nt-r1"):  # through the CLI and the task API, as a user would
            cli("vm", "create", rank, "--host", "host1", "--group", "job", "--param",
                "interval=0.1", check_code=0)
            assert fleet.locate(rank).group() == "job"
        for name in ("nt-idle", "nt-r0", "nt-r1"):
            wait_ticks(paths, name, 3)
        sent = time.time()
        cli("lab", "notice", "host1", "--deadline", "45s", check_code=0)
        task = _reclaim_task(fleet, after=sent, timeout=30)
        result = _outcome(fleet, task, timeout=120)["result"]
        assert result["deadline_s"] <= 45 and result["late"] == [] and result["failed"] == {}
        assert sorted(result["safe_at"]) == ["nt-dirty", "nt-idle", "nt-r0", "nt-r1"]
        assert all(at <= result["deadline_s"] for at in result["safe_at"].values()), result
        assert sorted(result["suspended"]) == ["nt-r0", "nt-r1"], result  # the job, as one
        assert "nt-idle" in result["migrated"]
        assert host_state("host1") == "reclaimed" and fleet.host("host1").guests() == []
        events = [e["message"] for e in fleet.state.events(200) if e["kind"] in ("notice", "plan")]
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "notice-reclaim.txt").write_text("\n".join(events) + "\n")
        assert any("host1: lab notice" in m for m in events), events
        assert any(m.startswith("host1: plan:") and "all safe" in m for m in events), events
        assert any("4 of 4 VMs safe within" in m for m in events), events
        wait_ticks(paths, "nt-idle", len(ticks(paths, "nt-idle")) + 3)
        assert_contiguous(ticks(paths, "nt-idle"))

        # host1 back: the job resumes whole, on host1, and counts on where it stopped
        frozen = {n: ticks(paths, n) for n in ("nt-r0", "nt-r1")}
        cli("host", "enable", "host1", check_code=0)
        for n, seen in frozen.items():
            after = wait_ticks(paths, n, len(seen) + 3)
            assert after[: len(seen)] == seen and where_defined(fleet, n) == ["host1"]
            assert_contiguous(after)
    finally:
        cli("host", "enable", "host1")
        for rank in ("nt-r0", "nt-r1"):
            cli("vm", "destroy", rank)


def _reclaim_task(fleet, after: float, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for t in fleet.state.recent_tasks(20):
            if t.get("name") == "reclaim_host" and float(t.get("submitted", 0)) >= after:
                assert "deadline_at" in json.loads(t["args"])
                return t["id"]
        time.sleep(0.3)
    raise AssertionError("host1's notice watcher submitted no reclaim")


def _outcome(fleet, task: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = fleet.state.task(task).get("outcome")
        if ended:
            return json.loads(ended)
        time.sleep(0.5)
    raise AssertionError(f"the reclaim task {task} did not end")
