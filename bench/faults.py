"""Benchmark: faults injected on the lab, then a soak of consecutive moves.

    ./run bench-faults [--runs N] [--moves M] [--only NAME ...] [--merge]

On the lab (a home per host, TLS), with a `dirtier` guest (its memory checked by the guest
itself) and a counter guest (its console must count on without a gap) on host1: each fault
strikes in the middle of an operation, N times (default 5), and the lab is repaired as an
operator would (`lab up`). Once the fleet has settled (no lock, no libvirt job, nothing cut short
on storage), each VM must run on exactly one host or be saved with a complete image and record
(0 lost, 0 running twice, 0 left shut off or paused with no way back), its memory verified, the
counter contiguous, and its record agreeing with libvirt within 30 s.

Then the soak: M moves (default 500) of a dirtier VM round the lab, with a reclaim of its host and
a suspend/resume every 50, memory verified every 10 moves; failures and blackouts reported.
Writes bench/results/faults.json and faults.md.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.lab.test_engine import CutInPostcopy, dirtier_lines  # noqa: E402  (the guest's own verdicts)
from vmmgr import console, operations, suspend, workloads  # noqa: E402
from vmmgr.errors import Conflict, MigrationFailed, VmmgrError  # noqa: E402
from vmmgr.fleet import Fleet  # noqa: E402
from vmmgr.images import ensure_builtin  # noqa: E402
from vmmgr.lab import LAB_GPU_MODEL, SUBNET, Lab  # noqa: E402
from vmmgr.paths import lab_paths  # noqa: E402
from vmmgr.spec import make_spec  # noqa: E402
from vmmgr.state import FleetState  # noqa: E402
from tasks.app import VISIBILITY_TIMEOUT  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VMMGR = str(Path(sys.executable).parent / "vmmgr")
DIRTY, COUNT, GPU = "fault-dirt", "fault-count", "fault-gpu"
FAULTS = {}  # name -> (the fault, the VMs it strikes)


def fault(name: str, vms: tuple[str, ...] = (DIRTY, COUNT)):
    def register(fn):
        FAULTS[name] = (fn, vms)
        return fn
    return register


class Lab3:
    """The lab and what a fault needs of it."""

    def __init__(self, lab: Lab, paths):
        self.lab, self.paths = lab, paths
        self.state = FleetState(paths.redis_url())

    def cli(self, *args: str) -> str:
        proc = subprocess.run([VMMGR, *args], capture_output=True, text=True, timeout=600,
                              env=os.environ | {"VMMGR_HOME": str(self.paths.home)})
        if proc.returncode:
            raise RuntimeError(f"vmmgr {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def task_of(self, out: str) -> str:
        return out.split()[-1]

    def task_state(self, task_id: str) -> str | None:
        tasks = json.loads(self.cli("tasks", "--limit", "50", "--json"))
        return next((t["state"] for t in tasks if t["id"] == task_id), None)

    def kill_worker_of(self, task_id: str) -> None:
        worker = wait(lambda: self.state.task(task_id).get("worker"), 60, "task never started")
        os.kill(self.lab.services().worker_pid(worker), signal.SIGKILL)

    def link(self, up: bool, new_only: bool = False, source: str = "host1",
             target: str = "host2") -> None:
        """source -> target: every packet refused (or, `new_only`, new connections only)."""
        ip = f"{SUBNET}.{10 + int(target.removeprefix('host'))}"  # as Lab gives it
        rule = ["-d", ip, "-p", "tcp", *(["-m", "conntrack", "--ctstate", "NEW"]
                                         if new_only else []),
                "-j", "REJECT", "--reject-with", "tcp-reset"]
        ipt = ["ip", "netns", "exec", f"vmmgr-{source}", "iptables"]
        if up:
            subprocess.run([*ipt, "-D", "OUTPUT", *rule], capture_output=True)
            return
        subprocess.run([*ipt, "-I", "OUTPUT", *rule], check=True)
        subprocess.run(["ip", "netns", "exec", f"vmmgr-{source}", "ss", "-K", "dst", ip],
                       capture_output=True)

    def libvirtd_pid(self, host: str) -> int:
        return next(s.libvirtd_pid for s in self.lab.status() if s.name == host)


def wait(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.3)


# ---- the faults ---------------------------------------------------------------------------

@fault("worker SIGKILLed mid-save")
def worker_mid_save(c: Lab3, fleet: Fleet) -> None:
    task = c.task_of(c.cli("vm", "suspend", DIRTY, "--no-wait"))
    wait(lambda: (c.paths.saves / DIRTY / "image.partial").exists(), 60, "no save began")
    c.kill_worker_of(task)
    c.lab.up(3)
    wait(lambda: not suspend.cut_short(fleet) and suspend.find_suspended(fleet, DIRTY), 180,
         "the cut-short save was not finished")
    c.cli("vm", "resume", DIRTY, "--host", "host2")


def _resume_begun(c: Lab3) -> str:
    """The dirtier suspended, then a resume to host2 queued: its task once it has claimed the
    image (or has already ended)."""
    c.cli("vm", "suspend", DIRTY)
    task = c.task_of(c.cli("vm", "resume", DIRTY, "--host", "host2", "--no-wait"))
    wait(lambda: (c.paths.saves / DIRTY / "claim.json").exists()
         or not (c.paths.saves / DIRTY).exists(), 60, "no resume began")
    return task


@fault("worker SIGKILLed mid-resume")
def worker_mid_resume(c: Lab3, fleet: Fleet) -> None:
    task = _resume_begun(c)
    c.kill_worker_of(task)
    c.lab.up(3)
    wait(lambda: not suspend.cut_short(fleet) and not c.state.holder("vm", DIRTY), 180,
         "the cut-short resume was not settled")
    if suspend.find_suspended(fleet, DIRTY):  # it was undone: resume it now
        c.cli("vm", "resume", DIRTY, "--host", "host2")


@fault("worker SIGKILLed mid-hibernation", (DIRTY, COUNT, GPU))
def worker_mid_hibernation(c: Lab3, fleet: Fleet) -> None:
    # A VM with a passed-through device moves by guest hibernation: killed once the guest was
    # asked, the guest powers off on its own, its memory on its swap disk and no record yet.
    task = c.task_of(c.cli("vm", "suspend", GPU, "--mode", "guest", "--no-wait"))
    wait(lambda: (c.paths.saves / GPU / "intent.json").exists(), 60, "no hibernation began")
    time.sleep(1)
    c.kill_worker_of(task)
    c.lab.up(3)
    wait(lambda: not suspend.cut_short(fleet) and not c.state.holder("vm", GPU), 300,
         "the cut-short hibernation was not settled")
    if suspend.find_suspended(fleet, GPU):  # hibernated: it boots from its image on host2
        c.cli("vm", "resume", GPU, "--host", "host2")


@fault("worker SIGKILLed while a hibernated VM's resume waits for it to restore",
       (DIRTY, COUNT, GPU))
def worker_mid_restore_wait(c: Lab3, fleet: Fleet) -> None:
    # The resume boots the VM on host2, then waits for the guest to show whether its image
    # restored: killed in that wait, the VM already runs there and its save is gone.
    c.cli("vm", "suspend", GPU, "--mode", "guest")
    task = c.task_of(c.cli("vm", "resume", GPU, "--host", "host2", "--no-wait"))
    wait(lambda: fleet.host("host2").find_guest(GPU) is not None, 60, "the resume never booted it")
    c.kill_worker_of(task)
    c.lab.up(3)
    # the redelivered task finds it back, writes the record and waits again for the guest's sign
    ended = wait(lambda: c.state.task(task).get("outcome"), VISIBILITY_TIMEOUT + 180,
                 "the resume's rerun never ended")
    result = json.loads(ended).get("result") or {}
    if not (result.get("already_done") and result.get("restored") is True):
        raise AssertionError(f"the rerun did not say the guest came back restored: {ended}")


@fault("worker SIGKILLed mid-migration")
def worker_mid_migration(c: Lab3, fleet: Fleet) -> None:
    task = c.task_of(c.cli("migrate", DIRTY, "--to", "host2", "--bandwidth", "20", "--no-wait"))
    wait(lambda: c.state.vm(DIRTY).get("state") == "migrating", 60, "no migration began")
    time.sleep(1)
    c.kill_worker_of(task)
    c.lab.up(3)


@fault("worker SIGKILLed in post-copy")
def worker_mid_postcopy(c: Lab3, fleet: Fleet) -> str:
    # A deadline's moves switch to post-copy early, so a worker may die once the guest already
    # runs on host2 and pulls the rest of its memory: the move can only go forward. The source's
    # libvirtd carries the post-copy on without its client; the redelivered task finds it ended
    # or steers it to its end, and the VM is on host2 once, its memory whole.
    task = c.task_of(c.cli("migrate", DIRTY, "--to", "host2", "--policy", "never-fail",
                           "--bandwidth", "8", "--no-wait"))
    wait(lambda: _in_postcopy(fleet, DIRTY), 120, "the migration never switched to post-copy")
    c.kill_worker_of(task)
    c.lab.up(3)
    wait(lambda: c.task_state(task) in ("SUCCESS", "FAILURE")
         and not c.state.holder("vm", DIRTY), 300, "the redelivered migration did not end")
    where = [g.host_name for g in fleet.find_all(DIRTY)]
    if where != ["host2"] or c.task_state(task) != "SUCCESS":
        raise RuntimeError(f"after the post-copy: task {c.task_state(task)}, defined on {where}")
    return f"task runs: {c.state.task(task).get('runs')}"


def _in_postcopy(fleet: Fleet, vm: str) -> bool:
    try:
        return any(g.postcopy_phase() == "running" for g in fleet.find_all(vm))
    except VmmgrError:
        return False


@fault("link cut in pre-copy, restored 5 s later")
def link_cut_precopy(c: Lab3, fleet: Fleet) -> None:
    _cut_during(c, fleet, "precopy", new_only=False, expect=MigrationFailed)


@fault("link cut in post-copy, restored 5 s later")
def link_cut_postcopy(c: Lab3, fleet: Fleet) -> None:
    # The cut's resets reach host2 (see the README's post-copy notes); the reconcile resumes.
    _cut_during(c, fleet, "postcopy", new_only=True, expect=MigrationFailed)
    wait(lambda: c.state.vm(DIRTY).get("state") == "running", 180,
         "the reconcile did not resume the post-copy")


@fault("destination libvirtd SIGKILLed in pre-copy")
def dest_libvirtd_precopy(c: Lab3, fleet: Fleet) -> None:
    pid = c.libvirtd_pid("host2")

    class Report(operations.LocalReport):
        polls = 0

        def progress(self, progress):
            Report.polls += 1
            if Report.polls == 3:
                os.kill(pid, signal.SIGKILL)

    try:
        operations.migrate(fleet, Report(fleet), DIRTY, "host2", None, 20)
    except VmmgrError:
        pass
    c.lab.up(3)  # the operator's repair: host2 comes back


@fault("source libvirtd SIGKILLed in pre-copy, restarted")
def source_libvirtd_precopy(c: Lab3, fleet: Fleet) -> None:
    class Report(operations.LocalReport):
        polls = 0

        def progress(self, progress):
            Report.polls += 1
            if Report.polls == 3:
                os.kill(c.libvirtd_pid("host1"), signal.SIGKILL)

    try:
        operations.migrate(fleet, Report(fleet), DIRTY, "host2", None, 20)
    except VmmgrError:
        pass
    time.sleep(2)
    c.lab.restart_libvirtd("host1")  # as systemd restarts it; its QEMUs ran on meanwhile


@fault("destination QEMU SIGKILLed at the switch-over", (COUNT,))
def dest_qemu_at_switchover(c: Lab3, fleet: Fleet) -> str:
    # The source has paused for the switch-over, and the edge already sends the VM's address to
    # host2 (migration._follow_switchover), when host2's QEMU dies: the migration fails, the VM
    # resumes on host1, and its address must be routed back there. A 1 s downtime limit over a
    # 16 MiB/s cap makes the switch-over last about a second: the strike lands inside it.
    from dataclasses import replace

    from vmmgr import policy as pol
    from vmmgr.edge import Edge
    from vmmgr.render import address_of

    address = address_of(fleet.locate(COUNT).xml())
    routes = []  # where the migration sent the address, in order
    route_address = fleet.route_address
    fleet.route_address = lambda ip, host: (routes.append(host), route_address(ip, host))[1]
    saved = pol.POLICIES["safe"]
    pol.POLICIES["safe"] = replace(saved, downtime_start_ms=1000, downtime_steps=0)
    with _struck_at_switchover(fleet, signal.SIGKILL) as incoming:
        try:
            operations.migrate(fleet, operations.LocalReport(fleet), COUNT, "host2", "safe", 16)
        except MigrationFailed:
            pass
        finally:
            pol.POLICIES["safe"] = saved
            del fleet.route_address
    if not incoming.struck:
        raise RuntimeError(f"the strike missed the switch-over (host2's QEMU: {incoming.pid})")
    where = fleet.locate(COUNT).host_name
    routed = Edge.load(c.paths, c.state).routes().get(address)
    if where != "host1" or routed != "host1" or routes != ["host2", "host1"]:
        raise RuntimeError(f"{COUNT} runs on {where}, its address {address} routed to {routed} "
                           f"(by the migration: {' then '.join(routes) or 'nowhere'})")
    return f"{COUNT} runs on host1 again; {address} was routed to host2 at the pause, then back"


@fault("worker SIGKILLed with the VM paused for its switch-over, which then completes",
       (COUNT,))
def worker_at_switchover_completed(c: Lab3, fleet: Fleet) -> str:
    return _worker_killed_at_switchover(c, fleet, signal.SIGCONT)


@fault("worker SIGKILLed with the VM paused for its switch-over, which then fails", (COUNT,))
def worker_at_switchover_failed(c: Lab3, fleet: Fleet) -> str:
    return _worker_killed_at_switchover(c, fleet, signal.SIGKILL)


def _worker_killed_at_switchover(c: Lab3, fleet: Fleet, then: int) -> str:
    # The source has paused the VM for the switch-over (vmmgr's pause or QEMU's) when the
    # worker that runs the move dies: no run of vmmgr is left to resume a VM it paused. host2's
    # QEMU is stopped at that pause, so that the switch-over outlasts the worker, then let go
    # (libvirt completes the move without its client) or killed (the move fails, and libvirt
    # resumes the VM on host1, as it was running when the move began). Either way the VM runs,
    # once, and the redelivered task ends the move on host2 (moving it again if it failed).
    with _struck_at_switchover(fleet, signal.SIGSTOP, then) as incoming:
        task = c.task_of(c.cli("migrate", COUNT, "--to", "host2", "--no-wait"))
        incoming.wait()
        c.kill_worker_of(task)
        time.sleep(3)
        paused = fleet.host("host1").find_guest(COUNT).state()
    c.lab.up(3)
    wait(lambda: c.task_state(task) in ("SUCCESS", "FAILURE")
         and not c.state.holder("vm", COUNT), VISIBILITY_TIMEOUT + 180,
         "the redelivered migration did not end")
    where = [f"{g.host_name}:{g.state()}" for g in fleet.find_all(COUNT)]
    if paused != "paused" or where != ["host2:running"] or c.task_state(task) != "SUCCESS":
        raise RuntimeError(f"{COUNT} was {paused} on host1 3 s after the worker died; now "
                           f"{where}, its task {c.task_state(task)}")
    return f"its task's run {c.state.task(task).get('runs')} ended the move on host2"


@fault("destination QEMU hung at the switch-over for 45 s", (COUNT,))
def dest_qemu_hung_at_switchover(c: Lab3, fleet: Fleet) -> str:
    # host2's QEMU stops taking the VM the moment the source pauses for the switch-over, and
    # takes it up again only 45 s later (SIGSTOP, SIGCONT): libvirt alone would wait, the VM
    # paused on host1. The move's watch of the pause (policy.decide_paused) aborts it after
    # 10 s. Either QEMU had not sent it all: libvirt resumes the VM on host1, its address goes
    # back there, and host2's copy, which never ran, is destroyed so that the move ends before
    # the hang does. Or it had: the VM stays paused until host2 takes it up again, host2's
    # copy untouched (destroyed, it could take the VM with it), and libvirt then ends the move
    # one way or the other; unless the source's job says the abort took (libvirt then waits
    # for host2 to end the move, and will not start it): host2's copy is destroyed. Or host1's
    # QEMU is stuck sending the rest, its monitor silent: host2's copy is destroyed
    # (policy.decide_unanswered), which fails the send. Never on both hosts.
    return _hung_at_switchover(c, fleet, COUNT)


@fault("destination QEMU hung at a switch-over bigger than the socket", (DIRTY,))
def dest_qemu_hung_mid_tail(c: Lab3, fleet: Fleet) -> str:
    # As above, with a switch-over of tens of MiB: a 5 s downtime limit over a 16 MiB/s cap
    # lets QEMU switch over with the dirtier's whole working set (48 MiB) left, far more than
    # the sockets between the hosts hold. If QEMU paused the VM, it is then stuck sending the
    # rest holding its main lock: no query of the job answers, no abort gets through, and
    # host2's copy is destroyed (policy.decide_unanswered). If vmmgr paused it (the edge's
    # hold), QEMU's pass blocks without that lock: the abort takes, and libvirt waits for
    # host2 to end the move, the VM paused; host2's copy is destroyed once the source's job
    # says cancelled. Either way the move must end before the hang does, the VM on host1.
    return _hung_at_switchover(c, fleet, DIRTY, before_the_hang=True, policy="safe", bandwidth=16,
                               downtime_start_ms=5000, downtime_steps=0)


def _hung_at_switchover(c: Lab3, fleet: Fleet, vm: str, before_the_hang: bool = False,
                        **move) -> str:
    from vmmgr.edge import Edge
    from vmmgr.render import address_of

    hang_s = 45
    address = address_of(fleet.locate(vm).xml())
    events: list[tuple[float, str]] = []

    class Report(operations.LocalReport):
        def progress(self, progress):
            if progress.event:
                events.append((time.monotonic(), progress.event))

    moved = threading.Event()

    def end_the_hang() -> None:
        if incoming.paused.wait(120) and not moved.wait(hang_s):
            incoming.let_go()

    with _struck_at_switchover(fleet, signal.SIGSTOP, signal.SIGCONT, vm) as incoming:
        threading.Thread(target=end_the_hang, daemon=True).start()
        try:
            operations.migrate(fleet, Report(fleet), vm, "host2", **move)
            failed = ""
        except MigrationFailed as err:
            failed = str(err)
        finally:
            ended = time.monotonic()
            moved.set()
        if not incoming.struck:
            raise RuntimeError("the strike missed the switch-over")
    where = [f"{g.host_name}:{g.state()}" for g in fleet.find_all(vm)]
    host = where[0].split(":")[0] if len(where) == 1 and where[0].endswith(":running") else None
    routed = Edge.load(c.paths, c.state).routes().get(address)
    since = {e: round(t - incoming.struck_at, 1) for t, e in reversed(events)}
    drop = next(((e, t) for e, t in since.items() if "never run, destroyed" in e), None)
    dropped = drop[1] if drop else None
    back = next((t for e, t in since.items() if "runs on host1 again" in e), None)
    took = ended - incoming.struck_at
    aborted = "the target does not take it" in failed  # the policy's abort: the move's error
    if drop is not None:  # the move ended before the hang, the VM on host1
        ok = host == "host1" and took < hang_s and bool(failed)
        if "stuck sending" in drop[0]:  # no abort: libvirt's own error for the broken send
            how = "host1's QEMU stuck sending the rest"
        elif "libvirt reports the move ended" in drop[0]:
            ok = ok and aborted
            how = "the abort took, libvirt waiting for host2 to end the move"
        else:
            ok = ok and aborted and back is not None and back < dropped
            how = f"resumed on host1 {back} s after the pause"
        how += f": host2's copy destroyed at {dropped} s, the move ended at {took:.0f} s"
    else:  # sent whole: paused until host2 took it up again; libvirt then ended the move
        ok = (host is not None and took >= hang_s - 1 and not before_the_hang
              and any("is still paused on host1" in e for e in since))
        how = "sent whole, the move waited for host2" + (
            f", then {'completed on host2' if host == 'host2' else 'failed, the VM on host1'}"
            f" at {took:.0f} s")
    if not ok or routed != host:
        raise RuntimeError(f"{vm} is {where}, {address} routed to {routed}, the move took "
                           f"{took:.0f} s ({failed or 'completed'}); events: {since}")
    return how


class _struck_at_switchover:
    """Sends host2's incoming QEMU of `vm` `strike` when host1 pauses `vm` for its
    switch-over; on leaving, sends it `then` if given (SIGCONT, or SIGKILL if it is still
    there, followed by a SIGCONT so that a stopped process takes it)."""

    def __init__(self, fleet: Fleet, strike: int, then: int | None = None, vm: str = COUNT):
        self.host1, self.strike, self.then, self.vm = fleet.host("host1"), strike, then, vm
        self.pid: int | None = None
        self.found, self.paused = threading.Event(), threading.Event()
        self.struck = False

    def __enter__(self) -> "_struck_at_switchover":
        import libvirt

        def at_source(event: int, detail: int) -> None:
            if (event == libvirt.VIR_DOMAIN_EVENT_SUSPENDED
                    and detail == libvirt.VIR_DOMAIN_EVENT_SUSPENDED_MIGRATED
                    and self.pid and not self.struck):
                os.kill(self.pid, self.strike)
                self.struck, self.struck_at = True, time.monotonic()
                self.paused.set()

        self.token = self.host1.watch_lifecycle(self.vm, at_source)
        threading.Thread(target=self._find, daemon=True).start()
        return self

    def _find(self) -> None:  # host2's QEMU runs from libvirt's prepare on
        while not self.found.wait(0.05):
            pids = subprocess.run(["pgrep", "-n", "-f", f"guest={self.vm},.*-incoming"],
                                  capture_output=True, text=True).stdout.split()
            if pids:
                self.pid = int(pids[0])
                self.found.set()

    def let_go(self) -> None:
        try:
            os.kill(self.pid, signal.SIGCONT)
        except (ProcessLookupError, TypeError):
            pass

    def wait(self) -> None:
        if not self.paused.wait(120):
            raise RuntimeError(f"the strike missed the switch-over (host2's QEMU: {self.pid})")

    def __exit__(self, *exc) -> None:
        self.found.set()
        self.host1.unwatch(self.token)
        if self.pid and self.then:
            try:
                os.kill(self.pid, self.then)
                os.kill(self.pid, signal.SIGCONT)  # a stopped process takes its signal once run
            except ProcessLookupError:
                pass


@fault("Redis SIGKILLed mid-reclaim, back 5 s later")
def redis_mid_reclaim(c: Lab3, fleet: Fleet) -> None:
    task = c.task_of(c.cli("host", "reclaim", "host1", "--no-wait"))
    wait(lambda: any(c.state.vm(v).get("state") in ("migrating", "suspending")
                     for v in (DIRTY, COUNT)), 60, "the reclaim never started")
    os.kill(c.lab.services().redis_pid(), signal.SIGKILL)
    time.sleep(5)
    c.lab.up(3)  # brings Redis back (its append-only file keeps the fleet's state)
    wait(lambda: c.task_state(task) in ("SUCCESS", "FAILURE")
         and not c.state.holder("host", "host1"), 300, "the reclaim did not end")
    c.cli("host", "enable", "host1")
    # The reclaim's acknowledgement may have been lost with Redis: its message comes back after
    # the visibility timeout, and must not empty the host enabled since.
    time.sleep(VISIBILITY_TIMEOUT + 15)
    # Celery's consumer may die on the reconnect ("Unrecoverable error ... 'hostname'", seen when
    # it was restoring an unacknowledged message as Redis went): its worker ends once its task
    # is done. systemd restarts it on a real host (Restart=always); here `lab up` does.
    c.lab.up(3)
    runs = c.state.task(task).get("runs")
    if fleet.host("host1").record.state != "active" or runs != "1":
        raise RuntimeError(f"the reclaim ran again ({runs} runs): host1 is "
                           f"{fleet.host('host1').record.state}")
    replayed = any("had already ended" in e["message"]
                   for e in c.state.events(500) if e.get("task") == task)
    return "its message came back and was answered, not run" if replayed else \
        "its acknowledgement was not lost"


@fault("Redis SIGKILLed mid-resume, back 5 s later")
def redis_mid_resume(c: Lab3, fleet: Fleet) -> str:
    # Killed once the resume has claimed the image: the resume's lease check before the restore
    # (or any write to the store after it) fails, and the claim is given back, or the restore
    # has begun and the VM runs on. Its task's message, unacknowledged, may come back after the
    # visibility timeout: its rerun must find the resume done, or undone, and never restore the
    # image a second time.
    task = _resume_begun(c)
    os.kill(c.lab.services().redis_pid(), signal.SIGKILL)
    time.sleep(5)
    c.lab.up(3)  # Redis back from its append-only file, and any worker it took along
    wait(lambda: c.task_state(task) in ("SUCCESS", "FAILURE")
         and not c.state.holder("vm", DIRTY), VISIBILITY_TIMEOUT + 180, "the resume did not end")
    wait(lambda: not suspend.cut_short(fleet), 180, "the cut-short resume was not settled")
    c.lab.up(3)  # a worker whose consumer died on the reconnect (see redis_mid_reclaim)
    said = c.task_state(task)
    ended = f"its task ended {said} in {c.state.task(task).get('runs')} run(s)"
    # What the task answers must be what happened: a restored VM recorded once the store is
    # back (`stored`), not a failure, and an undone resume not a success.
    if suspend.find_suspended(fleet, DIRTY):  # undone before its restore: resume it now
        if said != "FAILURE":
            raise RuntimeError(f"the resume was undone, and {ended}")
        c.cli("vm", "resume", DIRTY, "--host", "host2")
        return f"undone, the VM saved; {ended}"
    if said != "SUCCESS":
        raise RuntimeError(f"the VM was resumed on {[g.host_name for g in fleet.find_all(DIRTY)]}"
                           f", and {ended}: {c.state.task(task).get('outcome')}")
    return f"resumed through the store's death; {ended}"


@fault("Redis SIGKILLed in a destroy, just after the undefine")
def redis_mid_destroy(c: Lab3, fleet: Fleet) -> str:
    # In-process, at the one point where the store's death leaves something behind: COUNT is
    # gone from libvirt, its address, route and console are not. The operator's second
    # `vm destroy` (once the dead one's lease lapses) must remove them all. COUNT is then created
    # again, so the verdict also shows DIRTY running on through the store's death.
    import redis

    from vmmgr.addresses import pool_for
    from vmmgr.edge import Edge
    from vmmgr.guest import Guest

    ip = pool_for(c.paths, c.state.r).address_of(COUNT)
    undefine = Guest.undefine

    def undefine_then_kill_the_store(guest):
        undefine(guest)
        os.kill(c.lab.services().redis_pid(), signal.SIGKILL)

    Guest.undefine = undefine_then_kill_the_store
    try:
        fleet.destroy(COUNT)
        raise RuntimeError("the destroy ended well with the store killed in it")
    except redis.RedisError:
        pass
    finally:
        Guest.undefine = undefine
        c.lab.up(3)  # Redis back from its append-only file, and any worker it took along
    left = pool_for(c.paths, c.state.r).address_of(COUNT)
    wait(lambda: not c.state.holder("vm", COUNT), 60, "the dead destroy's lease never lapsed")
    try:
        for _ in range(20):  # busy while a reconcile pass holds it a moment: as an operator, again
            try:
                c.cli("vm", "destroy", COUNT)
                break
            except RuntimeError as err:
                if "busy" not in str(err):
                    raise
                time.sleep(1)
        by = "the second destroy"
    except RuntimeError as err:  # the reconcile's sweep came first (it says so), or a failure
        if "unknown VM" not in str(err):
            raise
        # (the sweep says so once it has let the VM go: a moment after the address is free)
        wait(lambda: any(e["message"].startswith(f"{COUNT}: its address {ip} freed")
                         for e in c.state.events(500, vm=COUNT)), 30,
             f"{err}: and no sweep said it freed the address")
        by = "the reconcile's sweep"
    still = {"definition": bool(fleet.find_all(COUNT, strict=True)),
             "address": bool(pool_for(c.paths, c.state.r).address_of(COUNT)),
             "route": ip in Edge.load(c.paths, c.state).routes(),
             "console": bool(fleet.consoles.segments(COUNT)),
             "save": fleet.is_suspended(COUNT)}
    if any(still.values()):
        raise RuntimeError(f"the second destroy left {[k for k, v in still.items() if v]}")
    c.lab.up(3)
    create(fleet, c.paths, ensure_builtin(c.paths.images), (COUNT,))
    return ("the first destroy left its address" if left == ip else
            "the first destroy had freed its address") + f"; {by} removed all it left"


@fault("worker SIGKILLed mid-reclaim against a deadline")
def worker_mid_deadline_reclaim(c: Lab3, fleet: Fleet) -> str:
    # A notice's reclaim runs on any worker; that worker dies while the plan moves VMs. Its
    # message comes back after the visibility timeout and the rerun plans what is left against
    # the same instant (the deadline is a time, not a duration), waiting out the dead run's
    # migration that libvirt carried on. Every VM must be off host1 before the deadline.
    deadline_s, t0 = 120, time.time()
    task = c.task_of(c.cli("host", "reclaim", "host1", "--deadline", f"{deadline_s}s",
                           "--no-wait"))
    wait(lambda: any(c.state.vm(v).get("state") in ("migrating", "suspending")
                     for v in (DIRTY, COUNT)), 60, "the reclaim never started")
    c.kill_worker_of(task)
    c.lab.up(3)
    wait(lambda: c.task_state(task) in ("SUCCESS", "FAILURE")
         and not c.state.holder("host", "host1"), 300, "the reclaim did not end")
    ended = float(c.state.task(task)["ended"]) - t0
    runs = c.state.task(task).get("runs")
    left = [v for v in (DIRTY, COUNT) if (g := fleet.find(v)) and g.host_name == "host1"]
    if left or runs != "2" or ended > deadline_s:
        raise RuntimeError(f"after {runs} run(s), ended at {ended:.0f} s of {deadline_s} s: "
                           f"{left or 'nothing'} left on host1")
    return f"its rerun emptied host1 {ended:.0f} s into a {deadline_s} s deadline"


@fault("two control nodes move one VM at once")
def conflicting_requests(c: Lab3, fleet: Fleet) -> None:
    env = os.environ | {"VMMGR_HOME": str(c.paths.home)}
    procs = [subprocess.Popen([VMMGR, "migrate", DIRTY, "--to", target], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for target in ("host2", "host3")]
    codes = [p.wait(timeout=300) for p in procs]
    if sorted(codes) != [0, 4]:  # one moves it, the other is refused (busy), nothing else
        raise RuntimeError(f"exit codes {codes}")


@fault("two reconciles at once")
def two_reconciles(c: Lab3, fleet: Fleet) -> None:
    from tasks import client
    from tasks.app import CONTROL_QUEUE, use_broker

    use_broker(c.paths.redis_url())
    operations.suspend(fleet, operations.LocalReport(fleet), DIRTY, parked=True)
    ids = [client.submit(c.paths, "reconcile", {}, CONTROL_QUEUE, None) for _ in range(2)]
    results = [client.wait(i) for i in ids]
    resumed = [r for result in results for r in result.get("resumed", [])]
    if len(resumed) > 1:
        raise RuntimeError(f"resumed twice: {results}")
    wait(lambda: not suspend.find_suspended(fleet, DIRTY), 60, "the parked VM was not resumed")


def _cut_during(c: Lab3, fleet: Fleet, phase: str, new_only: bool, expect) -> None:
    from dataclasses import replace

    from vmmgr import migration, policy as pol

    saved = pol.POLICIES["never-fail"], migration.POSTCOPY_RECOVERY_ATTEMPTS
    pol.POLICIES["never-fail"] = replace(saved[0], downtime_start_ms=300, downtime_steps=0,
                                         postcopy_after_stall_s=0.5)
    migration.POSTCOPY_RECOVERY_ATTEMPTS = 1
    cut, polls = [], []

    def cut_the_link():
        c.link(False, new_only)
        cut.append(threading.Timer(5, c.link, (True, new_only)))
        cut[0].start()

    # In post-copy: once the destination's vCPUs have run a while (why: CutInPostcopy).
    in_postcopy = CutInPostcopy(fleet, DIRTY, "host2", cut_the_link)

    class Report(operations.LocalReport):
        def progress(self, progress):
            if phase == "postcopy":
                in_postcopy(progress)
                return
            polls.append(progress.phase)
            if polls.count(phase) == 5 and not cut:  # a second into pre-copy
                cut_the_link()

    try:
        operations.migrate(fleet, Report(fleet), DIRTY, "host2", "never-fail", 8)
    except expect:
        pass
    finally:
        pol.POLICIES["never-fail"], migration.POSTCOPY_RECOVERY_ATTEMPTS = saved
        in_postcopy.join()  # a cut it makes is in `cut` before the link is restored
        for timer in cut:
            timer.join()
        c.link(True, new_only)


# ---- the verdict ------------------------------------------------------------------------------

def settle(c: Lab3, vms: list[str], timeout: float = 120) -> None:
    def quiet() -> bool:
        with Fleet(c.paths) as f:
            if suspend.cut_short(f) or any(c.state.holder("vm", v) for v in vms):
                return False
            try:
                return not any(g.has_job() for v in vms for g in f.find_all(v))
            except VmmgrError:
                return False
    wait(quiet, timeout, "the fleet did not settle")


def verdict(c: Lab3, vm: str) -> dict:
    with Fleet(c.paths) as f:
        copies = f.find_all(vm)
        active = [g for g in copies if g.is_active()]
        running = [g for g in active if g.state() == "running"]
        saved = suspend.find_suspended(f, vm)
    out = {"vm": vm, "where": [f"{g.host_name}:{g.state()}" for g in copies],
           "saved": bool(saved)}
    if not copies and not saved:
        out["outcome"] = "lost"
    elif len(active) > 1 or (active and saved):
        out["outcome"] = "twice"
    elif not running and not saved:
        out["outcome"] = "stopped"
    else:
        out["outcome"] = "ok"
    if saved and saved.mode == "save":
        image = c.paths.saves / vm / "image"
        out["image_complete"] = image.read_bytes()[:16] == suspend.COMPLETE_MAGIC
    host = running[0].host_name if running else ""
    t0 = time.monotonic()

    def agrees() -> bool:
        # the VM's record, and the store's copy of its save (none once it runs again)
        rec, save = c.state.vm(vm), c.state.save_of(vm)
        return (rec.get("state"), rec.get("host", "")) == (
            ("running", host) if host else ("suspended", "")) and (
            save is None if host else save is not None and save["state"] == "saved")
    try:
        wait(agrees, 30, "records")
        out["record_agrees_s"] = round(time.monotonic() - t0, 1)
    except TimeoutError:
        out["record_agrees_s"] = None
    if running:
        out["memory_ok"] = guest_ok(c, vm)
    return out


def guest_ok(c: Lab3, vm: str) -> bool:
    """The dirtier passes on with no corruption and no restart; the counter counts on."""
    if vm != DIRTY:  # a counter
        seen = _ticks(c, vm)
        wait(lambda: len(_ticks(c, vm)) >= len(seen) + 3, 60, "the counter stopped")
        ticks = _ticks(c, vm)
        return ticks == list(range(ticks[0], ticks[0] + len(ticks)))
    passes = lambda: [int(l.split("pass=")[1].split()[0])  # noqa: E731
                      for l in dirtier_lines(c.paths, vm) if "pass=" in l]
    before = passes()[-1] if passes() else 0
    wait(lambda: passes() and passes()[-1] >= before + 2, 90, "the dirtier stopped")
    lines = dirtier_lines(c.paths, vm)
    return (not [l for l in lines if l.startswith("CORRUPT") or ("pass=" in l and "corrupt=0" not in l)]
            and sum(l.startswith("dirtier start") for l in lines) == 1)


def _ticks(c: Lab3, vm: str) -> list[int]:
    with Fleet(c.paths) as fleet:
        text = console.read(fleet.consoles, vm).decode(errors="replace").replace("\r", "")
    lines = text.split("\n")[:-1]  # whole lines only: the last may be half written
    return [int(line.split()[1]) for line in lines if line.startswith("tick ")]


def create(fleet: Fleet, paths, image, vms=(DIRTY, COUNT)) -> None:
    specs = {DIRTY: ("dirtier", 192, {"rate": "16", "mib": "48"}, ""),
             COUNT: ("counter", 128, {"interval": "0.2"}, ""),
             # hibernating needs room for the image's copy: 256 MiB (as tests/lab/test_gpu.py)
             GPU: ("counter", 256, {"interval": "0.2"}, LAB_GPU_MODEL)}
    for name in vms:
        workload, memory, params, gpu = specs[name]
        if fleet.find(name) or fleet.is_suspended(name):
            destroy(fleet, name)
        spec = make_spec(name, memory_mib=memory, vcpus=1, kernel=image.kernel,
                         initrd=image.initrd, cmdline=workloads.cmdline(workload, params),
                         image_root=paths.images, workload=workload, gpu_model=gpu,
                         gpu_count=1 if gpu else 0)
        when_free(lambda: fleet.create(spec, "host1"))
    time.sleep(8)  # booted, the dirtier past its first passes
    if GPU in vms:
        wait(lambda: "state='connected'" in fleet.locate(GPU).xml(), 60,
             "the guest agent never connected")


def destroy(fleet: Fleet, vm: str) -> None:
    """As `vm destroy` does (`operations.destroy`): its record goes with it. A record left
    behind has a scheduled reconcile take the VM's lock to check it, and the next run's create
    of the same name would find the VM busy."""
    when_free(lambda: fleet.destroy(vm))
    fleet.state.forget_vm(vm)


def when_free(call, timeout: float = 30):
    """`call`, again while the VM's lock is held by something brief (a scheduled reconcile's
    check): a user would retry a "busy" refusal the same way."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except Conflict as err:
            if "is busy" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def run_faults(c: Lab3, image, names: list[str], runs: int) -> list[dict]:
    rows = []
    for name in names:
        strike, struck = FAULTS[name]
        for i in range(runs):
            with Fleet(c.paths) as fleet:
                create(fleet, c.paths, image, struck)
                t0 = time.monotonic()
                error, note = "", None
                try:
                    note = strike(c, fleet)
                except Exception as err:  # the fault's own steps; the verdict still decides
                    error = f"{type(err).__name__}: {err}"
                try:
                    settle(c, list(struck))
                except TimeoutError as err:
                    error = error or str(err)
            vms = [verdict(c, v) for v in struck]
            row = {"fault": name, "run": i + 1, "seconds": round(time.monotonic() - t0, 1),
                   "vms": vms, "error": error, "note": note}
            rows.append(row)
            print(f"{name} #{i + 1}: " + "; ".join(
                f"{v['vm']} {v['outcome']} {v['where'] or 'saved'} memory={v.get('memory_ok')} "
                f"record={v['record_agrees_s']}s" for v in vms) + (f" ({error})" if error else "")
                + (f" [{note}]" if note else ""),
                flush=True)
            with Fleet(c.paths) as fleet:
                for v in struck:
                    if fleet.find(v) or fleet.is_suspended(v):
                        destroy(fleet, v)
                if fleet.host("host1").record.state != "active":  # a reclaim emptied it
                    c.cli("host", "enable", "host1")
    return rows


def soak(c: Lab3, image, moves: int) -> dict:
    ring = ["host1", "host2", "host3"]
    blackouts, failures, checks = [], [], 0
    with Fleet(c.paths) as fleet:
        create(fleet, c.paths, image)
        report = operations.LocalReport(fleet)
        for i in range(1, moves + 1):
            here = fleet.locate(DIRTY).host_name
            target = ring[(ring.index(here) + 1) % 3]
            try:
                result = operations.migrate(fleet, report, DIRTY, target)
                blackouts.append(result["downtime_ms"])
            except VmmgrError as err:
                failures.append(f"move {i}: {err}")
            if i % 50 == 0:
                try:
                    host = fleet.locate(DIRTY).host_name
                    operations.reclaim_host(fleet, report, host)
                    operations.enable_host(fleet, report, host)
                    operations.suspend(fleet, report, DIRTY)
                    operations.resume(fleet, report, DIRTY)
                except VmmgrError as err:
                    failures.append(f"reclaim/suspend at {i}: {err}")
            if i % 10 == 0:
                checks += 1
                if not guest_ok(c, DIRTY):
                    failures.append(f"memory check after move {i} failed")
            if i % 25 == 0:
                print(f"soak: {i} moves, {len(failures)} failures", flush=True)
        destroy(fleet, DIRTY)
        destroy(fleet, COUNT)
    done = sorted(b for b in blackouts if b is not None)
    return {"moves": moves, "failures": failures, "memory_checks": checks,
            "blackout_ms": {"p50": statistics.median(done) if done else None,
                            "p99": done[int(0.99 * (len(done) - 1))] if done else None,
                            "max": done[-1] if done else None}}


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("--runs", type=int, default=5)
    args.add_argument("--moves", type=int, default=500)
    args.add_argument("--only", nargs="*", help="faults to run (default: all; 'none' for none)")
    args.add_argument("--merge", action="store_true",
                      help="keep the other faults' rows (and the soak, unless one runs) from "
                           "the last results: a rerun of some faults")
    opts = args.parse_args()
    names = [n for n in FAULTS if not opts.only or any(o.lower() in n.lower() for o in opts.only)]
    paths = lab_paths()
    lab = Lab(paths, log=lambda m: print(f"  {m}", flush=True))
    started = not lab.running_hosts()
    lab.up(3)
    try:
        c = Lab3(lab, paths)
        image = ensure_builtin(paths.images)
        rows = run_faults(c, image, names, opts.runs)
        soaked = soak(c, image, opts.moves) if opts.moves else None
    finally:
        if started:
            lab.down()
    if opts.merge and (RESULTS / "faults.json").is_file():
        last = json.loads((RESULTS / "faults.json").read_text())
        rows = [r for r in last["faults"] if r["fault"] not in names] + rows
        soaked = soaked or last.get("soak")
    write(rows, soaked, opts.runs)


def write(rows: list[dict], soaked: dict | None, runs: int) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "faults.json").write_text(json.dumps({"faults": rows, "soak": soaked}, indent=2)
                                         + "\n")
    md = ["# Faults on the lab", "",
          "| fault | runs | ok | lost | twice | stopped | memory/console ok | records agree (max) "
          "| time per run |", "|---|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["fault"] for r in rows):
        mine = [r for r in rows if r["fault"] == name]
        vms = [v for r in mine for v in r["vms"]]
        count = lambda o: sum(v["outcome"] == o for v in vms)  # noqa: E731
        agree = [v["record_agrees_s"] for v in vms]
        md.append(f"| {name} | {len(mine)} | {count('ok')}/{len(vms)} | {count('lost')} | "
                  f"{count('twice')} | {count('stopped')} | "
                  f"{sum(v.get('memory_ok', True) for v in vms)}/{len(vms)} | "
                  f"{'never' if None in agree else f'{max(agree)} s'} | "
                  f"{statistics.mean(r['seconds'] for r in mine):.0f} s |")
    notes = [(r["fault"], r["note"]) for r in rows if r.get("note")]
    if notes:
        md += [""] + [f"- {fault}: {note} ({notes.count((fault, note))} of "
                      f"{sum(r['fault'] == fault for r in rows)} runs)"
                      for fault, note in dict.fromkeys(notes)]
    if soaked:
        b = soaked["blackout_ms"]
        md += ["", f"Soak: {soaked['moves']} moves of a dirtier round the lab (a reclaim and a "
               f"suspend/resume every 50): {len(soaked['failures'])} failures, "
               f"{soaked['memory_checks']} memory checks, blackout p50 {b['p50']} ms, p99 "
               f"{b['p99']} ms, max {b['max']} ms."]
        md += [f"- {f}" for f in soaked["failures"][:20]]
    (RESULTS / "faults.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
