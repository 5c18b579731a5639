"""One lock per VM, in the fleet's store (Redis), held for the whole of every operation that
changes the VM: the same lock whichever node, process or task runs it.

A lock is a lease: taken in an owner's name (a task's id, or a one-off id for a command run in
this process), kept alive by a thread, given back at the end; if its process dies the lease
expires. A second operation on the same VM is refused at once and told what holds it, unless
what holds it is one of the reconcile's brief checks (`HOUSEKEEPING`): that is waited for, up to
`HOUSEKEEPING_WAIT`, as a request must not be refused for housekeeping it cannot see. The same
owner may take it again: a task takes over the lock its submitter took in its name (or that a
dead earlier run of it left), and gives it back at the end. Inside one process a lease the same
owner already holds there nests (an operation's body under its task's run): only the outermost
lease gives it back.

A lease can be lost: Redis out of reach for longer than the lease lasts, after which someone else
may hold it. The holder must then stop changing the VM: `check()` raises, and the migration
monitor aborts a pre-copy it is steering.
"""

import threading
import time

import redis

from .errors import Conflict

LEASE_TTL = 30  # s a dead holder keeps a lock; renewed every third of it
WAIT_POLL = 0.05
# How the reconcile names a brief check it makes under a VM's lock (a record, a stray disk, a
# save's copy, a console part, the edge's hold): never an operation on the VM; asked of the hosts
# without the lock first where it can, so usually over in well under a second.
HOUSEKEEPING = "the reconcile's "
HOUSEKEEPING_WAIT = 15.0  # s a request waits for such a check before it is refused as busy

_held: dict[tuple[str, str, str], int] = {}  # (kind, name, owner) -> leases held in this process
_held_lock = threading.Lock()


class LockLost(Conflict):
    """The operation's lock expired or passed to another owner: it stopped acting."""


def acquire(state, kind: str, name: str, owner: str, what: str, ttl: int,
            wait: float = 0, patient: bool | None = None) -> None:
    """Take the lock for `owner`, waiting up to `wait` s for whatever holds it, and (if
    `patient`) up to `HOUSEKEEPING_WAIT` for one of the reconcile's brief checks; else
    Conflict, saying what holds it. Patient unless said otherwise or `what` is itself one of
    those checks: the reconcile skips a VM someone holds, and comes back at its next pass."""
    if patient is None:
        patient = not what.startswith(HOUSEKEEPING)
    start = time.monotonic()
    while True:
        try:
            return state.acquire(kind, name, owner, what, ttl)
        except Conflict:
            waited = time.monotonic() - start
            holder = state.holder(kind, name)
            brief = holder is None or holder.partition(" ")[2].startswith(HOUSEKEEPING)
            if waited >= wait and not (patient and brief and waited < HOUSEKEEPING_WAIT):
                raise
            time.sleep(WAIT_POLL)


class Lease:
    def __init__(self, state, kind: str, name: str, owner: str, what: str,
                 ttl: int = LEASE_TTL, wait: float = 0, patient: bool | None = None):
        # `owner` is one word: the store keeps "owner what", and readers split at the space.
        self.state, self.kind, self.name = state, kind, name
        self.owner, self.what, self.ttl, self.wait = owner, what, ttl, wait
        self.patient = patient
        self.nested = False
        self.lost = False
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                      name=f"lease-{kind}-{name}")

    def __enter__(self) -> "Lease":
        key = (self.kind, self.name, self.owner)
        with _held_lock:
            if _held.get(key):
                self.nested = True
                _held[key] += 1
        if self.nested:
            self._beat.start()  # to notice a loss; the outer lease keeps it
            return self
        acquire(self.state, self.kind, self.name, self.owner, self.what, self.ttl, self.wait,
                self.patient)
        with _held_lock:
            _held[key] = _held.get(key, 0) + 1
        self._beat.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._beat.join()
        key = (self.kind, self.name, self.owner)
        with _held_lock:
            _held[key] -= 1
            if not _held[key]:
                del _held[key]
        if not self.nested:
            try:
                self.state.release(self.kind, self.name, self.owner)
            except redis.RedisError:
                pass  # it expires by itself

    def check(self) -> None:
        """Raise if the lock is no longer ours: whatever comes next must not happen."""
        if self.lost:
            raise LockLost(f"{self.kind} {self.name!r}: the lock of {self.what} was lost "
                           "(the store was out of reach longer than the lease); stopped")

    def confirm(self) -> None:
        """`check`, asked of the store now rather than at the heartbeat's next beat: before a
        step that must not happen twice, once the store was out of reach (a lock that expired
        meanwhile may be another's already)."""
        if not self.lost and not self.state.refresh(self.kind, self.name, self.owner, self.ttl):
            self.lost = True
        self.check()

    def _heartbeat(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.ttl / 3):
            try:
                if self.state.refresh(self.kind, self.name, self.owner, self.ttl):
                    last_ok = time.monotonic()
                else:
                    self.lost = True  # expired, or someone else holds it now
            except redis.RedisError:
                if time.monotonic() - last_ok > self.ttl:
                    self.lost = True
            if self.lost:
                return
