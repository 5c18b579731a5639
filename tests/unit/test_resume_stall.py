"""A post-copy resume whose libvirt call hangs (seen in CI: the call never returned and held the
VM's lock for the rest of the run) is given up after RESUME_STALL_S without data moving."""

import threading
import time
from contextlib import nullcontext
from types import SimpleNamespace

import libvirt

from vmmgr import migration, policy as pol
from vmmgr.errors import MigrationFailed


class HungGuest:
    """A source whose resume call blocks until its post-copy is paused again."""
    name, host_name = "vm1", "host1"

    def __init__(self, moving: bool = False, wedged: bool = False):
        self.released = threading.Event()
        self.wedged = wedged  # not even a pause returns the call
        self.paused = 0
        self.moving = moving  # data moves: the resume is slow, not hung
        self.remaining = 1000

    def migrate_to(self, uri, params, flags, via=None):
        if not self.released.wait(30):
            raise AssertionError("never released")
        if self.paused:
            raise libvirt.libvirtError("operation aborted: post-copy paused")

    def job_stats(self, completed=False):
        if not self.moving:
            return {"type": libvirt.VIR_DOMAIN_JOB_NONE}
        self.remaining = max(self.remaining - 1, 0)
        return {"type": 2, "data_total": 1000, "data_remaining": self.remaining}

    def pause_postcopy(self):
        self.paused += 1
        if not self.wedged:
            self.released.set()


def _migration(guest):
    dest = SimpleNamespace(uri="qemu+tls://host2/system", record=SimpleNamespace(tls=True),
                           connection_apart=nullcontext)
    fleet = SimpleNamespace(host=lambda name: dest)
    lease = SimpleNamespace(lost=False)
    return migration._Migration(fleet, guest, "host2", pol.get_policy("never-fail", 0), None,
                                0.01, lease)


RESUME = libvirt.VIR_MIGRATE_POSTCOPY_RESUME


def test_a_resume_that_moves_nothing_is_given_up_and_paused_again(monkeypatch):
    monkeypatch.setattr(migration, "RESUME_STALL_S", 0.3)
    guest = HungGuest()
    t0 = time.monotonic()
    error = _migration(guest)._call_and_monitor({}, RESUME, pol.Watch(started=t0, postcopy=True))
    assert isinstance(error, libvirt.libvirtError)  # the call's own answer to the pause
    assert guest.paused == 1
    assert time.monotonic() - t0 < 5


def test_a_call_not_even_a_pause_returns_is_left_behind(monkeypatch):
    monkeypatch.setattr(migration, "RESUME_STALL_S", 0.3)
    guest = HungGuest(wedged=True)
    t0 = time.monotonic()
    error = _migration(guest)._call_and_monitor({}, RESUME, pol.Watch(started=t0, postcopy=True))
    assert isinstance(error, MigrationFailed) and "moved no data" in str(error)
    assert guest.paused == 1 and time.monotonic() - t0 < 20
    guest.released.set()


def test_a_resume_moving_data_is_left_to_finish(monkeypatch):
    monkeypatch.setattr(migration, "RESUME_STALL_S", 0.3)
    guest = HungGuest(moving=True)
    threading.Timer(1.0, guest.released.set).start()  # it ends by itself, after the bound
    error = _migration(guest)._call_and_monitor({}, RESUME, pol.Watch(started=time.monotonic(),
                                                                      postcopy=True))
    assert error is None and guest.paused == 0


def test_a_first_migration_is_never_cut_by_the_resume_bound(monkeypatch):
    monkeypatch.setattr(migration, "RESUME_STALL_S", 0.1)
    guest = HungGuest()
    threading.Timer(0.6, guest.released.set).start()
    error = _migration(guest)._call_and_monitor({}, 0, pol.Watch(started=time.monotonic()))
    assert error is None and guest.paused == 0
