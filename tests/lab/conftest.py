"""Fixtures for tests on the local lab. Every lab a test starts is taken down, also on failure."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vmmgr import console, local_disks, workloads
from vmmgr.errors import Conflict
from vmmgr.fleet import Fleet
from vmmgr.images import ensure_builtin
from vmmgr.lab import Lab
from vmmgr.paths import default_paths
from vmmgr.spec import make_spec

VMMGR = str(Path(sys.executable).parent / "vmmgr")


def pytest_collection_modifyitems(items):
    for item in items:
        if "/tests/lab/" in str(item.fspath):
            item.add_marker(pytest.mark.lab)
    # The lifecycle tests take labs up and down themselves: run them before the shared lab exists.
    items.sort(key=lambda item: not item.fspath.basename.startswith("test_lab_lifecycle"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, so a fixture can tell that its test failed."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)
    if report.failed and "/tests/lab/" in str(item.fspath) and os.environ.get("VMMGR_HOME"):
        # What the workers were doing, for a failure seen only in CI (the lab is gone after).
        for log in sorted((default_paths().lab / "nodes").glob("*/worker.log")):
            tail = log.read_text(errors="replace").splitlines()[-25:]
            report.sections.append((f"{log.parent.name} worker log (tail)", "\n".join(tail)))


TEST_HOME = "/var/lib/vmmgr-test"  # the suite's own home: never a real fleet's, nor the lab's


@pytest.fixture(scope="session")
def paths():
    if os.geteuid() != 0:
        pytest.fail("the lab tests run as root: they create network namespaces and daemons")
    # The CLI the tests run inherits these: it must find the test lab's home and store only.
    os.environ["VMMGR_HOME"] = os.environ.get("VMMGR_TEST_HOME", TEST_HOME)
    os.environ.pop("VMMGR_REDIS_URL", None)
    return default_paths()


@pytest.fixture(scope="session")
def lab(paths):
    lab = Lab(paths)
    lab.down()  # leftovers of an earlier, crashed run
    try:
        lab.up(3)
        yield lab
    finally:
        lab.down()


@pytest.fixture
def fleet(lab, paths):
    with Fleet(paths) as f:
        yield f


@pytest.fixture
def make_vm(fleet, paths):
    """Create VMs running a built-in workload; every one is destroyed after the test."""
    made = []
    image = ensure_builtin(paths.images)

    def make(name, host="host1", workload="counter", memory=128, gpu="", group="", **params):
        line = workloads.cmdline(workload, {k: str(v) for k, v in params.items()})
        spec = make_spec(name, memory_mib=memory, vcpus=1, kernel=image.kernel,
                         initrd=image.initrd, cmdline=line, image_root=paths.images,
                         workload=workload, gpu_model=gpu, gpu_count=1 if gpu else 0,
                         group=group)
        made.append(name)
        return fleet.create(spec, host)

    yield make
    for name in made:
        destroy_even_if_stuck(fleet, name)


def destroy_even_if_stuck(fleet, name, wait_s: float = 120) -> None:
    """Destroy a test's VM. One an operation still holds (a hung libvirt call) is destroyed
    all the same once `wait_s` has passed, its lock broken, and the teardown fails: the tests
    after it get a clean lab instead of failing on what this one left."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if fleet.find(name) or fleet.is_suspended(name):
                fleet.destroy(name)
            return
        except Conflict as err:
            if time.monotonic() > deadline:
                held = fleet.state.holder("vm", name)
                if held:
                    fleet.state.release("vm", name, held.split()[0])
                fleet.destroy(name)
                raise AssertionError(f"{name} was still held after {wait_s:.0f} s: {err}")
            time.sleep(2)


def cli(*args, check_code=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([VMMGR, *args], capture_output=True, text=True, timeout=300)
    if check_code is not None:
        assert proc.returncode == check_code, (proc.returncode, proc.stdout, proc.stderr)
    return proc


_readers: dict = {}


def consoles(paths) -> console.Consoles:
    """The lab's consoles as the CLI reads them: numbered in the store, each segment through the
    libvirt of a host that sees its site's storage (one fleet for the session's reads)."""
    if paths.home not in _readers:
        _readers[paths.home] = Fleet(paths)
    return _readers[paths.home].consoles


def ticks(paths, vm) -> list[int]:
    text = console.read(consoles(paths), vm).decode(errors="replace").replace("\r", "")
    # Only whole lines: the guest may be halfway through writing the last one ("tick ").
    lines = text.split("\n")[:-1]
    return [int(line.split()[1]) for line in lines if line.startswith("tick ")]


def wait_ticks(paths, vm, at_least: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = ticks(paths, vm)
        if len(seen) >= at_least:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"{vm} printed {len(ticks(paths, vm))} ticks, wanted {at_least}")


def assert_contiguous(seq: list[int]) -> None:
    assert seq, "no output"
    assert seq == list(range(seq[0], seq[0] + len(seq))), f"gap or repeat in {seq}"


def where_defined(fleet, vm) -> list[str]:
    return [h.name for h in fleet.hosts() if h.find_guest(vm) is not None]


def site_saves(lab, site: str) -> Path:
    """A site's saves folder: on its own storage, seen by its hosts at <storage>/saves."""
    return lab.root / "sites" / site / "saves"


def sent_image(fleet, host: str, vm: str) -> bool:
    """Whether a save image sent from another site is on the host's own storage."""
    pool = local_disks.ensure_pool(fleet.host(host).conn)
    local_disks.refresh(pool)
    return local_disks.image_volume_name(vm) in pool.listVolumes()
