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
