"""A VM really moves: live migration on the lab, and the refusals that leave it untouched."""

import json
import subprocess
import threading
import time

import pytest

from vmmgr import console
from vmmgr.errors import Conflict, InvalidRequest
from vmmgr.migration import migrate
from vmmgr.policy import get_policy

from .conftest import (
    VMMGR, assert_contiguous, cli, consoles, ticks, wait_ticks, where_defined,
)


def test_ring_migration_keeps_the_console_contiguous(make_vm, fleet, paths):
    make_vm("ring", host="host1", interval=0.1)
    wait_ticks(paths, "ring", 5)
    progress = []
    results = []
    for target in ("host2", "host3", "host1"):
        # The first hop is capped (about 2 s) so that progress polls see the job's numbers.
        policy = get_policy(None, 40 if target == "host2" else None)
        results.append(migrate(fleet, "ring", target, policy=policy, on_progress=progress.append))
        assert where_defined(fleet, "ring") == [target]  # defined only where it runs
        assert fleet.locate("ring").state() == "running"
        time.sleep(0.5)
    seen = wait_ticks(paths, "ring", len(ticks(paths, "ring")) + 5)

    assert seen[0] == 0
    assert_contiguous(seen)
    assert console.hosts_seen(consoles(paths), "ring") == ["host1", "host2", "host3", "host1"]
    for r, (src, dst) in zip(results, [("host1", "host2"), ("host2", "host3"), ("host3", "host1")]):
        assert (r.source, r.target) == (src, dst)
        assert 0 < r.downtime_ms < r.total_ms
        assert r.bytes_transferred > 10 * 2**20  # at least the guest's touched memory
        assert r.memory_iterations >= 1
    assert any(p.total_bytes > 0 and p.processed_bytes > 0 for p in progress)


def test_migrate_via_cli_prints_the_record(make_vm, paths):
    make_vm("viacli", host="host2")
    wait_ticks(paths, "viacli", 2)
    out = cli("migrate", "viacli", "--to", "host3", "--json", check_code=0).stdout
    record = json.loads(out)
    assert record["source"] == "host2" and record["target"] == "host3"
    assert record["downtime_ms"] > 0
    show = json.loads(cli("vm", "show", "viacli", "--json", check_code=0).stdout)
    assert show["host"] == "host3" and show["console_hosts"] == ["host2", "host3"]


def assert_still_counting_on(fleet, paths, vm, host):
    assert where_defined(fleet, vm) == [host]
    assert fleet.locate(vm).state() == "running"
    before = len(ticks(paths, vm))
    wait_ticks(paths, vm, before + 2)
    assert_contiguous(ticks(paths, vm))


def test_unknown_host_is_refused_and_the_vm_keeps_running(make_vm, fleet, paths):
    make_vm("stay", host="host1")
    wait_ticks(paths, "stay", 2)
    proc = cli("migrate", "stay", "--to", "host9")
    assert proc.returncode == 3
    assert proc.stderr.strip() == (
        "vmmgr: error: unknown host 'host9' (known hosts: host1, host2, host3)")
    assert cli("migrate", "ghost", "--to", "host2").returncode == 3  # unknown VM
    assert_still_counting_on(fleet, paths, "stay", "host1")
    assert console.hosts_seen(consoles(paths), "stay") == ["host1"]


def test_second_migration_while_one_runs_is_refused(make_vm, fleet, paths):
    make_vm("busy", host="host1")
    wait_ticks(paths, "busy", 2)
    first = subprocess.Popen([VMMGR, "migrate", "busy", "--to", "host2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not fleet.state.holder("vm", "busy") and first.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second = cli("migrate", "busy", "--to", "host3")
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert second.returncode == 4
    assert "VM 'busy' is busy: migration of busy to host2" in second.stderr
    assert_still_counting_on(fleet, paths, "busy", "host2")


def test_migration_to_a_host_without_room_is_refused(make_vm, fleet, paths):
    make_vm("filler", host="host3", workload="idle", memory=960)
    make_vm("small", host="host1")
    wait_ticks(paths, "small", 2)
    with pytest.raises(Conflict, match="host host3 has no room for small: needs 128 MiB, 64 MiB free"):
        migrate(fleet, "small", "host3")
    proc = cli("migrate", "small", "--to", "host3")
    assert proc.returncode == 4 and "no room" in proc.stderr
    with pytest.raises(InvalidRequest, match="already runs on host1"):
        migrate(fleet, "small", "host1")
    assert_still_counting_on(fleet, paths, "small", "host1")


@pytest.mark.parametrize("args,code,message", [
    (["vm", "create", "a'/><x"], 2, "invalid VM name"),
    (["vm", "create", "../../etc/x"], 2, "invalid VM name"),
    (["vm", "create", "esc", "--kernel", "../../../../etc/passwd"], 2, "outside the image directory"),
    (["vm", "create", "esc", "--kernel", "/etc/passwd"], 2, "outside the image directory"),
    (["vm", "create", "huge", "--memory", "4096"], 2, "more than any host offers"),
    (["vm", "create", "huge", "--host", "host1", "--memory", "4096"], 2,
     "4096 MiB is more than host host1 offers (1024 MiB)"),
    (["vm", "create", "p", "--param", "interval"], 2, "--param wants KEY=VALUE"),
    (["migrate", "a'/><x", "--to", "host2"], 2, "invalid VM name"),
    (["vm", "console", "../x"], 2, "invalid VM name"),
    (["vm", "destroy", "nobody"], 3, "unknown VM 'nobody'"),
])
def test_bad_requests_are_refused_before_libvirt_sees_them(lab, fleet, args, code, message):
    before = {h.name: sorted(g.name for g in h.guests()) for h in fleet.hosts()}
    proc = cli(*args)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr
    assert proc.stderr.count("\n") == 1  # one clear line, no traceback
    assert {h.name: sorted(g.name for g in h.guests()) for h in fleet.hosts()} == before


def test_console_follow_streams_across_a_move(make_vm, fleet, paths):
    make_vm("follow", host="host1", interval=0.1)
    wait_ticks(paths, "follow", 3)
    stop = threading.Event()
    got = []
    reader = threading.Thread(target=lambda: got.extend(
        console.follow(consoles(paths), "follow", poll=0.05, stop=stop.is_set)))
    reader.start()
    migrate(fleet, "follow", "host2")
    wait_ticks(paths, "follow", len(ticks(paths, "follow")) + 5)
    stop.set()
    reader.join(10)
    text = b"".join(got).decode().replace("\r", "")
    streamed = [int(l.split()[1]) for l in text.splitlines() if l.startswith("tick ")]
    assert streamed[0] == 0
    assert_contiguous(streamed)
    assert streamed == ticks(paths, "follow")[: len(streamed)]
