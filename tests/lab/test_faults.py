"""One run of each fault of `./run bench-faults` (bench/faults.py, where each runs five times and
a soak follows): the fault strikes mid-operation, the lab is repaired, and once the fleet has
settled every VM runs on exactly one host or is saved with a complete image and record, its
memory (or console) verified and its record agreeing with libvirt."""

import importlib.util
from pathlib import Path

import pytest

from vmmgr.images import ensure_builtin

_spec = importlib.util.spec_from_file_location(
    "bench_faults", Path(__file__).resolve().parents[2] / "bench" / "faults.py")
faults = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(faults)


@pytest.mark.parametrize("name", list(faults.FAULTS))
def test_a_fault_leaves_every_vm_on_one_host_or_saved(lab, paths, name):
    [row] = faults.run_faults(faults.Lab3(lab, paths), ensure_builtin(paths.images), [name], 1)
    assert not row["error"], row
    for vm in row["vms"]:
        assert vm["outcome"] == "ok", row
        assert vm.get("memory_ok", True) and vm.get("image_complete", True), row
        assert vm["record_agrees_s"] is not None, row
