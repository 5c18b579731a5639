import contextlib
import threading
import time
from pathlib import Path

import libvirt
import pytest

from vmmgr import console, site_consoles
from vmmgr.console import LocalConsoles, Segment
from vmmgr.errors import HostUnreachable, VmmgrError


def write(path, text):
    with path.open("ab") as f:
        f.write(text.encode())


@contextlib.contextmanager
def following(consoles):
    """A follower of vm's console in a thread for the block: what it has yielded so far."""
    got, done = [], threading.Event()
    t = threading.Thread(target=lambda: got.extend(
        console.follow(consoles, "vm", poll=0.01, stop=done.is_set)))
    t.start()
    try:
        yield got
    finally:
        done.set()
        t.join(2)


def test_segments_are_numbered_in_order_and_joined(tmp_path):
    consoles = LocalConsoles(tmp_path)
    first = consoles.next_segment("vm", "host1")
    assert first.name == "vm@000001-host1.log"
    write(first, "tick 0\ntick 1\n")
    paths = [first]
    for i in range(2, 13):  # past 9 and 10: order must be numeric
        seg = consoles.next_segment("vm", f"host{i}")
        write(seg, f"tick {i}\n")
        paths.append(seg)
    write(consoles.next_segment("vm.2", "host1"), "another VM's\n")  # a name with a dot
    assert [consoles.path(s) for s in consoles.segments("vm")] == paths
    assert console.read(consoles, "vm").decode().splitlines()[:3] == ["tick 0", "tick 1", "tick 2"]
    assert console.hosts_seen(consoles, "vm")[:2] == ["host1", "host2"]
    assert console.read(consoles, "vm.2") == b"another VM's\n"


def test_a_segment_name_says_its_vm_number_and_host(tmp_path):
    assert console.parse("web.1@000012-host-3.example.log") == Segment(12, "web.1", "host-3.example")
    assert console.parse("000001-host1.log") is None  # no VM: not a segment
    assert console.parse("vm@1-host1.log") is None


def test_a_large_segment_is_read_whole_in_chunks(tmp_path):
    consoles = LocalConsoles(tmp_path)
    data = bytes(range(256)) * (3 * console.CHUNK // 256 + 7)
    consoles.next_segment("vm", "h").write_bytes(data)
    assert console.read(consoles, "vm") == data


def test_an_empty_segment_from_an_aborted_move_is_skipped_and_never_reused(tmp_path):
    consoles = LocalConsoles(tmp_path)
    write(consoles.next_segment("vm", "host1"), "a\n")
    aborted = consoles.next_segment("vm", "host2")
    aborted.touch()
    after = consoles.next_segment("vm", "host3")
    assert after.name.startswith("vm@000003-")
    write(after, "b\n")
    assert console.hosts_seen(consoles, "vm") == ["host1", "host3"]
    assert console.read(consoles, "vm") == b"a\nb\n"


def test_unknown_vm_has_no_output(tmp_path):
    assert console.read(LocalConsoles(tmp_path), "nobody") == b""
    assert LocalConsoles(tmp_path / "none").segments("nobody") == []


def test_follow_switches_hosts_without_losing_the_sources_last_bytes(tmp_path):
    consoles = LocalConsoles(tmp_path)
    seg1 = consoles.next_segment("vm", "host1")
    write(seg1, "tick 0\n")
    with following(consoles) as got:
        time.sleep(0.05)
        write(seg1, "tick 1\n")  # the source's last tick ...
        seg2 = consoles.next_segment("vm", "host2")
        write(seg2, "tick 2\n")  # ... then the destination's first
        time.sleep(0.05)
        write(seg2, "tick 3\n")
        time.sleep(0.05)
    assert b"".join(got) == b"tick 0\ntick 1\ntick 2\ntick 3\n"


def test_follow_with_a_tail_starts_that_many_bytes_before_the_end(tmp_path):
    consoles = LocalConsoles(tmp_path)
    write(consoles.next_segment("vm", "host1"), "tick 0\ntick 1\n")
    write(consoles.next_segment("vm", "host2"), "tick 2\n")
    got = b"".join(console.follow(consoles, "vm", poll=0.01, stop=lambda: True, tail=10))
    assert got == b" 1\ntick 2\n"


def test_remove_forgets_the_vm_only(tmp_path):
    consoles = LocalConsoles(tmp_path)
    write(consoles.next_segment("vm", "host1"), "x")
    write(consoles.next_segment("vm2", "host1"), "y")
    consoles.remove("vm")
    assert consoles.segments("vm") == []
    assert console.read(consoles, "vm2") == b"y"
    assert consoles.next_segment("vm", "h").name == "vm@000001-h.log"


class Stream:
    def __init__(self):
        self.data, self.finished = b"", False

    def recv(self, n):
        out, self.data = self.data[:n], self.data[n:]
        return out

    def finish(self):
        self.finished = True

    def abort(self):
        pass


class Vol:
    def __init__(self, data: bytes):
        self.data, self.downloads = data, []

    def connect(self):
        return type("C", (), {"newStream": lambda self, flags: Stream()})()

    def download(self, stream, offset, length, flags):
        self.downloads.append((offset, length))
        stream.data = self.data[offset:offset + length] if length else self.data[offset:]

    def infoFlags(self, flags):
        assert flags == libvirt.VIR_STORAGE_VOL_GET_PHYSICAL
        return [0, 1 << 40, len(self.data)]  # a capacity the file's header may claim

    def info(self):
        return [0, 1 << 40, len(self.data)]

    def delete(self, flags):
        self.deleted = True


class Pool:
    def __init__(self, files):
        self.files, self.refreshes = files, 0

    def isActive(self):
        return True

    def refresh(self, flags):
        self.refreshes += 1

    def storageVolLookupByName(self, name):
        if name not in self.files:
            err = libvirt.libvirtError("no storage vol")
            err.get_error_code = lambda: libvirt.VIR_ERR_NO_STORAGE_VOL
            raise err
        return self.files[name]


class Site:
    """What `site_consoles` asks of a fleet: its hosts' sites, which of them answer, and each
    host's consoles pool (the files of its site's storage)."""

    def __init__(self, sites, storage, silent=()):
        self._sites, self.silent = sites, set(silent)
        self.pools = {h: Pool(storage[s]) for h, s in sites.items()}
        self.paths = type("P", (), {"consoles": "/storage/consoles"})()

    def sites(self):
        return self._sites

    def host(self, name):
        if name in self.silent:
            raise HostUnreachable(f"{name} does not answer")
        pool = self.pools[name]
        return type("H", (), {"conn": type("C", (), {
            "storagePoolLookupByName": lambda self, n: pool})()})()


def test_a_segment_is_read_through_its_writer_or_another_host_of_its_site():
    fleet = Site({"a1": "east", "a2": "east", "b1": "west"},
                 {"east": {"vm@000001-a1.log": Vol(b"x" * 10)}, "west": {}})
    assert site_consoles.readers(fleet, "a1") == ["a1", "a2"]
    assert site_consoles.readers(fleet, "b1") == ["b1"]  # never through another site's host
    first = Segment(1, "vm", "a1")
    fleet.silent = {"a1"}
    assert site_consoles.FleetConsoles(fleet).size(first) == 10  # its file's, not the header's
    fleet.silent = {"a1", "a2"}
    with pytest.raises(HostUnreachable, match="no host that sees a1's storage answers"):
        site_consoles.FleetConsoles(fleet).size(first)


def test_a_segment_is_read_a_window_at_a_time(monkeypatch):
    """libvirt's client queues what a download sends however slowly it is read: each download
    asks for a window, not the rest of the file."""
    data = bytes(range(256)) * 1000
    vol = Vol(data)
    fleet = Site({"a1": ""}, {"": {"vm@000001-a1.log": vol}})
    consoles = site_consoles.FleetConsoles(fleet)
    monkeypatch.setattr(consoles, "WINDOW", 100_000)
    first = Segment(1, "vm", "a1")
    assert b"".join(consoles.chunks(first)) == data
    assert vol.downloads == [(0, 100_000), (100_000, 100_000), (200_000, 100_000)]
    assert b"".join(consoles.chunks(first, 255_990, limit=5)) == data[255_990:255_995]
    assert b"".join(consoles.chunks(first, len(data))) == b""


class Broken(Vol):
    """A volume handle kept from a connection that broke since (its libvirtd restarted)."""

    def connect(self):
        def new_stream(_, flags):
            raise libvirt.libvirtError("internal error: client socket is closed")
        return type("C", (), {"newStream": new_stream})()


def test_a_kept_handle_whose_connection_broke_is_looked_up_again():
    fleet = Site({"a1": ""}, {"": {"vm@000001-a1.log": Vol(b"first")}})
    consoles, first = site_consoles.FleetConsoles(fleet), Segment(1, "vm", "a1")
    assert b"".join(consoles.chunks(first)) == b"first"
    consoles._vols[first.name] = Broken(b"")  # its host's libvirtd restarted meanwhile
    fleet.pools["a1"].files[first.name] = Vol(b"first, then more")
    assert b"".join(consoles.chunks(first)) == b"first, then more"
    fleet.pools["a1"].files[first.name] = Broken(b"")  # broken on a fresh lookup too: said,
    consoles._vols[first.name] = Broken(b"")  # after one lookup, not looked up again and again
    with pytest.raises(VmmgrError, match="client socket is closed"):
        b"".join(consoles.chunks(first))
    assert first.name not in consoles._vols


class BreaksMidway(Vol):
    """Its connection breaks once part of a window has come."""

    def connect(self):
        vol = self

        class Partial(Stream):
            def recv(self, n):
                if vol.sent:
                    raise libvirt.libvirtError("End of file while reading data")
                vol.sent = True
                return self.data[:4]
        vol.sent = False
        return type("C", (), {"newStream": lambda _, flags: Partial()})()


def test_a_read_broken_after_some_bytes_is_not_begun_again():
    """Its bytes went to the reader: reading the window again would repeat them."""
    fleet = Site({"a1": ""}, {"": {"vm@000001-a1.log": Vol(b"0123456789")}})
    consoles, first = site_consoles.FleetConsoles(fleet), Segment(1, "vm", "a1")
    consoles._vols[first.name] = BreaksMidway(b"0123456789")
    got = []
    with pytest.raises(VmmgrError, match="End of file"):
        for data in consoles.chunks(first):
            got.append(data)
    assert got == [b"0123"]


class Forgetting:
    def __init__(self):
        self.forgotten, self.pending = [], []

    def forget_console_segments(self, vm, seqs):
        self.forgotten += [(vm, s) for s in seqs]

    def console_drop_pending(self, vm, seq):
        self.pending.append((vm, seq))


def test_a_failed_moves_segment_goes_only_when_it_surely_holds_nothing():
    """What a move that failed before its guest ran there made on the target: an empty file is
    removed and its number forgotten; output, or a site that cannot tell, stays."""
    empty, written = Vol(b""), Vol(b"booting")
    fleet = Site({"a1": "east", "b1": "west"},
                 {"east": {"vm@000002-a1.log": empty, "vm@000003-a1.log": written},
                  "west": {}})
    fleet.state = Forgetting()
    drop = site_consoles.drop_if_empty
    drop(fleet, "vm", Path("/storage/consoles/vm@000002-a1.log"))
    assert getattr(empty, "deleted", False) and fleet.state.forgotten == [("vm", 2)]
    drop(fleet, "vm", Path("/storage/consoles/vm@000003-a1.log"))
    assert not getattr(written, "deleted", False) and ("vm", 3) not in fleet.state.forgotten
    drop(fleet, "vm", Path("/storage/consoles/vm@000004-b1.log"))  # its QEMU never made it
    assert ("vm", 4) in fleet.state.forgotten
    fleet.silent = {"b1"}
    drop(fleet, "vm", Path("/storage/consoles/vm@000005-b1.log"))  # no one to ask: kept
    drop(fleet, "other", Path("/storage/consoles/vm@000006-b1.log"))  # not this VM's
    assert fleet.state.forgotten == [("vm", 2), ("vm", 4)]
    assert fleet.state.pending == [("vm", 5)]  # for the reconcile, once its site answers


def test_the_reconcile_gives_back_a_failed_moves_segment_once_its_site_answers(redis_url,
                                                                               mocker):
    from vmmgr.locks import Lease
    from vmmgr.state import FleetState
    empty, live, written = Vol(b""), Vol(b""), Vol(b"booting")
    fleet = Site({"a1": "east", "b1": "west"},
                 {"east": {"vm@000001-a1.log": live},
                  "west": {"vm@000002-b1.log": empty, "vm@000003-b1.log": written}},
                 silent={"b1"})
    fleet.paths.consoles = Path("/storage/consoles")
    fleet.state = state = FleetState(redis_url)
    locks = []  # the VMs whose lock the reconcile asked for
    fleet.lock_vm = lambda vm, what: locks.append(vm) or Lease(state, "vm", vm, "reconcile",
                                                               what)
    serial = "<domain><devices><serial type='file'><source path='/x/{}'/></serial></devices></domain>"
    running = mocker.Mock(**{"is_persistent.return_value": True})  # writes 1; next boot: 4
    running.xml.side_effect = lambda inactive=False: serial.format(
        "vm@000004-a1.log" if inactive else "vm@000001-a1.log")

    def find_all(vm, strict, among):  # the VM runs on a1; a silent host may hold it too
        if strict and set(among) & fleet.silent:
            raise HostUnreachable("silent")
        return [running] if "a1" in among else []
    fleet.find_all = find_all
    fleet.pools["a1"].files["vm@000004-a1.log"] = next_boot = Vol(b"")
    for seq, host in ((1, "a1"), (2, "b1"), (3, "b1"), (4, "a1")):
        state.add_console_segment("vm", seq, host)
    for seq in (2, 3):
        site_consoles.drop_if_empty(fleet, "vm", Path(f"/c/vm@{seq:06d}-b1.log"))
    assert state.console_drops() == [("vm", 2), ("vm", 3)]  # west is silent
    state.console_drop_pending("vm", 1)  # segments the VM writes (marked by a defect)
    state.console_drop_pending("vm", 4)
    state.console_drop_pending("gone", 7)  # destroyed since: its number is no more
    report = mocker.Mock()
    with Lease(state, "vm", "vm", "migration-task", "migration of vm"):  # held: not now
        assert site_consoles.retry_drops(fleet, report) == []
    assert ("vm", 2) in state.console_drops() and ("gone", 7) not in state.console_drops()
    del locks[:]
    assert site_consoles.retry_drops(fleet, report) == []  # west still silent: nothing decided
    assert locks == ["vm", "vm"]  # 1 and 4 decided (kept); west's parts never took the lock
    assert state.console_drops() == [("vm", 2), ("vm", 3)]
    fleet.silent = {"a1"}  # another site's silence holds nothing: its QEMU cannot write there
    assert site_consoles.retry_drops(fleet, report) == ["vm@000002-b1.log"]
    assert getattr(empty, "deleted", False) and not getattr(written, "deleted", False)
    assert not getattr(live, "deleted", False)  # the VM writes there
    assert not getattr(next_boot, "deleted", False)  # and will, once booted again
    assert state.console_segments("vm") == [(1, "a1"), (3, "b1"), (4, "a1")]
    assert state.console_drops() == []
    report.event.assert_called_once()


def test_a_missing_segment_is_not_looked_for_again_at_once():
    """A move aborted before its QEMU made the file: a follower must not rescan the folder at
    every poll."""
    fleet = Site({"a1": ""}, {"": {}})
    consoles = site_consoles.FleetConsoles(fleet)
    aborted = Segment(2, "vm", "a1")
    assert consoles.size(aborted) == 0 and consoles.size(aborted) == 0
    assert fleet.pools["a1"].refreshes == 1
    fleet.pools["a1"].files[aborted.name] = Vol(b"late")  # its QEMU made it after all
    assert consoles.size(aborted) == 0  # as remembered ...
    assert consoles.size(aborted, fresh=True) == 4  # ... until looked at again


def test_a_fleet_of_one_site_reads_any_segment_through_any_host():
    fleet = Site({"h1": "", "h2": "", "h3": ""}, {"": {}}, silent={"h1"})
    assert site_consoles.readers(fleet, "h1") == ["h1", "h2", "h3"]
    assert site_consoles.readers(fleet, "gone") == ["h1", "h2", "h3"]  # a host that left


class Unreachable(LocalConsoles):
    """Local consoles whose host2 segments cannot be read until `back` is set."""
    back = False

    def size(self, segment, fresh=False):
        self._check(segment)
        return super().size(segment)

    def chunks(self, segment, offset=0, limit=0):
        self._check(segment)
        return super().chunks(segment, offset, limit)

    def _check(self, segment):
        if segment.host == "host2" and not self.back:
            raise HostUnreachable("no host that sees host2's storage answers")


def test_a_whole_read_leaves_out_what_cannot_be_read_and_says_so(tmp_path):
    consoles = Unreachable(tmp_path)
    write(consoles.next_segment("vm", "host1"), "a\n")
    write(consoles.next_segment("vm", "host2"), "b\n")
    write(consoles.next_segment("vm", "host3"), "c\n")
    unread = []
    assert console.read(consoles, "vm", unread) == b"a\nc\n"
    assert unread == [Segment(2, "vm", "host2")]
    assert console.hosts_seen(consoles, "vm") == ["host1", "host3"]
    with pytest.raises(HostUnreachable):
        console.read(consoles, "vm")


def test_follow_waits_for_a_segment_it_cannot_read_and_never_skips_it(tmp_path):
    consoles = Unreachable(tmp_path)
    write(consoles.next_segment("vm", "host1"), "a\n")
    write(consoles.next_segment("vm", "host2"), "b\n")
    write(consoles.next_segment("vm", "host3"), "c\n")
    with following(consoles) as got:
        time.sleep(0.1)
        assert b"".join(got) == b"a\n"  # host2's part first: host3's waits for it
        consoles.back = True
        time.sleep(0.1)
    assert b"".join(got) == b"a\nb\nc\n"


class Remembering(LocalConsoles):
    """Local consoles that remember a segment found empty until asked `fresh`, as
    FleetConsoles remembers a missing file for a second."""

    def __init__(self, folder):
        super().__init__(folder)
        self.empty = set()

    def size(self, segment, fresh=False):
        if segment in self.empty and not fresh:
            return 0
        size = super().size(segment)
        if not size:
            self.empty.add(segment)
        else:
            self.empty.discard(segment)
        return size


def test_follow_never_skips_a_segment_remembered_empty_that_filled(tmp_path):
    consoles = Remembering(tmp_path)
    write(consoles.next_segment("vm", "host1"), "a\n")
    second = consoles.next_segment("vm", "host2")
    consoles.size(console.parse(second.name))  # looked at before its QEMU wrote: remembered empty
    write(second, "b\n")
    write(consoles.next_segment("vm", "host3"), "c\n")  # two quick moves
    got = b"".join(console.follow(consoles, "vm", poll=0.01, stop=lambda: True))
    assert got == b"a\nb\nc\n"


def test_follow_goes_on_after_a_segment_forgotten_under_it(tmp_path):
    """The VM destroyed and made again under its name while followed: its old segments are
    forgotten, and the follower goes on with the first after the one it read."""
    consoles = LocalConsoles(tmp_path)
    write(consoles.next_segment("vm", "host1"), "old\n")
    with following(consoles) as got:
        time.sleep(0.05)
        consoles.path(Segment(1, "vm", "host1")).unlink()
        write(consoles.path(Segment(2, "vm", "host2")), "new\n")
        time.sleep(0.1)
    assert b"".join(got) == b"old\nnew\n"
