"""The image store, with the real qemu-img on small files: what is imported, what is refused
(and that a refusal leaves nothing behind), removal and the checksum."""

import json
import subprocess

import pytest

from vmmgr import os_images
from vmmgr.errors import Conflict, InvalidRequest, NotFound, VmmgrError

MiB = 2**20


def _raw(path, mib=4, fill=b"vmmgr-image "):
    with path.open("wb") as f:
        f.write(fill * (mib * MiB // len(fill)))
        f.truncate(mib * MiB)
    return path


def _qcow2(tmp_path, name="src.qcow2", backing=None, mib=4):
    path = tmp_path / name
    cmd = ["qemu-img", "create", "-q", "-f", "qcow2"]
    if backing:
        cmd += ["-b", str(backing), "-F", "raw"]
    subprocess.run([*cmd, str(path), f"{mib}M"], check=True)
    return path


def _nothing_left(store):
    base = os_images.root(store)
    return not base.exists() or not any(base.iterdir())


def test_a_raw_file_is_stored_as_qcow2_with_its_size_and_checksum(tmp_path):
    store = tmp_path / "images"
    image = os_images.import_image(store, "tiny", _raw(tmp_path / "tiny.raw"))
    disk = os_images.disk_path(store, "tiny")
    info = json.loads(subprocess.run(["qemu-img", "info", "--output=json", str(disk)],
                                     capture_output=True, text=True, check=True).stdout)
    assert info["format"] == "qcow2" and image.format == "qcow2"
    assert image.virtual_size == info["virtual-size"] == 4 * MiB
    assert image.sha256 == os_images.sha256_of(disk)
    assert image.source == "import of tiny.raw (raw)"
    assert [i.name for i in os_images.list_images(store)] == ["tiny"]
    assert os_images.get(store, "tiny") == image
    # The guest's bytes came across: the stored image reads back as the raw file did.
    assert subprocess.run(["qemu-img", "compare", "-q", str(tmp_path / "tiny.raw"),
                           str(disk)]).returncode == 0


def test_an_image_with_a_backing_file_is_refused(tmp_path):
    backing = _raw(tmp_path / "base.raw")
    with pytest.raises(InvalidRequest, match="backing file"):
        os_images.import_image(tmp_path / "images", "layered",
                               _qcow2(tmp_path, backing=backing))
    assert _nothing_left(tmp_path / "images")


def test_a_damaged_qcow2_is_refused_with_a_clear_error(tmp_path):
    src = _qcow2(tmp_path)
    with src.open("r+b") as f:  # the L1 table's offset, pointed far past the file's end
        f.seek(40)
        f.write((1 << 50).to_bytes(8, "big"))
    with pytest.raises(InvalidRequest, match=r"src\.qcow2 .*(damaged|cannot|not a disk image)"):
        os_images.import_image(tmp_path / "images", "broken", src)
    assert _nothing_left(tmp_path / "images")


def test_missing_unreadable_and_badly_named_sources_are_refused(tmp_path):
    store = tmp_path / "images"
    with pytest.raises(InvalidRequest, match="no such file"):
        os_images.import_image(store, "a", tmp_path / "absent.qcow2")
    with pytest.raises(InvalidRequest, match="invalid image name"):
        os_images.import_image(store, "../escape", _raw(tmp_path / "x.raw"))
    with pytest.raises(InvalidRequest, match="invalid image name"):
        os_images.import_image(store, "<domain>", _raw(tmp_path / "x.raw"))
    assert _nothing_left(store)


def test_a_taken_name_is_refused_and_the_first_image_is_untouched(tmp_path):
    store = tmp_path / "images"
    first = os_images.import_image(store, "base", _raw(tmp_path / "a.raw"))
    with pytest.raises(Conflict, match="exists"):
        os_images.import_image(store, "base", _raw(tmp_path / "b.raw", fill=b"other "))
    assert os_images.verify(store, "base") == first
    assert [p.name for p in os_images.root(store).iterdir()] == ["base"]


def test_remove_refuses_an_image_in_use_and_an_unknown_one(tmp_path):
    store = tmp_path / "images"
    os_images.import_image(store, "base", _raw(tmp_path / "a.raw"))
    with pytest.raises(Conflict, match="base of VM"):
        os_images.remove_image(store, "base", used_by=["vm1"])
    assert os_images.get(store, "base")
    os_images.remove_image(store, "base")
    assert os_images.list_images(store) == [] and _nothing_left(store)
    with pytest.raises(NotFound, match="unknown image 'base'"):
        os_images.remove_image(store, "base")


def test_verify_finds_an_image_damaged_on_storage(tmp_path):
    store = tmp_path / "images"
    os_images.import_image(store, "base", _raw(tmp_path / "a.raw"))
    with os_images.disk_path(store, "base").open("r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(VmmgrError, match="damaged on storage"):
        os_images.verify(store, "base")


def test_the_disks_laid_on_an_image_are_found_from_their_own_headers(tmp_path, monkeypatch):
    """A create lays its disk before its VM's record exists (and a create cut short leaves the
    disk alone): a removal must see such disks on storage, not only in the records."""
    from vmmgr.cli.images import vms_on
    from vmmgr.paths import Paths

    monkeypatch.delenv("VMMGR_REDIS_URL", raising=False)
    paths = Paths(tmp_path / "home")
    store, disks = paths.images, paths.storage / "disks"
    disks.mkdir(parents=True)
    for name in ("base", "other"):
        os_images.import_image(store, name, _raw(tmp_path / f"{name}.raw"))
    for vm, image in (("vm1", "base"), ("vm2", "other"), ("vm3", "base")):
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b",
                        str(os_images.disk_path(store, image)), str(disks / f"{vm}.qcow2"),
                        "8M"], check=True)
    _qcow2(disks, "standalone.qcow2")  # no backing file
    _raw(disks / "vm1-seed.iso", mib=1)

    assert os_images.backing_file(disks / "vm1.qcow2") == str(os_images.disk_path(store, "base"))
    assert os_images.backing_file(disks / "standalone.qcow2") is None
    assert os_images.overlays_on(store, disks, "base") == ["vm1", "vm3"]
    assert vms_on(paths, "other") == ["vm2"]  # no store: the disks alone
    with pytest.raises(Conflict, match="base of VM\\(s\\) vm1, vm3"):
        os_images.remove_image(store, "base", used_by=vms_on(paths, "base"))
    assert os_images.get(store, "base")


def test_a_removal_waits_for_a_create_laying_its_disk_and_says_so(tmp_path, monkeypatch,
                                                                    redis_url):
    from click.testing import CliRunner

    from vmmgr import fleet as fleet_mod
    from vmmgr.cli import cli
    from vmmgr.fleet import Fleet
    from vmmgr.paths import Paths

    monkeypatch.setenv("VMMGR_REDIS_URL", redis_url)
    monkeypatch.setattr(fleet_mod, "IMAGE_WAIT", 0.5)
    paths = Paths(tmp_path / "home")
    os_images.import_image(paths.images, "base", _raw(tmp_path / "base.raw"))
    remove = ["--home", str(paths.home), "image", "remove", "base"]
    with Fleet(paths) as creating, creating.lock_image("base", "create of vm1"):
        out = CliRunner().invoke(cli, remove)  # `vmmgr.cli:main` prints the error, exit 4
        assert isinstance(out.exception, Conflict), out.output
        assert "image 'base' is busy: create of vm1 is in progress" in str(out.exception)
        assert os_images.get(paths.images, "base")  # untouched
    out = CliRunner().invoke(cli, remove)
    assert out.exit_code == 0 and "image base removed" in out.output, out.output


def test_the_disks_a_cut_short_create_left_hold_the_image_until_destroy_removes_them(
        tmp_path, monkeypatch, redis_url):
    from vmmgr import requests
    from vmmgr.cli.images import vms_on
    from vmmgr.fleet import Fleet
    from vmmgr.paths import Paths

    monkeypatch.setenv("VMMGR_REDIS_URL", redis_url)
    paths = Paths(tmp_path / "home")
    os_images.import_image(paths.images, "base", _raw(tmp_path / "base.raw"))
    with Fleet(paths) as fleet:
        disk, seed = fleet.system_disk_path("vm9"), fleet.seed_path("vm9")
        disk.parent.mkdir(parents=True)
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b",
                        str(os_images.disk_path(paths.images, "base")), str(disk), "8M"],
                       check=True)
        _raw(seed, mib=1)  # the worker died here: no definition, no record
        with pytest.raises(Conflict, match="base of VM\\(s\\) vm9: destroy them first"):
            os_images.remove_image(paths.images, "base", used_by=vms_on(paths, "base"))
        requests.destroy(fleet, "vm9")  # admitted: there is something to destroy
        assert fleet.destroy("vm9") == "storage (what a create or destroy cut short left)"
        assert not disk.exists() and not seed.exists()
        with pytest.raises(NotFound, match="unknown VM 'vm9'"):
            requests.destroy(fleet, "vm9")
        with pytest.raises(NotFound, match="unknown VM 'vm9'"):
            fleet.destroy("vm9")
    os_images.remove_image(paths.images, "base", used_by=vms_on(paths, "base"))


def test_a_local_disk_a_cut_short_create_left_in_a_hosts_pool_is_left_for_destroy(
        tmp_path, monkeypatch, redis_url, mocker):
    """A local-disk create cut short leaves its overlay (and seed) in its host's pool and
    nothing on storage: destroy must still find something to remove (the review's finding)."""
    from vmmgr import local_disks
    from vmmgr.errors import VmmgrError
    from vmmgr.fleet import Fleet
    from vmmgr.paths import Paths

    monkeypatch.setenv("VMMGR_REDIS_URL", redis_url)
    with Fleet(Paths(tmp_path / "home")) as fleet:
        hosts = [mocker.Mock(), mocker.Mock(), mocker.Mock()]
        for h, state in zip(hosts, ("active", "active", "reclaimed")):
            h.record.state = state
        mocker.patch.object(fleet, "hosts", return_value=hosts)
        held = mocker.patch.object(local_disks, "held", side_effect=lambda conn: (
            {"vm9"} if conn is hosts[1].conn else {"vm7"} if conn is hosts[2].conn else set()))
        assert fleet.has_leftovers("vm9", None)
        assert not fleet.has_leftovers("vm8", None)
        assert not fleet.has_leftovers("vm7", None)  # a reclaimed host is not asked
        held.side_effect = VmmgrError("host2 does not answer")
        assert not fleet.has_leftovers("vm9", None)  # found there by a later destroy
        assert fleet.has_leftovers("vm9", "10.78.0.9")  # its address alone is enough
