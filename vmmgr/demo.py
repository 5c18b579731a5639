"""`vmmgr demo`: the product in one minute, on the local lab.

Two counter VMs start on the first host with the same workload. One stays put (the reference); the
other is live-migrated around the ring host1 -> host2 -> ... -> host1 while it counts. When both
have counted to the end, their serial outputs are compared: identical means the moved VM never
noticed (no tick lost, none repeated).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import console, display, workloads
from .errors import VmmgrError
from .fleet import Fleet
from .images import ensure_builtin
from .lab import Lab
from .migration import MigrationResult, migrate
from .paths import Paths
from .spec import make_spec

MOVED, REFERENCE = "demo-moved", "demo-reference"
TICKS, INTERVAL = 100, 0.2  # 20 s of counting: enough for the whole ring under TCG


@dataclass
class DemoReport:
    hops: list[MigrationResult] = field(default_factory=list)
    identical: bool = False
    moved_lines: list[str] = field(default_factory=list)
    reference_lines: list[str] = field(default_factory=list)


Mover = Callable[[str, str], MigrationResult]  # (vm, target) -> the hop's result


def run(paths: Paths, hosts: int = 3, keep_lab: bool = False, echo: Callable = print,
        on_progress: Callable | None = None, mover: Mover | None = None) -> DemoReport:
    """`mover` makes each hop (the CLI passes one that goes through the task API); by default
    the hop runs here."""
    lab = Lab(paths, log=lambda m: echo(f"  {m}"))
    started_lab = not lab.running_hosts()
    echo(f"== lab: {hosts} hosts")
    records = lab.up(hosts)
    echo(f"   accelerator: {records[0].accel}")
    ring = [r.name for r in records[:hosts]]
    try:
        with Fleet(paths) as fleet:
            move = mover or (lambda vm, target: _migrate_here(fleet, vm, target, on_progress))
            return _run(fleet, paths, ring, echo, move)
    finally:
        with Fleet(paths) as fleet:
            for name in (MOVED, REFERENCE):
                if fleet.find(name):
                    fleet.destroy(name)
        if started_lab and not keep_lab:
            echo("== lab down")
            lab.down()


def _migrate_here(fleet: Fleet, vm: str, target: str, on_progress) -> MigrationResult:
    try:
        return migrate(fleet, vm, target, on_progress=on_progress)
    finally:
        if on_progress:
            on_progress(None)


def _run(fleet: Fleet, paths: Paths, ring: list[str], echo, move: Mover) -> DemoReport:
    image = ensure_builtin(paths.images)
    line = workloads.cmdline("counter", {"interval": str(INTERVAL), "count": str(TICKS)})
    for name in (MOVED, REFERENCE):
        if fleet.find(name):
            fleet.destroy(name)
        spec = make_spec(name, memory_mib=128, vcpus=1, kernel=image.kernel,
                         initrd=image.initrd, cmdline=line, image_root=paths.images,
                         workload="counter")
        fleet.create(spec, ring[0])
    echo(f"== {MOVED} and {REFERENCE} counting to {TICKS} on {ring[0]}")
    _wait_for(fleet, MOVED, "tick 5", timeout=60)

    report = DemoReport()
    for target in ring[1:] + ring[:1]:
        echo(f"== migrate {MOVED} -> {target}")
        result = move(MOVED, target)
        echo(f"   total {result.total_ms} ms, blackout {result.downtime_ms} ms")
        report.hops.append(result)
        time.sleep(1)

    echo("== waiting for both counters to finish")
    for name in (MOVED, REFERENCE):
        _wait_for(fleet, name, "counter done", timeout=120)
    report.moved_lines = _lines(console.read(fleet.consoles, MOVED))
    report.reference_lines = _lines(console.read(fleet.consoles, REFERENCE))
    report.identical = report.moved_lines == report.reference_lines

    echo(f"\n{'moved VM (' + ' -> '.join(console.hosts_seen(fleet.consoles, MOVED)) + ')':40}"
         f"reference VM (never moved)")
    for a, b in zip(_padded(report.moved_lines, report.reference_lines),
                    _padded(report.reference_lines, report.moved_lines)):
        echo(f"{a:40}{b}{'' if a == b else '   <-- differs'}")
    echo("\n" + display.table(display.HOP_HEADERS, display.hop_rows(report.hops)))
    verdict = "IDENTICAL" if report.identical else "DIFFERENT"
    echo(f"\noutputs {verdict}: {len(report.moved_lines)} lines, {len(report.hops)} hops")
    return report


def _lines(data: bytes) -> list[str]:
    return data.decode(errors="replace").replace("\r\n", "\n").splitlines()


def _padded(a: list[str], b: list[str]) -> list[str]:
    return a + [""] * (len(b) - len(a))


def _wait_for(fleet: Fleet, vm: str, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in _lines(console.read(fleet.consoles, vm)):
            return
        time.sleep(0.2)
    raise VmmgrError(f"{vm} did not print {text!r} within {timeout:.0f} s")
