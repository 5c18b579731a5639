"""Telling a guest that came back from its hibernation image from one that booted afresh (before:
a resume whose image did not restore was reported as resumed, its lost memory unsaid)."""

import threading

from vmmgr import suspend
from vmmgr.console import LocalConsoles
from vmmgr.errors import HostUnreachable


class Guest:
    def __init__(self, connected=False, raises=False):
        self.connected, self.raises = connected, raises

    def agent_connected(self):
        if self.raises:
            raise HostUnreachable("host2 does not answer")
        return self.connected


def test_the_fresh_boot_line_first_means_the_memory_was_lost(tmp_path):
    segment = tmp_path / "vm@000002-host2.log"
    segment.write_text("vmmgr: fresh boot\r\ntick 0\r\n")
    assert suspend.came_back(LocalConsoles(tmp_path), segment, Guest(connected=True), 5, poll=0.01) is False


def test_the_workload_going_on_first_means_restored(tmp_path):
    segment = tmp_path / "vm@000002-host2.log"
    segment.write_text("tick 41\ntick 42\n")
    assert suspend.came_back(LocalConsoles(tmp_path), segment, Guest(), 5, poll=0.01) is True


def test_a_half_written_line_decides_nothing_until_it_ends(tmp_path):
    segment = tmp_path / "vm@000002-host2.log"
    segment.write_text("vmmgr: fresh bo")
    threading.Timer(0.2, lambda: segment.write_text("vmmgr: fresh boot\n")).start()
    assert suspend.came_back(LocalConsoles(tmp_path), segment, Guest(), 5, poll=0.01) is False


def test_a_quiet_guest_whose_agent_is_back_was_restored(tmp_path, monkeypatch):
    monkeypatch.setattr(suspend, "AGENT_GRACE_S", 0.05)
    segment = tmp_path / "vm@000002-host2.log"  # not even created: the guest printed nothing yet
    assert suspend.came_back(LocalConsoles(tmp_path), segment, Guest(connected=True), 5, poll=0.01) is True


def test_silence_and_no_agent_tell_nothing(tmp_path):
    segment = tmp_path / "vm@000002-host2.log"
    segment.write_text("")
    assert suspend.came_back(LocalConsoles(tmp_path), segment, Guest(raises=True), 0.1, poll=0.01) is None


def test_a_site_that_does_not_answer_is_asked_again(tmp_path):
    class Silent(LocalConsoles):
        calls = 0

        def chunks(self, segment, offset=0, limit=0):
            Silent.calls += 1
            if Silent.calls < 3:
                raise HostUnreachable("no host that sees host2's storage answers")
            return super().chunks(segment, offset, limit)

    segment = tmp_path / "vm@000002-host2.log"
    segment.write_text("tick 41\n")
    assert suspend.came_back(Silent(tmp_path), segment, Guest(), 5, poll=0.01) is True
    assert Silent.calls == 3
