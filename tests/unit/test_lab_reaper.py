"""The lab host's reaper adopts what its child daemonizes and reaps it at once, as systemd does
for a real host's QEMUs (this machine's init reaps late: libvirt waited 1.8 s per stopped VM)."""

import subprocess
import sys
import time
from pathlib import Path


def _ppid(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    return int(next(l.split()[1] for l in status.splitlines() if l.startswith("PPid:")))


def test_a_daemonized_grandchild_is_adopted_and_reaped_at_once():
    # The child daemonizes a `sleep` (its parent exits at once), as libvirtd does each QEMU.
    reaper = subprocess.Popen(
        [sys.executable, "-m", "vmmgr.lab_reaper", "sh", "-c", 'sh -c "sleep 0.5 & echo \\$!"'],
        stdout=subprocess.PIPE, text=True)
    orphan = int(reaper.stdout.readline())
    time.sleep(0.2)  # its parent has exited by now
    assert _ppid(orphan) == reaper.pid
    assert reaper.wait(5) == 0  # it lived on for its adopted descendant, then ended
    assert _ppid(orphan) is None  # reaped: no zombie left behind


def test_a_command_that_cannot_run_is_said_on_stderr():
    proc = subprocess.run([sys.executable, "-m", "vmmgr.lab_reaper", "/nonexistent/libvirtd"],
                          capture_output=True, text=True, timeout=10)
    assert "lab_reaper: /nonexistent/libvirtd: " in proc.stderr
    assert "No such file" in proc.stderr
