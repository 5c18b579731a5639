"""Suspend to disk and resume elsewhere: the VM continues exactly where it stopped."""

import json
import time

from vmmgr import console, suspend
from vmmgr.errors import Conflict

import pytest

from .conftest import assert_contiguous, cli, ticks, wait_ticks, where_defined
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
    assert console.hosts_seen(paths.consoles, "sleeper") == ["host1", "host2"]
    assert not (paths.saves / "sleeper").exists()


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
