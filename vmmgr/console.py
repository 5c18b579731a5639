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

from .errors import HostUnreachable

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
    """Where a fleet's console segments are. `size` and `chunks` raise `HostUnreachable` when
    the segment cannot be read now (no host of its site answers): that is not an empty segment."""

    def segments(self, vm: str) -> list[Segment]:
        """The VM's segments in order (an empty or missing one too: a move that was aborted)."""

    def size(self, segment: Segment, fresh: bool = False) -> int:
        """Bytes written so far (0 for a segment no QEMU has opened; `fresh`: looked at now,
        not as remembered)."""

    def chunks(self, segment: Segment, offset: int = 0, limit: int = 0) -> Iterator[bytes]:
        """Its bytes from `offset` to its end as it is now (at most `limit`, if given), CHUNK
        at a time; none when it does not exist."""


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

    def size(self, segment: Segment, fresh: bool = False) -> int:
        try:
            return self.path(segment).stat().st_size
        except FileNotFoundError:
            return 0

    def chunks(self, segment: Segment, offset: int = 0, limit: int = 0) -> Iterator[bytes]:
        try:
            f = self.path(segment).open("rb")
        except FileNotFoundError:
            return
        with f:
            f.seek(offset)
            left = limit or -1
            while left and (data := f.read(CHUNK if left < 0 else min(CHUNK, left))):
                left -= len(data) if left > 0 else 0
                yield data

    def next_segment(self, vm: str, host: str) -> Path:
        """A fresh segment numbered after every existing one (even empty ones left by an aborted
        migration), so no segment is ever appended to by a second QEMU."""
        existing = self.segments(vm)
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.path(Segment(existing[-1].seq + 1 if existing else 1, vm, host))

    def remove(self, vm: str) -> None:
        for segment in self.segments(vm):
            self.path(segment).unlink(missing_ok=True)


def read(consoles: Consoles, vm: str, unread: list[Segment] | None = None) -> bytes:
    """The whole output, in memory: for what is known to be short (a test, host keys). A
    segment that cannot be read now is left out and added to `unread` (if given; else the error
    goes up)."""
    out = []
    for segment in consoles.segments(vm):
        try:
            out += list(consoles.chunks(segment))
        except HostUnreachable:
            if unread is None:
                raise
            unread.append(segment)
    return b"".join(out)


def hosts_seen(consoles: Consoles, vm: str) -> list[str]:
    """The hosts whose segments hold output, in order (one whose site does not answer: not
    known to)."""
    return [s.host for s in consoles.segments(vm) if _size_or_zero(consoles, s)]


def follow(consoles: Consoles, vm: str, poll: float = 0.2, stop=lambda: False,
           tail: int | None = None) -> Iterator[bytes]:
    """Yield the console's bytes as they are written, across segments, until `stop()` is true;
    with `tail`, only the last `tail` bytes written so far, then what follows. Never more than
    a chunk (or a `Consoles`'s window) in memory at once, however large the log.

    A later segment is switched to only once it holds data: by then the guest has resumed on the
    next host, so the current segment has had its last byte and is read to its end first. A
    segment that cannot be read now (no host of its site answers) is waited for, never skipped,
    even when it may be empty (a move to that site that broke off). Segments are followed by
    number: one forgotten meanwhile (the VM destroyed) is left for the first after it.
    """
    segments = consoles.segments(vm)
    index, offset = _tail_start(consoles, segments, tail) if tail is not None else (0, 0)
    current = segments[index] if index < len(segments) else None
    while True:
        if current is not None:
            try:
                read_any = moved_on = False
                for chunk in consoles.chunks(current, offset):
                    offset += len(chunk)
                    read_any = True
                    yield chunk
                if not read_any and (later := _next_with_data(consoles, segments, current)):
                    # Bytes written to the current segment after the read above came before
                    # the next host's first byte: read them before switching.
                    for rest in consoles.chunks(current, offset):
                        offset += len(rest)
                        yield rest
                    current, offset, moved_on = later, 0, True
                if read_any or moved_on:
                    continue
            except HostUnreachable:
                pass  # its site does not answer: asked again after the poll
        if stop():
            return
        time.sleep(poll)
        segments = consoles.segments(vm)
        if current not in segments:  # none yet, or forgotten (the VM destroyed)
            after = current.seq if current is not None else 0
            current = next((s for s in segments if s.seq > after), None)
            offset = 0


def _next_with_data(consoles: Consoles, segments: list[Segment], current: Segment
                    ) -> Segment | None:
    """The first segment after `current` that holds data, unless one before it cannot be read
    now (HostUnreachable). Sizes remembered are looked at again before the answer is given:
    one remembered empty may have filled meanwhile."""
    after = [s for s in segments if s.seq > current.seq]
    if next((s for s in after if consoles.size(s)), None) is None:
        return None
    return next((s for s in after if consoles.size(s, fresh=True)), None)


def _size_or_zero(consoles: Consoles, segment: Segment) -> int:
    try:
        return consoles.size(segment)
    except HostUnreachable:
        return 0


def _tail_start(consoles: Consoles, segments: list[Segment], tail: int) -> tuple[int, int]:
    """(segment index, offset) where the last `tail` bytes of the segments begin."""
    for index in range(len(segments) - 1, -1, -1):
        size = _size_or_zero(consoles, segments[index])
        if size >= tail:
            return index, size - tail
        tail -= size
    return 0, 0
