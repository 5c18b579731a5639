"""The task API on the lab's real Redis and Celery workers (one per host namespace)."""

import json
import os
import signal
import threading
import time

import pytest

from vmmgr.locks import HOUSEKEEPING
from vmmgr.state import FleetState

from .conftest import assert_contiguous, cli, ticks, wait_ticks, where_defined


@pytest.fixture
def state(lab, paths):
    return FleetState(paths.redis_url())


def recent(n=50):
    return json.loads(cli("tasks", "--limit", str(n), "--json", check_code=0).stdout)


def wait_for(check, timeout, what):
    """Until `check()`; `what` says what did not happen (a callable: worked out on failure)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.3)


def test_operations_run_on_the_workers_and_leave_records(lab, fleet, paths, state):
    try:
        cli("vm", "create", "tk1", "--host", "host1", check_code=0)
        wait_ticks(paths, "tk1", 2)
        # 30 MiB/s: a few seconds of progress (unlimited, QEMU 10 moves the VM in half a second)
        proc = cli("migrate", "tk1", "--to", "host2", "--bandwidth", "30", check_code=0)
        assert "host1 -> host2" in proc.stdout and "%" in proc.stderr  # progress came through
        tasks = {t["name"]: t for t in recent(10) if "tk1" in t["args"]}
        # Each ran on the worker of the host that holds the VM, and succeeded once.
        assert tasks["create"]["worker"] == "host1" and tasks["create"]["state"] == "SUCCESS"
        assert tasks["migrate"]["worker"] == "host1" and tasks["migrate"]["state"] == "SUCCESS"
        assert tasks["migrate"]["queue"] == "host.host1" and tasks["migrate"]["runs"] == "1"
        record = state.vm("tk1")
        assert record["host"] == "host2" and record["state"] == "running"
        [attempt] = state.migrations("tk1")
        assert attempt["status"] == "completed" and attempt["source"] == "host1"
        assert attempt["target"] == "host2" and attempt["downtime_ms"] is not None
        assert attempt["started_at"] < attempt["ended_at"]
        messages = [e["message"] for e in state.events(200, vm="tk1")]
        assert "tk1: created on host1" in messages
        assert any(m.startswith("tk1: host1 -> host2") for m in messages)
        assert_contiguous(ticks(paths, "tk1"))
    finally:
        cli("vm", "destroy", "tk1")
    assert state.vm("tk1") == {}


def test_bad_and_conflicting_requests_are_refused_and_change_nothing(make_vm, fleet, paths,
                                                                    state):
    make_vm("busy1", host="host1")
    before = len(recent(500))
    refused = [
        (["migrate", "ghost", "--to", "host2"], 3, "unknown VM 'ghost'"),
        (["migrate", "busy1", "--to", "host9"], 3, "unknown host 'host9'"),
        (["migrate", "busy1", "--to", "host1"], 2, "already runs on host1"),
        (["vm", "create", "huge", "--memory", "4096"], 2, "more than any host offers"),
        (["vm", "create", "bad/name"], 2, "name"),
        (["host", "drain", "host9"], 3, "unknown host"),
        (["vm", "resume", "busy1"], 4, "not suspended"),
    ]
    for args, code, message in refused:
        proc = cli(*args)
        assert proc.returncode == code and message in proc.stderr, (args, proc.stderr)
    assert len(recent(500)) == before  # nothing was even queued
    assert where_defined(fleet, "busy1") == ["host1"]
    assert where_defined(fleet, "huge") == []

    # A VM already being moved (slowly: 8 MiB/s): a second request is refused at once; the
    # first carries on until cancelled, and the VM stays where it was.
    first = cli("migrate", "busy1", "--to", "host2", "--bandwidth", "8", "--no-wait",
                check_code=0)
    task_id = first.stdout.split()[-1]
    proc = cli("migrate", "busy1", "--to", "host3")
    assert proc.returncode == 4 and "busy: migration of busy1 to host2" in proc.stderr
    assert cli("vm", "suspend", "busy1").returncode == 4
    wait_for(lambda: fleet.locate("busy1").has_job(), 60, "the first migration never started")
    cli("migrate", "cancel", "busy1", check_code=0)
    wait_for(lambda: _task_state(task_id) == "FAILURE", 60, "the cancelled task did not end")
    assert where_defined(fleet, "busy1") == ["host1"]
    assert state.holder("vm", "busy1") is None  # the lock went with the task
    [attempt] = state.migrations("busy1")
    assert attempt["status"] == "failed" and "cancel" in attempt["error"]

    # One of the reconcile's brief checks of the VM is no reason to refuse a request: it waits
    # for the check to end (2 s here) and goes on.
    state.acquire("vm", "busy1", "reconcile-test", f"{HOUSEKEEPING}check of busy1's record", 30)
    threading.Timer(2, state.release, ("vm", "busy1", "reconcile-test")).start()
    t0 = time.monotonic()
    cli("migrate", "busy1", "--to", "host2", check_code=0)
    assert time.monotonic() - t0 >= 2
    assert where_defined(fleet, "busy1") == ["host2"]


def test_reconcile_repairs_records_that_drifted_from_libvirt(make_vm, fleet, state):
    make_vm("drift1", host="host3", workload="idle")
    state.set_vm("drift1", host="host1", state="suspended")
    state.set_vm("phantom", host="host2", state="running")
    wait_for(lambda: state.vm("drift1").get("host") == "host3" and state.vm("phantom") == {},
             30, "beat's reconcile did not repair the records")
    assert state.vm("drift1")["state"] == "running"

    def said(what: str) -> bool:  # (said once the repair has let the VM go)
        return any(what in e["message"] for e in state.events(500) if e["kind"] == "repair")

    wait_for(lambda: said("drift1: record repaired: was suspended on host1"), 10, "not said")
    wait_for(lambda: said("phantom: record removed"), 10, "not said")


def test_a_wedged_libvirtd_is_reported_unreachable_and_the_reconcile_goes_on(lab, make_vm,
                                                                              state):
    """A libvirtd that accepts connections and answers nothing (stopped here) held the first
    pass that connected to it for as long as it stayed so: libvirt's open has no timeout, and
    no pass after it ran. Now the host is reported unreachable and the other hosts' records
    are still kept right (a drifted one repaired). A record of a VM libvirt knows nothing of is
    kept while host3, which may hold that VM, does not answer; once it answers again it is
    reachable again, and the record goes."""
    make_vm("wedge-drift", host="host1", workload="idle")
    wait_for(lambda: state.hosts().get("host3", {}).get("reachable"), 60, state.hosts)
    state.set_vm("wedge-drift", state="suspended", host="host2")  # drifted from libvirt's
    with lab.libvirtd_frozen("host3"):
        # (written once host3 is silent: a pass before would rightly remove it at once)
        state.set_vm("wedge-ghost", state="running", host="host1")  # libvirt knows no such VM
        wait_for(lambda: (not state.hosts()["host3"]["reachable"]
                          and state.vm("wedge-drift").get("host") == "host1"), 180,
                 lambda: (state.hosts().get("host3"), state.vm("wedge-drift")))
        assert state.hosts()["host1"]["reachable"] and state.hosts()["host2"]["reachable"]
        assert "no answer" in state.hosts()["host3"]["error"], state.hosts()["host3"]
        assert state.vm("wedge-drift")["state"] == "running"
        assert "wedge-ghost" in state.vms()  # host3 may hold it: nothing is decided
    wait_for(lambda: state.hosts()["host3"]["reachable"] and "wedge-ghost" not in state.vms(),
             120, lambda: (state.hosts()["host3"], state.vms().get("wedge-ghost")))


def test_sigkill_of_the_worker_mid_drain_loses_nothing(lab, make_vm, fleet, paths, state):
    names = ["kd1", "kd2", "kd3"]
    for n in names:
        make_vm(n, host="host1", interval=0.1)
    for n in names:
        wait_ticks(paths, n, 3)
    proc = cli("host", "drain", "host1", "--no-wait", check_code=0)
    task_id = proc.stdout.split()[-1]
    try:
        # Kill the worker running the drain once its first migration has started.
        wait_for(lambda: any("migrating to" in e["message"] for e in state.events(50)
                             if e["task"] == task_id), 60, "the drain never started migrating")
        victim = state.task(task_id)["worker"]
        os.kill(lab.services().worker_pid(victim), signal.SIGKILL)

        # Another worker gets the message after the visibility timeout and finishes the drain.
        wait_for(lambda: _task_state(task_id) == "SUCCESS", 120, "the drain was not redelivered")
        task = state.task(task_id)
        assert task["runs"] == "2" and task["worker"] != victim, task
        assert fleet.host("host1").guests() == []
        for n in names:
            where = where_defined(fleet, n)
            assert len(where) == 1 and where[0] in ("host2", "host3"), (n, where)  # once only
            assert fleet.locate(n).state() == "running"
            wait_ticks(paths, n, len(ticks(paths, n)) + 3)
            assert_contiguous(ticks(paths, n))
        hosts = {h["name"]: h["state"] for h in json.loads(cli("host", "list", "--json").stdout)}
        assert hosts["host1"] == "reclaimed"
    finally:
        lab.up(3)  # brings the killed worker back
        cli("host", "enable", "host1")


def _task_state(task_id):
    return next((t["state"] for t in recent(50) if t["id"] == task_id), None)


def nsenter(pid: int, *cmd: str) -> str:
    """Run `cmd` in the mount namespace of process `pid`: what that process sees."""
    import subprocess
    return subprocess.run(["nsenter", "-t", str(pid), "-m", *cmd], capture_output=True,
                          text=True, check=True).stdout


def test_each_hosts_worker_has_a_home_of_its_own_and_shares_only_storage(lab, paths):
    services = lab.services()
    pids = {h: services.worker_pid(h) for h in ("host1", "host2")}
    assert all(pids.values())
    marker = paths.storage / ".written-by-the-control-node"
    marker.write_text("shared\n")
    try:
        for host, pid in pids.items():
            seen = set(nsenter(pid, "ls", "-A", str(paths.home)).split())
            # What the vmmgr_worker role writes there, and the shared storage...
            assert {"storage", "edge.json", "network.json"} <= seen, seen
            # ...and none of the control node's own files, nor the lab's.
            assert not {"users.json", "web-secret", "wireguard", "lab", "redis.url"} & seen, seen
            assert nsenter(pid, "cat", str(marker)) == "shared\n"
            # Its libvirt client certificate is its host's own, as on a real host.
            assert nsenter(pid, "cat", f"{paths.home}/libvirt-pki/clientcert.pem") == (
                paths.lab / "hosts" / host / "pki" / "libvirt" / "clientcert.pem").read_text()
        # A file one host writes in its home is its own: not the other host's, not the control's.
        nsenter(pids["host1"], "sh", "-c", f"echo mine > {paths.home}/host1-only")
        assert "host1-only" not in nsenter(pids["host2"], "ls", "-A", str(paths.home)).split()
        assert not (paths.home / "host1-only").exists()
    finally:
        marker.unlink(missing_ok=True)
        nsenter(pids["host1"], "rm", "-f", f"{paths.home}/host1-only")


def test_two_hosts_resuming_one_parked_vm_restore_it_on_one_host(make_vm, fleet, paths, state):
    """Each host's worker resumes parked VMs when its host is enabled; with a lock in each
    node's home both restored the same image (the VM then ran twice). The VM's one lock in Redis
    lets one of them through."""
    from tasks import client
    from tasks.app import host_queue, use_broker
    from tasks.runtime import LockSpec
    from vmmgr import suspend

    make_vm("parked2x", host="host1")
    wait_ticks(paths, "parked2x", 3)
    suspend.suspend(fleet, "parked2x", parked=True)
    use_broker(paths.redis_url())
    ids = [client.submit(paths, "enable_host", {"host": h}, host_queue(h),
                         LockSpec("host", h, f"enable of {h}")) for h in ("host2", "host3")]
    results = [client.wait(i) for i in ids]
    resumed = [r for result in results for r in result["resumed"]]
    wait_for(lambda: not suspend.find_suspended(fleet, "parked2x") and
             not state.holder("vm", "parked2x"), 30, "the VM was not resumed")
    hosts = where_defined(fleet, "parked2x")
    assert len(hosts) == 1, f"defined on {hosts}"
    assert len(resumed) <= 1  # the other found it busy, or already back (or reconcile won)
    count = len(ticks(paths, "parked2x"))
    wait_ticks(paths, "parked2x", count + 3)
    assert_contiguous(ticks(paths, "parked2x"))


def test_listings_read_the_fleet_view_and_it_follows_libvirt(make_vm, fleet, paths, state):
    """`vm list` answers from the view in the store; a VM powered off behind vmmgr's back (with
    libvirt directly) is seen as such within seconds: the worker follows its host's libvirt
    events (and the reconcile would catch it too)."""
    make_vm("viewed", host="host2")
    rows = {r["name"]: r for r in json.loads(cli("vm", "list", "--json", check_code=0).stdout)}
    assert rows["viewed"]["host"] == "host2" and rows["viewed"]["state"] == "running"
    assert state.vm_view("viewed")["host"] == "host2"
    fleet.host("host2").find_guest("viewed").destroy()

    def shown_off():
        rows = json.loads(cli("vm", "list", "--json", check_code=0).stdout)
        return any(r["name"] == "viewed" and r["state"] == "shutoff" for r in rows)
    wait_for(shown_off, 15, "the view did not follow the VM's power-off")

    # While an operation holds the VM, its events leave the row to it (a look taken mid-way
    # may land after the operation's own row); once it is over, the VM is looked at again.
    with fleet.lock_vm("viewed", "a test's operation"):
        fleet.host("host2").find_guest("viewed").start()
        time.sleep(3)  # the start's events arrive and are looked at
        assert state.vm_view("viewed")["state"] == "shutoff"
    wait_for(lambda: state.vm_view("viewed")["state"] == "running", 15,
             "the view did not follow the VM once the operation was over")
