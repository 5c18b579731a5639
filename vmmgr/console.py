"""A VM's serial console, followed across hosts and sites.

Each host a VM runs on writes the console to a segment of its own, `<vm>@<seq>-<host>.log` in the
consoles folder of that host's storage (its site's; every host sees it at the same path). A
migration points the destination's QEMU at the next segment, so the source writes its last byte
before the destination writes its first (the guest is paused in between) and the concatenation
of segments in order is the whole output, with no gap and no duplicate. A segment is never
written by two QEMUs.

Where the segments are read from is a `Consoles`: `LocalConsoles` for a folder this process
sees; `site_consoles.FleetConsoles` for a fleet whose sites keep their storage apart (segments
numbered in the fleet's store, read through the hosts' libvirt). `read`, `hosts_seen` and
`follow` work on either.
"""

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
SEGMENT_RE = re.compile(rf"^({_NAME})@(\d{{6}})-({_NAME})\.log$")  # '@' is in no name
CHUNK = 1 << 16  # read at a time: the guest decides how large its log grows


@dataclass(frozen=True, order=True)
class Segment:
    seq: int
    vm: str
    host: str  # the host whose QEMU writes it

    @property
    def name(self) -> str:
        return f"{self.vm}@{self.seq:06d}-{self.host}.log"


def parse(name: str) -> Segment | None:
    m = SEGMENT_RE.match(name)
    return Segment(int(m.group(2)), m.group(1), m.group(3)) if m else None


class Consoles(Protocol):
    def segments(self, vm: str) -> list[Segment]:
        """The VM's segments in order (an empty or missing one too: a move that was aborted)."""

    def size(self, segment: Segment) -> int:
        """Bytes written so far (0 for a segment no QEMU has opened)."""

    def read(self, segment: Segment, offset: int, limit: int = CHUNK) -> bytes:
        """Up to `limit` bytes from `offset` (b"" at its end, or when it does not exist)."""


@dataclass
class LocalConsoles:
    """Consoles in a folder this process sees: the one storage of a single site, as the tests
    and a control node that mounts it see it."""
    folder: Path

    def path(self, segment: Segment) -> Path:
        return self.folder / segment.name

    def segments(self, vm: str) -> list[Segment]:
        try:
            names = [p.name for p in self.folder.iterdir() if p.name.startswith(vm + "@")]
        except FileNotFoundError:
            return []
        return sorted(s for s in map(parse, names) if s is not None and s.vm == vm)

    def size(self, segment: Segment) -> int:
        try:
            return self.path(segment).stat().st_size
        except FileNotFoundError:
            return 0

    def read(self, segment: Segment, offset: int, limit: int = CHUNK) -> bytes:
        try:
            with self.path(segment).open("rb") as f:
                f.seek(offset)
                return f.read(limit)
        except FileNotFoundError:
            return b""

    def next_segment(self, vm: str, host: str) -> Path:
        """A fresh segment numbered after every existing one (even empty ones left by an aborted
        migration), so no segment is ever appended to by a second QEMU."""
        existing = self.segments(vm)
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.path(Segment(existing[-1].seq + 1 if existing else 1, vm, host))

    def remove(self, vm: str) -> None:
        for segment in self.segments(vm):
            self.path(segment).unlink(missing_ok=True)


def read(consoles: Consoles, vm: str) -> bytes:
    """The whole output, in memory: for what is known to be short (a test, host keys)."""
    out = []
    for segment in consoles.segments(vm):
        offset = 0
        while chunk := consoles.read(segment, offset):
            out.append(chunk)
            offset += len(chunk)
    return b"".join(out)


def hosts_seen(consoles: Consoles, vm: str) -> list[str]:
    """The hosts whose segments hold output, in order."""
    return [s.host for s in consoles.segments(vm) if consoles.size(s)]


def follow(consoles: Consoles, vm: str, poll: float = 0.2, stop=lambda: False,
           tail: int | None = None) -> Iterator[bytes]:
    """Yield the console's bytes as they are written, across segments, until `stop()` is true;
    with `tail`, only the last `tail` bytes written so far, then what follows. Never more than
    CHUNK bytes in memory at once, however large the log.

    A later segment is switched to only once it holds data: by then the guest has resumed on the
    next host, so the current segment has had its last byte and is read to its end first.
    """
    current = consoles.segments(vm)
    index, offset = _tail_start(consoles, current, tail) if tail is not None else (0, 0)
    while True:
        if index < len(current):
            chunk = consoles.read(current[index], offset)
            if chunk:
                offset += len(chunk)
                yield chunk
                continue
            later = [s for s in current[index + 1:] if consoles.size(s)]
            if later:
                # Bytes written to the current segment after the read above came before the
                # next host's first byte: read them before switching.
                while rest := consoles.read(current[index], offset):
                    offset += len(rest)
                    yield rest
                index, offset = current.index(later[0]), 0
                continue
        if stop():
            return
        time.sleep(poll)
        current = consoles.segments(vm)


def _tail_start(consoles: Consoles, segments: list[Segment], tail: int) -> tuple[int, int]:
    """(segment index, offset) where the last `tail` bytes of the segments begin."""
    for index in range(len(segments) - 1, -1, -1):
        size = consoles.size(segments[index])
        if size >= tail:
            return index, size - tail
        tail -= size
    return 0, 0
