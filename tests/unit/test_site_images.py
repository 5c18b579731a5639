"""A base image sent to a site that lacks it: what a copy leaves on the target's storage when it
works, when the target cannot take it, when it arrives damaged, and when an earlier copy was cut
short; and the move that needs it (sends it, then lays the disk; or refuses clearly). The hosts'
storage is a fake libvirt (folders of files behind pools, volumes and streams); the lab test
sends a real image between real libvirtds."""

import hashlib
import json
import time
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import libvirt
import pytest
import redis

from vmmgr import local_disks, policy as pol, reconcile, site_images
from vmmgr.display import progress_line
from vmmgr.errors import Conflict, MigrationFailed, NotFound, VmmgrError
from vmmgr.migration import JobProgress, MigrationCancelled, _Migration
from vmmgr.state import FleetState

BASE = "/srv/images/os/debian-12/disk.qcow2"
FOLDER = "/srv/images/os/debian-12"
DISK = b"qcow2 image bytes " * 5000
RECORD = {"name": "debian-12", "sha256": hashlib.sha256(DISK).hexdigest()}


def _err(code: int, text: str = "libvirt says no") -> libvirt.libvirtError:
    err = libvirt.libvirtError(text)
    err.get_error_code = lambda: code
    return err


class Storage:
    """One host's file system as its libvirtd sees it: folder -> {file: bytes}."""

    def __init__(self, folders=None, room: int = 1 << 40):
        self.folders = {k: dict(v) for k, v in (folders or {}).items()}
        self.room, self.pools = room, {}

    def newStream(self, flags):
        return Stream(self)

    def storagePoolLookupByName(self, name):
        if name not in self.pools:
            raise _err(libvirt.VIR_ERR_NO_STORAGE_POOL)
        return self.pools[name]

    def storagePoolDefineXML(self, xml, flags):
        root = ET.fromstring(xml)
        pool = Pool(self, root.findtext("name"), root.findtext("./target/path"))
        self.pools[pool.name] = pool
        return pool

    def used(self) -> int:
        return sum(len(b) for files in self.folders.values() for b in files.values())


class Pool:
    def __init__(self, host, name, path):
        self.host, self.name, self.path, self.active = host, name, path, False

    def create(self, flags):
        if self.path not in self.host.folders:
            raise _err(libvirt.VIR_ERR_INTERNAL_ERROR, f"cannot open directory '{self.path}'")
        self.active = True

    def build(self, flags):
        self.host.folders.setdefault(self.path, {})

    def isActive(self):
        return self.active

    def destroy(self):
        self.active = False

    def delete(self, flags):
        assert not self.active
        if self.host.folders[self.path]:  # rmdir
            raise _err(libvirt.VIR_ERR_OPERATION_FAILED, "Directory not empty")
        del self.host.folders[self.path]

    def undefine(self):
        del self.host.pools[self.name]

    def storageVolLookupByName(self, name):
        if name not in self.host.folders[self.path]:
            raise _err(libvirt.VIR_ERR_NO_STORAGE_VOL)
        return Volume(self, name)

    def createXML(self, xml, flags):
        name = ET.fromstring(xml).findtext("name")
        self.host.folders[self.path][name] = b""
        return Volume(self, name)


class Volume:
    def __init__(self, pool, name):
        self.pool, self.name = pool, name

    @property
    def files(self):
        return self.pool.host.folders[self.pool.path]

    def XMLDesc(self, flags):
        return f"<volume><physical>{len(self.files[self.name])}</physical></volume>"

    def download(self, stream, offset, length, flags):
        stream.reading = self.files[self.name]

    def upload(self, stream, offset, length, flags):
        stream.writing = self

    def delete(self, flags):
        del self.files[self.name]


class Stream:
    def __init__(self, host):
        self.host, self.reading, self.writing = host, None, None

    def recv(self, n):
        data, self.reading = self.reading[:n], self.reading[n:]
        return data

    def send(self, data):
        if self.host.used() + len(data) > self.host.room:
            raise _err(libvirt.VIR_ERR_INTERNAL_ERROR, "No space left on device")
        self.writing.files[self.writing.name] += data
        return len(data)

    def finish(self):
        pass

    def abort(self):
        pass


def _source(sha: str | None = None) -> Storage:
    meta = json.dumps({"name": "debian-12", "sha256": sha or hashlib.sha256(DISK).hexdigest()})
    return Storage({FOLDER: {"disk.qcow2": DISK, "image.json": meta.encode()}})


def test_a_site_that_lacks_the_image_receives_it_whole_and_checked():
    source, target = _source(), Storage({"/srv/images": {}})
    assert not site_images.held(target, BASE)
    seen = []
    size, sha = site_images.send(source, target, BASE, lambda done, total: seen.append(done))
    assert (size, sha) == (len(DISK), hashlib.sha256(DISK).hexdigest())
    assert target.folders[FOLDER] == source.folders[FOLDER]  # the record beside it, as is
    assert seen[-1] == len(DISK) and seen == sorted(seen)
    assert site_images.held(target, BASE)
    assert not target.pools and not source.pools  # the pools lived for the copy only


def test_a_target_without_room_is_left_as_it_was():
    source, target = _source(), Storage({"/srv/images": {}}, room=len(DISK) // 2)
    with pytest.raises(VmmgrError, match="No space left"):
        site_images.send(source, target, BASE)
    assert target.folders == {"/srv/images": {}}  # not even the folder the copy made
    assert not target.pools


def test_what_does_not_match_the_record_is_not_kept():
    source, target = _source(sha="0" * 64), Storage()
    with pytest.raises(VmmgrError, match="does not match its record"):
        site_images.send(source, target, BASE)
    assert FOLDER not in target.folders and not site_images.held(target, BASE)


def test_a_copy_cut_short_is_made_again_from_the_start():
    source = _source()
    target = Storage({FOLDER: {"disk.qcow2": DISK[:100]}})  # its record never written
    target.storagePoolDefineXML(site_images.pool_xml("vmmgr-image-debian-12", FOLDER), 0)
    assert not site_images.held(target, BASE)  # a disk without its record is not whole
    site_images.send(source, target, BASE)
    assert target.folders[FOLDER]["disk.qcow2"] == DISK and site_images.held(target, BASE)
    # an existing folder the copy did not make stays when a later copy fails
    target.folders[FOLDER] = {}
    target.room = 10
    with pytest.raises(VmmgrError):
        site_images.send(source, target, BASE)
    assert target.folders[FOLDER] == {}


def test_only_an_images_disk_is_sent_and_names_are_escaped():
    assert site_images.image_name(BASE) == "debian-12"
    for bad in ("/srv/images/os/debian-12/image.json", "/var/lib/libvirt/vm1.qcow2",
                "/srv/disks/debian-12/disk.qcow2"):
        with pytest.raises(VmmgrError, match="not the disk of an OS image"):
            site_images.image_name(bad)
    root = ET.fromstring(site_images.pool_xml("p<1>", "/a&b"))
    assert (root.findtext("name"), root.findtext("./target/path")) == ("p<1>", "/a&b")
    vol = ET.fromstring(site_images.volume_xml("disk.qcow2", 42))
    assert vol.findtext("capacity") == "42" and vol.findtext("./target/permissions/mode") == "0644"


def test_the_progress_line_names_the_base_phase():
    p = JobProgress(elapsed_ms=1000, processed_bytes=200 * 2**20, remaining_bytes=600 * 2**20,
                    total_bytes=800 * 2**20, speed_bps=0, dirty_rate_bps=0, iteration=0,
                    phase="base", disk_processed_bytes=200 * 2**20, disk_total_bytes=800 * 2**20)
    assert "base image 200/800 MiB" in progress_line(p) and p.fraction == 0.25


def _move(mocker, lay_errors):
    fleet, guest = mocker.MagicMock(), mocker.Mock(host_name="h1")
    fleet.sites.return_value = {}  # each host its own storage
    guest.name = "vm1"
    move = _Migration(fleet, guest, "h3", pol.get_policy("balanced"), None, 0.1,
                      mocker.Mock(lost=False))
    fleet.state.cancel_asked.return_value = False
    overlay = mocker.patch("vmmgr.local_disks.overlay_of", return_value=(2**30, BASE))
    lay = mocker.patch("vmmgr.local_disks.create_overlay", side_effect=lay_errors)
    mocker.patch("vmmgr.local_disks.copy_seed")
    mocker.patch("vmmgr.local_disks.has_pool_seed", return_value=True)
    assert overlay  # patched for the move
    return move, lay


def test_a_move_sends_the_seed_after_the_disk_and_takes_the_disk_back_if_it_cannot(mocker):
    move, lay = _move(mocker, ["/p", "/p"])
    source, dest = mocker.Mock(), mocker.Mock()
    move.fleet.host.side_effect = lambda h: source if h == "h1" else dest
    move.dest = dest
    mocker.patch("vmmgr.site_images.record", return_value=RECORD)  # the base on both
    done = []
    lay.side_effect = lambda *a: done.append("disk") or "/p"
    local_disks.copy_seed.side_effect = lambda *a: done.append(("seed", *a))
    move._lay_target_disk()
    assert done == ["disk", ("seed", source.conn, dest.conn, "vm1")]  # from h1 to h3, after
    # a VM whose seed is on its site's storage (made before): nothing more is sent
    local_disks.has_pool_seed.return_value = False
    done.clear()
    move._lay_target_disk()
    assert done == ["disk"]
    local_disks.has_pool_seed.return_value = True
    local_disks.copy_seed.side_effect = VmmgrError("link cut")
    remove = mocker.patch("vmmgr.local_disks.remove")
    with pytest.raises(MigrationFailed, match=r"h3 could not receive its seed \(.*link cut\); "
                       "the VM is still running on h1"):
        move._lay_target_disk()
    remove.assert_called_once_with(dest.conn, "vm1")


def test_a_move_sends_the_base_then_lays_the_disk(mocker):
    move, lay = _move(mocker, ["/p"])
    mocker.patch("vmmgr.site_images.record", side_effect=[None, RECORD])  # target, source
    send = mocker.patch("vmmgr.site_images.send", return_value=(800 * 2**20, "ab" * 32))
    move._lay_target_disk()
    assert send.call_count == 1 and lay.call_count == 1
    assert any("base image debian-12 sent to h3: 800 MiB" in e for e in move.events)
    # one copy per image and storage at a time, in a lock of its own (not the task's)
    [lock] = [c.args for c in move.fleet.state.acquire.call_args_list
              if c.args[:2] == ("image-copy", "debian-12@host h3")]
    assert lock[2].startswith(f"{move.fleet.owner}/")
    move.fleet.state.image_copy_started.assert_called_once_with("debian-12", "h3", BASE)
    move.fleet.state.image_copy_ended.assert_called_once_with("debian-12", "h3")


def test_a_move_to_a_site_that_cannot_receive_the_base_is_refused(mocker):
    move, lay = _move(mocker, [])
    mocker.patch("vmmgr.site_images.record", side_effect=[None, RECORD])
    mocker.patch("vmmgr.site_images.send", side_effect=VmmgrError("No space left on device"))
    with pytest.raises(MigrationFailed, match="h3 lacks the base image .* could not receive it "
                       r"\(.*No space left on device\); the VM is still running on h1"):
        move._lay_target_disk()
    lay.assert_not_called()
    move.fleet.state.image_copy_ended.assert_not_called()  # the sweep makes sure of what is left


def test_a_base_that_is_no_images_disk_is_never_sent(mocker):
    move, lay = _move(mocker, ["/p"])
    mocker.patch("vmmgr.local_disks.overlay_of", return_value=(2**30, "/srv/other/base.qcow2"))
    held = mocker.patch("vmmgr.site_images.record")
    move._lay_target_disk()
    held.assert_not_called()
    lay.assert_called_once()


def test_a_base_already_there_is_not_sent_and_a_refusal_to_lay_says_why(mocker):
    move, lay = _move(mocker, [VmmgrError("permission denied")])
    mocker.patch("vmmgr.site_images.record", return_value=RECORD)  # the same on both
    send = mocker.patch("vmmgr.site_images.send")
    with pytest.raises(MigrationFailed, match="h3 cannot lay the local disk over its base image"):
        move._lay_target_disk()
    send.assert_not_called()


def test_a_cancel_asked_while_the_base_is_sent_ends_the_move_before_its_disk(mocker):
    move, lay = _move(mocker, [])
    mocker.patch("vmmgr.site_images.record", side_effect=[None, RECORD])
    move.on_progress = mocker.Mock()

    def send(source, target, base, progress, check):
        progress(2**20, 800 * 2**20)
        move.fleet.state.cancel_asked.return_value = True  # `vmmgr migrate cancel` now
        progress(800 * 2**20, 800 * 2**20)
        raise AssertionError("the copy went on after the cancel")

    mocker.patch("vmmgr.site_images.send", side_effect=send)
    with pytest.raises(MigrationCancelled, match="cancelled while h3 received its base image; "
                       "the VM is still running on h1"):
        move._lay_target_disk()
    lay.assert_not_called()  # the disk was never laid over it
    move.fleet.state.cancel_asked.assert_called_with("vm1", move.lease.owner)  # this move's
    assert move.on_progress.call_args_list[0].args[0].phase == "base"


def test_cancel_before_the_job_is_said_done_only_once_the_move_took_it(mocker, redis_url):
    import threading

    from vmmgr import migration
    mocker.patch.object(migration, "CANCEL_WAIT", 1.0)
    fleet = mocker.Mock()
    fleet.state = state = FleetState(redis_url)
    source = mocker.Mock(host_name="h1")
    source.postcopy_phase.return_value = None
    source.has_job.return_value = False
    fleet.find_all.return_value = [source]
    state.acquire("vm", "vm1", "task-1", "migration of vm1 to h3", ttl=30)
    took = []

    def the_move():  # sending its base image: it asks at each MiB
        while not took:
            if state.cancel_asked("vm1", "task-1"):
                took.append(True)
            time.sleep(0.02)

    mover = threading.Thread(target=the_move)
    mover.start()
    assert migration.cancel(fleet, "vm1") == "h1"
    mover.join(2)
    assert took and not state.cancel_pending("vm1")
    # a move that ends without taking it (or never looks): refused, and nothing left asked
    with pytest.raises(Conflict, match="no migration in progress"):
        migration.cancel(fleet, "vm1")
    assert not state.cancel_pending("vm1")
    assert not state.cancel_asked("vm1", "task-2")  # another owner's ask is not this one's
    state.ask_cancel("vm1", "task-1")
    assert not state.cancel_asked("vm1", "task-2") and state.cancel_asked("vm1", "task-1")
    state.release("vm", "vm1", "task-1")
    for holder in ("suspend of vm1", None):
        if holder:
            state.acquire("vm", "vm1", "task-3", holder, ttl=30)
        with pytest.raises(Conflict, match="no migration in progress"):
            migration.cancel(fleet, "vm1")
        assert not state.cancel_pending("vm1")
        state.release("vm", "vm1", "task-3")


class CopyFleet:
    """What copies use of a fleet: the store (real Redis, its locks), the hosts and sites."""

    def __init__(self, redis_url, hosts, sites=None):
        self.state, self.owner, self._hosts = FleetState(redis_url), "reconcile-test", hosts
        self._sites = sites or {}

    def sites(self):
        return dict(self._sites)

    def host(self, name):
        if name not in self._hosts:
            raise NotFound(f"unknown host {name!r}")
        return SimpleNamespace(conn=self._hosts[name])


class Report:
    def __init__(self):
        self.events = []

    def event(self, message, **kw):
        self.events.append(message)


def test_a_copy_cut_short_is_swept_once_no_one_holds_it(redis_url):
    whole = _source()
    cut = Storage({FOLDER: {"disk.qcow2": DISK[:100]}})  # its worker killed mid-copy
    fleet, report = CopyFleet(redis_url, {"h1": whole, "h3": cut}), Report()
    for host in ("h1", "h3", "gone"):
        fleet.state.image_copy_started("debian-12", host, BASE)
    fleet.state.acquire("image-copy", "debian-12@host h3", "task-9", "copy of image", ttl=30)
    assert reconcile.sweep_image_copies(fleet, report) == []  # h3's copy still runs
    assert set(fleet.state.image_copies()) == {"debian-12@h3"}
    assert whole.folders[FOLDER]["disk.qcow2"] == DISK  # an image with its record stays
    fleet.state.release("image-copy", "debian-12@host h3", "task-9")
    assert reconcile.sweep_image_copies(fleet, report) == ["debian-12@h3"]
    assert cut.folders[FOLDER] == {} and not cut.pools
    assert report.events == ["a copy of image debian-12 cut short removed from h3"]
    assert fleet.state.image_copies() == {}


def test_a_host_that_does_not_answer_keeps_its_copy_for_the_next_pass(redis_url, mocker):
    cut = Storage({FOLDER: {"disk.qcow2": DISK[:100]}})
    mocker.patch.object(cut, "storagePoolDefineXML",
                        side_effect=_err(libvirt.VIR_ERR_SYSTEM_ERROR, "connection closed"))
    fleet = CopyFleet(redis_url, {"h3": cut})
    fleet.state.image_copy_started("debian-12", "h3", BASE)
    assert reconcile.sweep_image_copies(fleet, Report()) == []
    assert set(fleet.state.image_copies()) == {"debian-12@h3"}
    assert cut.folders[FOLDER]["disk.qcow2"] == DISK[:100]


def test_ensure_sends_from_the_first_source_that_holds_the_image_once(redis_url):
    partial = Storage({FOLDER: {"disk.qcow2": DISK[:100]}})  # a copy cut short: no record
    holder, target = _source(), Storage()
    fleet = CopyFleet(redis_url, {"h1": partial, "h2": holder, "h3": target})
    said = []
    assert site_images.ensure(fleet, "h3", BASE, ["gone", "h1", "h3", "h2"], say=said.append) == (
        len(DISK), hashlib.sha256(DISK).hexdigest())
    assert said == ["h3's storage lacks the base image debian-12: sending it from h2"]
    assert target.folders[FOLDER] == holder.folders[FOLDER]
    assert fleet.state.image_copies() == {} and not fleet.state.holder("image-copy",
                                                                       "debian-12@host h3")
    assert site_images.ensure(fleet, "h3", BASE, ["h2"]) is None  # there now: not again
    with pytest.raises(VmmgrError, match="no host that answers holds the image debian-12"):
        site_images.ensure(fleet, "h1", BASE, ["h1", "gone"])
    assert site_images.ensure(fleet, "h1", "/srv/other.qcow2", ["h2"]) is None  # no image's


def test_a_copy_that_fails_stays_known_for_the_sweep(redis_url):
    fleet = CopyFleet(redis_url, {"h2": _source(), "h3": Storage(room=10)})
    with pytest.raises(VmmgrError, match="No space left"):
        site_images.ensure(fleet, "h3", BASE, ["h2"])
    assert set(fleet.state.image_copies()) == {"debian-12@h3"}  # its remains, if any: swept
    assert reconcile.sweep_image_copies(fleet, Report()) == []  # none: the copy took them
    assert fleet.state.image_copies() == {}


def test_a_resume_sends_the_base_before_it_loads_the_kept_disk(tmp_path, mocker):
    import struct

    from vmmgr import suspend
    d = tmp_path / "vm1"
    d.mkdir()
    header = b"QFI\xfb" + struct.pack(">IQI", 3, 72, len(BASE))
    (d / "disk.qcow2").write_bytes(header.ljust(72, b"\0") + BASE.encode())
    (d / "disk.json").write_text(json.dumps({"sha256": "ab" * 32}))
    fleet = mocker.Mock()
    fleet.hosts.return_value = [SimpleNamespace(name=n) for n in ("h4", "h1", "h2", "h3")]
    target = SimpleNamespace(name="h3", conn="h3-conn")
    ensure = mocker.patch.object(site_images, "ensure")
    load = mocker.patch("vmmgr.local_disks.load_from")
    assert suspend.load_local_disk(fleet, d, target, "h1")
    ensure.assert_called_once_with(fleet, "h3", BASE, ["h1", "h2", "h3", "h4"])  # its own first
    load.assert_called_once_with("h3-conn", "vm1", d / "disk.qcow2", "ab" * 32)
    load.reset_mock()
    ensure.side_effect = VmmgrError("No space left on device")
    with pytest.raises(VmmgrError, match="vm1 not resumed on h3: its storage lacks the base "
                       "image .* could not receive it .*; vm1 stays suspended"):
        suspend.load_local_disk(fleet, d, target, "h1")
    load.assert_not_called()


def test_two_moves_of_one_task_never_share_the_folders_lock(redis_url):
    fleet = CopyFleet(redis_url, {}, sites={"h1": "east", "h2": "east", "h3": "west"})
    with site_images._lock(fleet, "debian-12", "h1", "copy", 0):
        for host in ("h1", "h2"):  # the same owner (one task), the same storage (one site)
            with pytest.raises(Conflict):
                with site_images._lock(fleet, "debian-12", host, "copy", 0):
                    pass
        with site_images._lock(fleet, "debian-12", "h3", "copy", 0):
            pass  # another site's storage: its own lock
    assert site_images.storage_of(fleet, "h2") == "site east"
    assert site_images.storage_of(fleet, "h9") == "host h9"  # no site named: its own


def test_a_whole_image_is_never_taken_away_and_a_silent_host_is_not_one_that_lacks_it(
        redis_url, mocker):
    source, target = _source(), _source()
    target.folders[FOLDER]["disk.qcow2"] = b"what the site's VMs were laid on"
    assert site_images.send(source, target, BASE) == (len(DISK), hashlib.sha256(DISK).hexdigest())
    assert target.folders[FOLDER]["disk.qcow2"] == b"what the site's VMs were laid on"
    mocker.patch.object(target, "storagePoolDefineXML",
                        side_effect=_err(libvirt.VIR_ERR_SYSTEM_ERROR, "connection closed"))
    with pytest.raises(VmmgrError, match="connection closed"):
        site_images.held(target, BASE)
    fleet = CopyFleet(redis_url, {"h2": _source(), "h3": target})
    with pytest.raises(VmmgrError, match="connection closed"):
        site_images.ensure(fleet, "h3", BASE, ["h2"])  # refused, nothing sent or removed
    assert fleet.state.image_copies() == {}
    assert site_images.holds(fleet, "h3", BASE) is None  # the planner: cannot be told


def test_a_source_on_the_targets_own_storage_is_no_source(redis_url):
    other = b"another build" * 10  # were h1 read (it is not: it is h3's own storage)
    h1 = Storage({FOLDER: {"disk.qcow2": other, "image.json": json.dumps(
        {"sha256": hashlib.sha256(other).hexdigest()}).encode()}})
    fleet = CopyFleet(redis_url, {"h1": h1, "h2": _source(), "h3": Storage()},
                      sites={"h1": "west", "h2": "east", "h3": "west"})
    site_images.ensure(fleet, "h3", BASE, ["h1", "h2"])
    assert fleet._hosts["h3"].folders[FOLDER]["disk.qcow2"] == DISK


def test_a_copy_whose_lock_is_lost_writes_and_removes_nothing_more(mocker):
    from vmmgr import local_disks
    from vmmgr.locks import LockLost
    mocker.patch.object(local_disks, "CHUNK", 10_000)  # the disk in 9 chunks
    source, target = _source(), Storage()
    calls = []

    def check():  # the store out of reach longer than the lease, after the first MiB
        calls.append(1)
        if len(calls) > 2:
            raise LockLost("the lock of copy of image debian-12 was lost")

    with pytest.raises(LockLost):
        site_images.send(source, target, BASE, None, check)
    # another copy may own the folder now: what is there is left to it, or to the sweep
    assert "image.json" not in target.folders[FOLDER]
    assert 0 < len(target.folders[FOLDER]["disk.qcow2"]) < len(DISK)


def test_a_site_holding_another_build_under_the_name_is_refused(redis_url):
    other = b"a rebuild elsewhere" * 10
    target = Storage({FOLDER: {"disk.qcow2": other, "image.json": json.dumps(
        {"sha256": hashlib.sha256(other).hexdigest()}).encode()}})
    fleet = CopyFleet(redis_url, {"h2": _source(), "h3": target})
    with pytest.raises(VmmgrError, match="h3's storage holds another image debian-12 .* than "
                       "h2's .*: not used"):
        site_images.ensure(fleet, "h3", BASE, ["h2"])
    assert target.folders[FOLDER]["disk.qcow2"] == other  # left as it is, never laid on
    assert site_images.ensure(fleet, "h3", BASE, ["gone"]) is None  # none to compare: it stands


def test_readers_wait_for_each_other_but_not_for_a_copy(redis_url, mocker):
    import threading

    fleet = CopyFleet(redis_url, {})
    fleet.state.acquire("image-copy", "debian-12@host h2", "t1", "copy of image debian-12 "
                        "to h2", ttl=30)
    started = time.monotonic()
    with pytest.raises(Conflict):  # a copy to h2's storage: given up at once, not waited for
        with site_images._lock(fleet, "debian-12", "h2", "read", 60, unless_copying=True):
            pass
    assert time.monotonic() - started < 5
    fleet.state.release("image-copy", "debian-12@host h2", "t1")
    fleet.state.acquire("image-copy", "debian-12@host h2", "t2", "read of image debian-12 on "
                        "h2", ttl=30)
    threading.Timer(1.0, fleet.state.release, ("image-copy", "debian-12@host h2", "t2")).start()
    with site_images._lock(fleet, "debian-12", "h2", "read", 60, unless_copying=True):
        pass  # another read: waited for
    mocker.patch.object(fleet.state, "acquire", side_effect=redis.ConnectionError("down"))
    assert site_images.holds(fleet, "h2", BASE) is None  # the planner counts it
