"""One operation per VM at a time.

An advisory `flock` per VM on the control node: held for the whole operation, released by the
kernel if the process dies, so a crashed CLI never leaves a VM locked. A second operation on the
same VM is refused at once (never queued) and told what holds the lock.
"""

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

from .errors import Conflict


@contextmanager
def vm_operation(locks_dir: Path, vm: str, operation: str):
    locks_dir.mkdir(parents=True, exist_ok=True)
    path = locks_dir / f"{vm}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another operation"
            raise Conflict(f"VM {vm!r} is busy: {holder} is in progress") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{operation} (pid {os.getpid()})".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
