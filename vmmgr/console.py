"""A VM's serial console, followed across hosts.

Each host a VM runs on writes the console to its own segment file on shared storage:
`<consoles>/<vm>/<seq>-<host>.log`. A migration points the destination's QEMU at the next segment,
so the source writes its last byte before the destination writes its first (the guest is paused in
between) and the concatenation of segments in order is the whole output, with no gap and no
duplicate. A segment is never written by two QEMUs.
"""

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

SEGMENT_RE = re.compile(r"^(\d{6})-([A-Za-z0-9][A-Za-z0-9_.-]*)\.log$")


def vm_dir(consoles: Path, vm: str) -> Path:
    return consoles / vm


def segments(consoles: Path, vm: str) -> list[Path]:
    folder = vm_dir(consoles, vm)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if SEGMENT_RE.match(p.name)]
    return sorted(found, key=lambda p: int(SEGMENT_RE.match(p.name).group(1)))


def next_segment(consoles: Path, vm: str, host: str) -> Path:
    """A fresh segment for `vm` on `host`, numbered after every existing one (even empty ones
    left by an aborted migration), so no segment is ever appended to by a second QEMU."""
    existing = segments(consoles, vm)
    seq = int(SEGMENT_RE.match(existing[-1].name).group(1)) + 1 if existing else 1
    folder = vm_dir(consoles, vm)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{seq:06d}-{host}.log"


def current_segment(consoles: Path, vm: str, host: str) -> Path:
    """The newest segment `host` writes for `vm` (a migration resumed after a break goes on with
    the destination's QEMU, which already writes there); a fresh one if it has none."""
    mine = [p for p in segments(consoles, vm) if segment_host(p) == host]
    return mine[-1] if mine else next_segment(consoles, vm, host)


def segment_host(segment: Path) -> str:
    """The host that wrote a segment."""
    return SEGMENT_RE.match(segment.name).group(2)


def hosts_seen(consoles: Path, vm: str) -> list[str]:
    """The hosts whose segments hold output, in order."""
    return [
        SEGMENT_RE.match(p.name).group(2) for p in segments(consoles, vm) if p.stat().st_size
    ]


def read(consoles: Path, vm: str) -> bytes:
    return b"".join(p.read_bytes() for p in segments(consoles, vm))


CHUNK = 1 << 16  # read at a time: the guest decides how large its log grows


def follow(
    consoles: Path, vm: str, poll: float = 0.2, stop=lambda: False, tail: int | None = None
) -> Iterator[bytes]:
    """Yield the console's bytes as they are written, across segments, until `stop()` is true;
    with `tail`, only the last `tail` bytes written so far, then what follows. Never more than
    CHUNK bytes in memory at once, however large the log.

    A later segment is switched to only once it holds data: by then the guest has resumed on the
    next host, so the current segment has had its last byte and is read to its end first.
    """
    index, offset = _tail_start(segments(consoles, vm), tail) if tail is not None else (0, 0)
    while True:
        current = segments(consoles, vm)
        if index < len(current):
            chunk = _read_from(current[index], offset)
            if chunk:
                offset += len(chunk)
                yield chunk
                continue
            later = [p for p in current[index + 1:] if p.stat().st_size]
            if later:
                # Bytes written to the current segment after the read above came before the
                # next host's first byte: read them before switching.
                tail = _read_from(current[index], offset)
                if tail:
                    yield tail
                index, offset = current.index(later[0]), 0
                continue
        if stop():
            return
        time.sleep(poll)


def _tail_start(paths: list[Path], tail: int) -> tuple[int, int]:
    """(segment index, offset) where the last `tail` bytes of the segments begin."""
    for index in range(len(paths) - 1, -1, -1):
        size = _size(paths[index])
        if size >= tail:
            return index, size - tail
        tail -= size
    return 0, 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _read_from(path: Path, offset: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(CHUNK)
    except FileNotFoundError:
        return b""


def remove(consoles: Path, vm: str) -> None:
    shutil.rmtree(vm_dir(consoles, vm), ignore_errors=True)
