"""`vmmgr demo training`: a training run moved 13 times ends with the same losses, bit for bit, as
one that never moved.

Two pairs of VMs from the debian-12 image train the same model data-parallel with
`examples/train.py` (numpy, fixed seeds; the two VMs of a pair exchange gradients every step over
TCP between their stable addresses). One pair stays where it started. The other is moved while it
trains: live migrations across every lab host, and one reclaim of a host when every other host is
full, which suspends a VM to disk; the fleet resumes it by itself as soon as room returns. An SSH
session to a moving VM follows the training log for the whole run, as a notebook user's would.
At the end the per-step losses of both pairs are compared, a table of the moves is printed and a
PNG of both loss curves with the moves marked is written.

The decisions (where the next move goes, how large the fillers that take the room away must be)
are pure functions; `run` carries them out through the operator's requests (`submit`: the CLI
sends them through the task API).
"""

import contextlib
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from . import console, guest_ssh, image_build, os_images, requests
from .addresses import pool_for
from .errors import VmmgrError
from .fleet import Fleet
from .paths import Paths

IMAGE = "debian-12"
MOVING, STILL = ("train-a", "train-b"), ("still-a", "still-b")
MEMORY_MIB = 256  # Debian, cloud-init and numpy fit in it with room to spare
FILLER_SLACK_MIB = 64  # what a filler leaves free: less than a training VM needs
BOOT_TIMEOUT = 900  # four Debian guests booting side by side under TCG
SCRIPT = "train.py"

Submit = Callable[[requests.Request], dict]


@dataclass
class Move:
    vm: str
    kind: str  # "live" or "reclaim"
    source: str
    target: str
    step: int  # the training step the run had reached when the move began
    blackout_ms: int | None = None  # live moves: libvirt's downtime
    suspended_s: float | None = None  # reclaim: from the reclaim's start to running again

    def row(self) -> list:
        if self.kind == "live":
            paused = "post-copy" if self.blackout_ms is None else f"blackout {self.blackout_ms} ms"
        else:
            paused = f"suspended {self.suspended_s:.1f} s"
        return [self.vm, self.kind, self.source, self.target, self.step, paused]


MOVE_HEADERS = ["vm", "kind", "from", "to", "at step", "paused"]


@dataclass
class TrainingReport:
    moves: list[Move] = field(default_factory=list)
    moved_losses: list[str] = field(default_factory=list)
    still_losses: list[str] = field(default_factory=list)
    session_lines: list[str] = field(default_factory=list)
    session_rc: int | None = None
    plot: Path | None = None

    @property
    def identical(self) -> bool:
        return bool(self.moved_losses) and self.moved_losses == self.still_losses

    def first_difference(self) -> str:
        """Where the runs part ways, and the moves made before that step (one of them lost
        something): the error's detail, so that a rare failure can be traced to its move."""
        for moved, still in zip(self.moved_losses, self.still_losses):
            if moved != still:
                words = moved.split()
                step = int(words[0]) if words and words[0].isdigit() else 0
                before = [f"{m.vm} {m.kind} {m.source}->{m.target} at step {m.step}"
                          for m in self.moves if m.step <= step]
                return (f"step {step}: moved {moved!r}, never moved {still!r}; moves before "
                        f"it: {'; '.join(before) or 'none'}")
        if len(self.moved_losses) != len(self.still_losses):
            return f"{len(self.moved_losses)} lines moved, {len(self.still_losses)} never moved"
        return "none"


def next_target(vm: str, where: dict[str, str], free_mib: dict[str, int], memory_mib: int,
                visits: dict[str, int]) -> str | None:
    """The host `vm` moves to next: one with room, the least visited first (so the moves
    cover every host), by name among equals; None when no other host has room."""
    fits = [h for h, free in free_mib.items() if h != where[vm] and free >= memory_mib]
    return min(fits, key=lambda h: (visits.get(h, 0), h), default=None)


def filler_sizes(free_mib: dict[str, int], reclaimed: str, memory_mib: int,
                 slack_mib: int = FILLER_SLACK_MIB) -> dict[str, int]:
    """MiB of idle VM to start on each other host so that none has room for a `memory_mib` VM
    (each keeps `slack_mib` free), which makes a reclaim of `reclaimed` suspend what it holds."""
    assert slack_mib < memory_mib
    return {h: free - slack_mib for h, free in sorted(free_mib.items())
            if h != reclaimed and free >= memory_mib}


def placements(hosts: list[str]) -> dict[str, str]:
    """Where each VM starts: the still pair on the first two hosts, the moving pair on the last
    one, which holds nothing else and so can be reclaimed without touching the still pair."""
    if len(hosts) < 3:
        raise VmmgrError("the training demo needs at least 3 hosts")
    return {STILL[0]: hosts[0], STILL[1]: hosts[1], MOVING[0]: hosts[-1], MOVING[1]: hosts[-1]}


def script_text() -> bytes:
    return resources.files("vmmgr.examples").joinpath(SCRIPT).read_bytes()


class TrainingDemo:
    def __init__(self, paths: Paths, submit: Submit, echo: Callable = print,
                 ssh_prefix: list[str] = (), workdir: Path | None = None,
                 local_disk: bool = False):
        self.paths, self.submit, self.echo = paths, submit, echo
        self.local_disk = local_disk  # each VM's disk on its host's own storage
        self.prefix = list(ssh_prefix)
        self.workdir = workdir  # None: a scratch folder for the run's SSH key, removed after
        self.key = Path()  # set by `run`
        self.report = TrainingReport()
        self._progress = 0  # the last step the SSH session saw
        self._fillers: list[str] = []
        self._reclaimed: list[str] = []  # hosts reclaimed and not yet enabled again
        self._reclaim_done = False

    # -- the run --------------------------------------------------------------------------------

    def run(self, moves: int = 13, steps: int = 600, reclaim_at: int | None = None,
            plot: Path | None = None) -> TrainingReport:
        with Fleet(self.paths) as fleet:
            hosts = sorted(h.name for h in fleet.hosts() if h.record.state == "active")
        start = placements(hosts)
        self._image()
        with contextlib.ExitStack() as scratch:
            folder = self.workdir or Path(scratch.enter_context(
                tempfile.TemporaryDirectory(prefix="vmmgr-training-")))
            self.key = folder / "id_ed25519"
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                            str(self.key)], check=True)
            try:
                self._create(start)
                session = self._launch(steps)
                self._move(moves, hosts[-1], moves // 2 if reclaim_at is None else reclaim_at)
                self._finish(session)
                if plot:
                    self.report.plot = write_plot(self.report, plot)
                return self.report
            finally:
                self._clean_up()

    def _image(self) -> None:
        """Built when missing; a stored one is used as it is (`vmmgr image build` refreshes it)."""
        if IMAGE not in {i.name for i in os_images.list_images(self.paths.images)}:
            self.echo(f"== building the {IMAGE} image (once; cached afterwards)")
            image_build.build(self.paths.images, IMAGE, log=lambda m: self.echo(f"   {m}"))

    def _create(self, start: dict[str, str]) -> None:
        pub = self.key.with_suffix(".pub").read_text()
        for vm, host in start.items():
            with Fleet(self.paths) as fleet:
                if fleet.find(vm):
                    self.submit(requests.destroy(fleet, vm))
                req = requests.create_from_image(fleet, vm, IMAGE, memory_mib=MEMORY_MIB,
                                                 host=host, ssh_keys=(pub,),
                                                 local_disk=self.local_disk)
            self.submit(req)
        where = " (disks on their hosts' own storage)" if self.local_disk else ""
        self.echo(f"== 4 VMs from {IMAGE}{where} booting: moving pair {' + '.join(MOVING)} on "
                  f"{start[MOVING[0]]}, still pair on {start[STILL[0]]} and {start[STILL[1]]}")
        deadline = time.monotonic() + BOOT_TIMEOUT
        with Fleet(self.paths) as fleet:
            for vm in start:
                while b"finished at" not in console.read(fleet.consoles, vm):  # cloud-init done
                    if time.monotonic() > deadline:
                        raise VmmgrError(f"{vm} did not finish booting in {BOOT_TIMEOUT} s")
                    time.sleep(2)
        self.echo("   all four booted; cloud-init put the key and the addresses in place")

    def _address(self, vm: str) -> str:
        return pool_for(self.paths).address_of(vm)

    def ssh(self, vm: str, command: str, stdin: bytes | None = None, timeout: float = 120) -> str:
        proc = guest_ssh.run(self.key, self._address(vm), command, self.prefix, timeout, stdin)
        if proc.returncode != 0:
            raise VmmgrError(f"ssh {vm} {command!r}: exit {proc.returncode}: "
                             f"{proc.stderr.decode(errors='replace').strip()}")
        return proc.stdout.decode(errors="replace")

    def _launch(self, steps: int) -> subprocess.Popen:
        script = script_text()
        for pair in (MOVING, STILL):
            for rank, vm in enumerate(pair):
                peer = self._address(pair[1 - rank])
                self.ssh(vm, f"cat > {SCRIPT}", stdin=script)
                self.ssh(vm, f"nohup python3 {SCRIPT} --rank {rank} --peer {peer} "
                             f"--steps {steps} > train.log 2>&1 < /dev/null & echo $! > train.pid")
        self.echo(f"== training: {steps} steps in each pair; an SSH session follows "
                  f"{MOVING[0]}'s log")
        session = subprocess.Popen(
            guest_ssh.argv(self.key, self._address(MOVING[0]),
                           "tail -n +1 -f --pid=$(cat train.pid) train.log", self.prefix),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True)
        threading.Thread(target=self._follow, args=(session,), daemon=True).start()
        deadline = time.monotonic() + 300
        while self._progress == 0:  # the first progress line: both pairs connected and training
            if session.poll() is not None or time.monotonic() > deadline:
                raise VmmgrError("the training did not start: " +
                                 " | ".join(self.report.session_lines[-5:]))
            time.sleep(0.5)
        return session

    def _follow(self, session: subprocess.Popen) -> None:
        for line in session.stdout:
            line = line.rstrip("\n")
            self.report.session_lines.append(line)
            if line.startswith("step "):
                self._progress = int(line.split()[1].split("/")[0])

    # -- the moves ------------------------------------------------------------------------------

    def _state(self) -> tuple[dict[str, str], dict[str, int]]:
        with Fleet(self.paths) as fleet:
            where = {vm: fleet.locate(vm).host_name for vm in MOVING}
            free = {h: c.free_memory_mib for h, c in fleet.active_capacities().items()}
        return where, free

    def _move(self, count: int, reclaim_host: str, reclaim_at: int) -> None:
        visits: dict[str, int] = {}
        turn = 0
        while len(self.report.moves) < count:
            if self._training_done():
                raise VmmgrError(f"the training ended after {len(self.report.moves)} moves: "
                                 f"give it more steps")
            where, free = self._state()
            if not self._reclaim_done and len(self.report.moves) >= reclaim_at:
                if reclaim_host in where.values():
                    self._reclaim(reclaim_host, where, free)
                    continue
                vm = MOVING[turn % 2]
                target = reclaim_host if free.get(reclaim_host, 0) >= MEMORY_MIB else None
            else:
                vm = MOVING[turn % 2]
                target = next_target(vm, where, free, MEMORY_MIB, visits)
            if target is None:
                raise VmmgrError(f"no host has room for {vm}: {free}")
            turn += 1
            visits[target] = visits.get(target, 0) + 1
            self._live(vm, where[vm], target)
            time.sleep(2)  # let it train a little on its new host

    def _live(self, vm: str, source: str, target: str) -> None:
        step = self._progress
        with Fleet(self.paths) as fleet:
            req = requests.migrate(fleet, vm, target)
        result = self.submit(req)
        move = Move(vm, "live", source, target, step, blackout_ms=result.get("downtime_ms"))
        self.report.moves.append(move)
        self.echo(f"   move {len(self.report.moves):2}: {vm} {source} -> {target} at step "
                  f"{step}: {move.row()[-1]}")

    def _reclaim(self, host: str, where: dict[str, str], free: dict[str, int]) -> None:
        """Every other host filled, `host` reclaimed: what it holds is suspended to disk; then
        the fillers go one by one and the fleet resumes the parked VMs by itself."""
        self.echo(f"== reclaim of {host} with no room anywhere else")
        for h, mib in filler_sizes(free, host, MEMORY_MIB).items():
            name = f"filler-{h}"
            with Fleet(self.paths) as fleet:
                req = requests.create(fleet, name, workload="idle", memory_mib=mib, host=h)
            self.submit(req)
            self._fillers.append(name)
        held = [vm for vm in MOVING if where[vm] == host]
        step, started = self._progress, time.monotonic()
        with Fleet(self.paths) as fleet:
            req = requests.evacuate(fleet, host, deadline=True)
        self._reclaimed.append(host)
        self._reclaim_done = True
        report = self.submit(req)
        if sorted(report["suspended"]) != sorted(held):
            raise VmmgrError(f"the reclaim of {host} was to suspend {held}: {report}")
        self.echo(f"   {', '.join(held)} suspended to disk in {report['seconds']} s; "
                  f"capacity returns")
        parked = set(held)
        while parked:
            self._destroy(self._fillers.pop(0))  # room returns on one host
            resumed = self._wait_resumed(parked)
            for vm, target in resumed.items():
                parked.discard(vm)
                move = Move(vm, "reclaim", host, target, step,
                            suspended_s=round(time.monotonic() - started, 1))
                self.report.moves.append(move)
                self.echo(f"   move {len(self.report.moves):2}: {vm} {host} -> (disk) -> "
                          f"{target} at step {step}: {move.row()[-1]}")
        for name in list(self._fillers):
            self._destroy(name)
        self._enable(host)

    def _wait_resumed(self, parked: set[str], timeout: float = 120) -> dict[str, str]:
        """The parked VMs the fleet resumed (its periodic reconcile does, unasked)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with Fleet(self.paths) as fleet:
                resumed = {vm: g.host_name for vm in parked
                           if (g := fleet.find(vm)) is not None and g.is_active()}
            if resumed:
                return resumed
            time.sleep(0.5)
        raise VmmgrError(f"{', '.join(sorted(parked))} not resumed {timeout:.0f} s after room "
                         f"returned")

    def _destroy(self, vm: str) -> None:
        with Fleet(self.paths) as fleet:
            if not fleet.find(vm) and not fleet.is_suspended(vm):
                return
            req = requests.destroy(fleet, vm)
        self.submit(req)
        if vm in self._fillers:
            self._fillers.remove(vm)

    def _enable(self, host: str) -> None:
        with Fleet(self.paths) as fleet:
            req = requests.enable(fleet, host)
        self.submit(req)
        self._reclaimed.remove(host)

    def _training_done(self) -> bool:
        return any(line.startswith("done:") for line in self.report.session_lines)

    # -- the end --------------------------------------------------------------------------------

    def _finish(self, session: subprocess.Popen) -> None:
        self.echo(f"== {len(self.report.moves)} moves made; waiting for both runs to finish")
        wait = "while kill -0 $(cat train.pid) 2>/dev/null; do sleep 1; done; cat losses.txt"
        self.report.still_losses = self.ssh(STILL[0], wait, timeout=3600).splitlines()
        self.report.moved_losses = self.ssh(MOVING[0], wait, timeout=3600).splitlines()
        self.report.session_rc = session.wait(timeout=120)

    def _clean_up(self) -> None:
        for vm in (*MOVING, *STILL, *self._fillers):
            try:
                self._destroy(vm)
            except VmmgrError as err:
                self.echo(f"   could not destroy {vm}: {err}")
        for host in list(self._reclaimed):
            self._enable(host)


def write_plot(report: TrainingReport, path: Path) -> Path:
    """Both loss curves, the moves marked where the moving run was when each began."""
    import matplotlib
    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt

    def curve(lines):
        pairs = [line.split() for line in lines]
        return [int(s) for s, _ in pairs], [float(v) for _, v in pairs]

    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    steps, losses = curve(report.still_losses)
    ax.plot(steps, losses, color="tab:blue", linewidth=3, alpha=0.5, label="never moved")
    steps, losses = curve(report.moved_losses)
    ax.plot(steps, losses, color="tab:red", linewidth=1, label="moved")
    for i, m in enumerate(report.moves):
        style = {"color": "gray", "linestyle": ":"} if m.kind == "live" else \
                {"color": "tab:orange", "linestyle": "--"}
        ax.axvline(m.step, linewidth=0.8, label=None if i else "a move", **style)
    if any(m.kind == "reclaim" for m in report.moves):
        ax.plot([], [], color="tab:orange", linestyle="--", label="reclaim: suspended to disk")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean squared error)")
    verdict = "bit-identical" if report.identical else "DIFFERENT"
    ax.set_title(f"{len(report.moves)} moves while training: losses {verdict}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
