"""Suspend to disk and resume elsewhere: the VM continues exactly where it stopped."""

import json
import time

from vmmgr import console, suspend
from vmmgr.errors import Conflict

import pytest

from .conftest import assert_contiguous, cli, consoles, ticks, wait_ticks, where_defined
from .test_engine import assert_memory_intact, wait_dirtier_passes


def test_suspend_then_resume_on_another_host_continues_exactly(make_vm, fleet, paths):
    make_vm("sleeper", host="host1", interval=0.1)
    wait_ticks(paths, "sleeper", 5)
    out = json.loads(cli("vm", "suspend", "sleeper", "--json", check_code=0).stdout)
    assert out["from_host"] == "host1" and out["image_bytes"] > 10 * 2**20

    # Suspended: on no host, listed as suspended, and its console stands still.
    assert where_defined(fleet, "sleeper") == []
    listed = {v["name"]: v for v in json.loads(cli("vm", "list", "--json", check_code=0).stdout)}
    assert listed["sleeper"]["state"] == "suspended"
    saved = fleet.state.save_of("sleeper")  # the store's copy of its folder: what lists read
    assert saved["state"] == "saved" and saved["record"]["from_host"] == "host1"
    assert saved["address"] == listed["sleeper"]["address"] != ""

    # A store restored from an older copy lacks the save, and holds one whose folder is gone:
    # the reconcile writes the one again from storage and forgets the other before it decides
    # anything (its address sweep never takes a saved VM for gone).
    from vmmgr import operations, reconcile
    fleet.state.forget_save("sleeper")
    fleet.state.put_save("gonesave", dict(saved, record=dict(saved["record"], vm="gonesave")))
    assert fleet.is_suspended("sleeper")  # its folder says so where this node sees it
    result = reconcile.reconcile(fleet, operations.LocalReport(fleet))
    assert {"sleeper", "gonesave"} <= set(result["repaired"])
    assert fleet.state.save_of("sleeper") == saved and fleet.state.save_of("gonesave") is None
    listed = {v["name"]: v for v in json.loads(cli("vm", "list", "--json", check_code=0).stdout)}
    assert listed["sleeper"]["state"] == "suspended" and "gonesave" not in listed
    frozen = ticks(paths, "sleeper")
    time.sleep(1.5)
    assert ticks(paths, "sleeper") == frozen

    resumed = json.loads(cli("vm", "resume", "sleeper", "--host", "host2", "--json",
                             check_code=0).stdout)
    assert resumed["host"] == "host2" and resumed["suspended_for_s"] >= 1.5
    assert where_defined(fleet, "sleeper") == ["host2"]
    assert fleet.locate("sleeper").is_persistent()
    seen = wait_ticks(paths, "sleeper", len(frozen) + 5)
    assert seen[0] == 0
    assert_contiguous(seen)  # no tick lost, none repeated
    assert console.hosts_seen(consoles(paths), "sleeper") == ["host1", "host2"]
    assert not (paths.saves / "sleeper").exists() and fleet.state.save_of("sleeper") is None


def test_memory_survives_suspend_and_resume(make_vm, fleet, paths):
    make_vm("memsave", host="host3", workload="dirtier", memory=192, rate=16, mib=32)
    wait_dirtier_passes(paths, "memsave", 2)
    suspend.suspend(fleet, "memsave")
    suspend.resume(fleet, "memsave")  # wherever there is room
    before = wait_dirtier_passes(paths, "memsave", 0)
    wait_dirtier_passes(paths, "memsave", before + 2)
    assert_memory_intact(paths, "memsave")


def test_suspend_and_resume_refusals_change_nothing(make_vm, fleet, paths):
    make_vm("parked", host="host1")
    wait_ticks(paths, "parked", 2)
    assert cli("vm", "resume", "parked").returncode == 4  # running: nothing to resume
    assert cli("vm", "suspend", "ghost").returncode == 3
    assert cli("vm", "resume", "ghost").returncode == 3
    suspend.suspend(fleet, "parked")
    proc = cli("vm", "suspend", "parked")
    assert proc.returncode == 4 and "already suspended" in proc.stderr
    proc = cli("vm", "create", "parked", "--host", "host2")
    assert proc.returncode == 4 and "already exists" in proc.stderr

    # No room where it is asked to go: refused, and it stays suspended with its image.
    make_vm("hog", host="host2", workload="idle", memory=960)
    with pytest.raises(Conflict, match="host host2 has no room to resume parked"):
        suspend.resume(fleet, "parked", "host2")
    assert fleet.is_suspended("parked") and (paths.saves / "parked" / "image").is_file()
    assert where_defined(fleet, "parked") == []

    # Destroying a suspended VM deletes its image.
    assert "suspended" in cli("vm", "destroy", "parked", check_code=0).stdout
    assert not (paths.saves / "parked").exists()
    assert cli("vm", "resume", "parked").returncode == 3


def test_a_worker_killed_mid_save_leaves_the_vm_suspended_not_shut_off(lab, make_vm, fleet,
                                                                       paths):
    """Before: libvirt finished the save without its client and stopped the domain; the rerun
    refused ("only a running VM is suspended"), the reconcile recorded it shut off, and a
    complete image.partial stayed on storage with nothing to resume it."""
    import os
    import signal

    from vmmgr.state import FleetState

    from .test_tasks import wait_for

    state = FleetState(paths.redis_url())
    make_vm("cutsave", host="host1", workload="dirtier", memory=256, rate=16, mib=160)
    wait_dirtier_passes(paths, "cutsave", 2)
    d = paths.saves / "cutsave"
    try:
        cli("vm", "suspend", "cutsave", "--no-wait", check_code=0)
        wait_for(lambda: (d / "image.partial").exists(), 60, "the save never started")
        os.kill(lab.services().worker_pid("host1"), signal.SIGKILL)
        # Killed mid-save: the intent is there and no record yet (the test means what it says).
        assert (d / "intent.json").exists() and not (d / "record.json").exists()
        lab.up(3)  # brings the worker back; its rerun or the reconcile finishes the save

        wait_for(lambda: suspend.find_suspended(fleet, "cutsave") is not None
                 and not (d / "intent.json").exists(), 120, "the cut-short save was not finished")
        assert where_defined(fleet, "cutsave") == []  # on no host: it lives on storage
        assert (d / "image").read_bytes()[:16] == b"LibvirtQemudSave"
        wait_for(lambda: state.vm("cutsave").get("state") == "suspended", 30,
                 "the record does not say suspended")
        repairs = [e["message"] for e in state.events(500, vm="cutsave")]
        assert any("cut short had completed on host1: suspended" in m for m in repairs), repairs

        suspend.resume(fleet, "cutsave", "host2")
        before = wait_dirtier_passes(paths, "cutsave", 0)
        wait_dirtier_passes(paths, "cutsave", before + 2)
        assert_memory_intact(paths, "cutsave")  # the same guest, memory verified
    finally:
        lab.up(3)


def test_a_host_that_does_not_answer_blocks_creating_a_vm_it_may_hold(lab, make_vm, fleet,
                                                                      paths):
    """Before: `find_all` skipped a host that did not answer, so a VM of the same name was
    created elsewhere (and took the old VM's address and route)."""
    import subprocess

    from vmmgr import operations
    from vmmgr.errors import HostUnreachable
    from vmmgr.fleet import Fleet
    from vmmgr.images import ensure_builtin

    make_vm("twinned", host="host3")
    wait_ticks(paths, "twinned", 2)
    # host3's libvirtd stops answering (its port refuses); its VM runs on.
    rule = ["-p", "tcp", "--dport", "16514", "-j", "REJECT", "--reject-with", "tcp-reset"]
    ipt = ["ip", "netns", "exec", "vmmgr-host3", "iptables"]
    subprocess.run([*ipt, "-I", "INPUT", *rule], check=True)
    try:
        image = ensure_builtin(paths.images)
        spec = {"name": "twinned", "memory_mib": 128, "vcpus": 1, "kernel": str(image.kernel),
                "initrd": str(image.initrd), "cmdline": "quiet"}
        with Fleet(paths) as cut_off:  # a control node that cannot reach host3
            with pytest.raises(HostUnreachable, match="it may hold twinned"):
                operations.create(cut_off, operations.LocalReport(cut_off), spec, host="host1")
            assert cut_off.host("host1").find_guest("twinned") is None
    finally:
        subprocess.run([*ipt, "-D", "INPUT", *rule], check=True)
    with Fleet(paths) as f:
        assert where_defined(f, "twinned") == ["host3"]


def test_usage_shows_the_time_a_vm_was_parked_to_the_second(lab, make_vm, fleet, paths):
    """Parked for a measured time (from the park's return until libvirt runs it again, resumed
    by the reconcile): the usage report says the same within a second."""
    from vmmgr import operations, usage

    make_vm("metered", interval=0.2)
    wait_ticks(paths, "metered", 3)
    report = operations.LocalReport(fleet)
    t0 = time.time()
    operations.suspend(fleet, report, "metered", parked=True)
    parked_at = time.time()
    # the reconcile resumes a parked VM where there is room: measured from libvirt's side
    deadline = time.monotonic() + 60
    while not ((g := fleet.find("metered")) is not None and g.state() == "running"):
        assert time.monotonic() < deadline, "the parked VM was not resumed"
        time.sleep(0.1)
    measured = time.time() - parked_at
    time.sleep(1)
    [row] = [r for r in usage.report(fleet.state, t0 - 60, time.time())["vms"]
             if r["vm"] == "metered"]
    assert abs(row["parked"] - measured) <= 1, (row, measured)
    assert row["suspended"] < 5 and row["running"] > 0  # the save itself counts as suspending


def test_a_resume_whose_answer_is_lost_is_finished_not_undone(make_vm, fleet, paths,
                                                              monkeypatch):
    """host2 restores the VM, but the answer is lost (HostUnreachable raised after the real
    restore): the resume fails and keeps its claim on the image. Before, it gave the claim
    back with the VM running on host2, and the next resume restored the image a second time
    elsewhere. The reconcile's recovery finds it running there and finishes the resume: it
    runs once, its counter counting on with no tick lost or repeated."""
    from vmmgr import operations, reconcile
    from vmmgr.errors import HostUnreachable
    from vmmgr.host import Host

    make_vm("lostres", host="host1", interval=0.1)
    wait_ticks(paths, "lostres", 5)
    suspend.suspend(fleet, "lostres")
    restore = Host.restore

    def restore_then_lose_the_answer(host, *args, **kw):
        restore(host, *args, **kw)
        raise HostUnreachable(f"host {host.name} did not answer (injected)")

    monkeypatch.setattr(Host, "restore", restore_then_lose_the_answer)
    with pytest.raises(HostUnreachable):
        suspend.resume(fleet, "lostres", "host2")
    monkeypatch.undo()
    # The claim is kept, not given back (unless a scheduled reconcile finished it already:
    # it says so a moment after it removed the claim)
    deadline = time.monotonic() + 10
    while not (any("the resume cut short had restored it on host2" in e["message"]
                   for e in fleet.state.events(count=500, vm="lostres"))
               or (paths.saves / "lostres" / "claim.json").is_file()):
        assert time.monotonic() < deadline, "the claim was dropped and nothing said so"
        time.sleep(0.2)
    assert not (paths.saves / "lostres" / "record.json").exists()
    assert fleet.locate("lostres").host_name == "host2"

    reconcile.reconcile(fleet, operations.LocalReport(fleet))  # (or a scheduled one did)
    deadline = time.monotonic() + 60
    while (paths.saves / "lostres").exists() and time.monotonic() < deadline:
        time.sleep(1)
    assert not (paths.saves / "lostres").exists()
    assert where_defined(fleet, "lostres") == ["host2"]
    assert fleet.locate("lostres").is_persistent()
    seen = wait_ticks(paths, "lostres", len(ticks(paths, "lostres")) + 5)
    assert_contiguous(seen)
    assert console.hosts_seen(consoles(paths), "lostres") == ["host1", "host2"]


def test_a_resume_the_edge_will_not_route_ends_well_and_the_reconcile_routes_it(
        make_vm, fleet, paths, monkeypatch):
    """The edge refuses the route once the VM runs on its target (its lock busy past its wait,
    `wg` failing): the resume has happened all the same, so it answers so, its save is gone and
    an event says the address is not routed yet; the reconcile's repair routes it. Before, the
    task answered a failure and the record said suspended while the VM ran."""
    from vmmgr import operations, reconcile
    from vmmgr.addresses import pool_for
    from vmmgr.edge import Edge
    from vmmgr.errors import VmmgrError

    make_vm("norroute", host="host1", interval=0.1)
    wait_ticks(paths, "norroute", 5)
    suspend.suspend(fleet, "norroute")

    def refuse(edge, ip, host):
        raise VmmgrError("wg set: injected failure")

    monkeypatch.setattr(Edge, "route", refuse)
    resumed = operations.resume(fleet, operations.LocalReport(fleet), "norroute", "host2")
    monkeypatch.undo()
    assert resumed["host"] == "host2"
    assert where_defined(fleet, "norroute") == ["host2"]
    assert not (paths.saves / "norroute").exists() and fleet.state.save_of("norroute") is None
    assert fleet.state.vm("norroute").get("state") == "running"
    assert any(e["message"].startswith("norroute: resumed on host2, but its address is not "
                                       "routed there yet (wg set: injected failure)")
               for e in fleet.state.events(count=200, vm="norroute"))
    ip = pool_for(paths, fleet.state.r).address_of("norroute")
    edge = Edge.load(paths, fleet.state)
    if edge is not None:  # the lab's edge: the repair routes it where the VM runs
        deadline = time.monotonic() + 60
        while edge.routes().get(ip) != "host2":
            assert time.monotonic() < deadline, edge.routes()
            reconcile.reconcile(fleet, operations.LocalReport(fleet))
            time.sleep(1)
    seen = wait_ticks(paths, "norroute", len(ticks(paths, "norroute")) + 5)
    assert_contiguous(seen)
