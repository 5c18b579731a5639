from pathlib import Path

import pytest

from vmmgr.errors import InvalidRequest
from vmmgr.spec import make_spec, validate_cmdline, validate_image_path, validate_name


@pytest.fixture
def images(tmp_path) -> Path:
    root = tmp_path / "images"
    (root / "builtin").mkdir(parents=True)
    (root / "builtin" / "vmlinuz").write_bytes(b"k")
    (root / "builtin" / "initrd.gz").write_bytes(b"i")
    (tmp_path / "secret").write_text("s")
    (root / "link-out").symlink_to(tmp_path / "secret")
    return root


@pytest.mark.parametrize("name", ["a", "web-1", "db_2.prod", "A" * 63])
def test_good_names(name):
    assert validate_name(name) == name


@pytest.mark.parametrize("name", [
    "", "a'/><x", "<domain>", "../etc", "a/b", ".hidden", "-dash", "a b", "A" * 64, "tab\t",
    "ünï", None, 7,
])
def test_bad_names_are_refused(name):
    with pytest.raises(InvalidRequest, match="invalid VM name"):
        validate_name(name)


def test_image_path_inside_root(images):
    assert validate_image_path("builtin/vmlinuz", images, "kernel") == images / "builtin/vmlinuz"
    assert validate_image_path(images / "builtin/vmlinuz", images, "kernel").is_file()


@pytest.mark.parametrize("path", ["../secret", "builtin/../../secret", "/etc/passwd", "link-out"])
def test_image_path_escaping_root_is_refused(images, path):
    with pytest.raises(InvalidRequest, match="outside the image directory"):
        validate_image_path(path, images, "kernel")


def test_missing_image_is_refused(images):
    with pytest.raises(InvalidRequest, match="does not exist"):
        validate_image_path("builtin/nope", images, "kernel")


@pytest.mark.parametrize("line", ["a\nb", "x\x00", "é", "x" * 2049])
def test_bad_cmdline_is_refused(line):
    with pytest.raises(InvalidRequest):
        validate_cmdline(line)


@pytest.mark.parametrize("field,value,match", [
    ("memory_mib", 16, "invalid memory"),
    ("memory_mib", "128", "invalid memory"),
    ("vcpus", 0, "invalid vCPU"),
    ("vcpus", 1000, "invalid vCPU"),
])
def test_sizes_are_checked(images, field, value, match):
    args = dict(memory_mib=128, vcpus=1, kernel="builtin/vmlinuz", initrd="builtin/initrd.gz",
                cmdline="console=ttyS0", image_root=images)
    args[field] = value
    with pytest.raises(InvalidRequest, match=match):
        make_spec("ok", **args)


def test_make_spec_gives_a_fresh_uuid_each_time(images):
    args = dict(memory_mib=128, vcpus=1, kernel="builtin/vmlinuz", initrd=None,
                cmdline="console=ttyS0", image_root=images)
    a, b = make_spec("a", **args), make_spec("a", **args)
    assert a.uuid != b.uuid and a.initrd is None
