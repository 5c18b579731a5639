"""OS images: bootable disks on the storage every host sees, that disk-backed VMs start from.

An image is a folder `<images>/os/<name>/` holding `disk.qcow2` and `image.json` (format, virtual
size, bytes, SHA-256, where it came from). It is written in a staging folder beside it and renamed
into place, so a half-made image is never listed and a failed import leaves nothing behind. Every
image is stored as qcow2, whatever it was imported from: VMs get a qcow2 overlay on it, and the
image itself is never written to again.

Checks on import, before anything is copied: `qemu-img info` must read the file as qcow2 or raw,
with no backing file (an image must stand alone on storage), and a qcow2 must pass `qemu-img
check`. The checksum is of the stored file, so `verify` can tell whether storage still holds what
was imported.
"""

import hashlib
import json
import os
import shutil
import struct
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import Conflict, InvalidRequest, NotFound, VmmgrError
from .spec import validate_name

DISK = "disk.qcow2"
META = "image.json"
FORMATS = ("qcow2", "raw")
GiB = 2**30


@dataclass(frozen=True)
class OsImage:
    name: str
    format: str  # as stored: always qcow2
    virtual_size: int  # bytes the guest sees
    size: int  # bytes on storage
    sha256: str
    source: str  # "import of <file> (<format>)" or "build <recipe>"
    created: float
    recipe: str = ""  # for built images: the hash of what went into the build

    def as_dict(self) -> dict:
        return asdict(self)


def root(images_dir: Path) -> Path:
    return images_dir / "os"


def image_dir(images_dir: Path, name: str) -> Path:
    return root(images_dir) / validate_name(name, "image")


def disk_path(images_dir: Path, name: str) -> Path:
    return image_dir(images_dir, name) / DISK


def list_images(images_dir: Path) -> list[OsImage]:
    base = root(images_dir)
    if not base.is_dir():
        return []
    found = []
    for d in sorted(base.iterdir()):
        if d.name.startswith(".") or not (d / META).is_file():
            continue  # staging folders of imports in progress
        found.append(_read_meta(d))
    return found


def get(images_dir: Path, name: str) -> OsImage:
    d = image_dir(images_dir, name)
    if not (d / META).is_file():
        known = ", ".join(i.name for i in list_images(images_dir)) or "none"
        raise NotFound(f"unknown image {name!r} (images: {known})")
    return _read_meta(d)


def import_image(images_dir: Path, name: str, source: Path, log=lambda msg: None,
                 recipe: str = "", origin: str = "") -> OsImage:
    """Copy `source` (qcow2 or raw) into the store as image `name`; refuses before it copies."""
    validate_name(name, "image")
    if (image_dir(images_dir, name) / META).exists():
        raise Conflict(f"image {name!r} exists: remove it first (`vmmgr image remove {name}`)")
    source = Path(source)
    if not source.is_file():
        raise InvalidRequest(f"{source}: no such file")
    if not os.access(source, os.R_OK):
        raise InvalidRequest(f"{source}: not readable")
    info = inspect(source)
    staging = root(images_dir) / f".{name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        log(f"copying {source} ({info['format']}, {info['virtual-size'] / GiB:.1f} GiB) "
            f"into the image store as {name}")
        _qemu_img(["convert", "-O", "qcow2", "-f", info["format"], str(source),
                   str(staging / DISK)], f"copy of {source}")
        image = OsImage(
            name=name, format="qcow2", virtual_size=info["virtual-size"],
            size=(staging / DISK).stat().st_size, sha256=sha256_of(staging / DISK),
            source=origin or f"import of {source.name} ({info['format']})", created=time.time(),
            recipe=recipe)
        (staging / META).write_text(json.dumps(image.as_dict(), indent=2) + "\n")
        try:
            staging.rename(image_dir(images_dir, name))
        except OSError:  # another import of the same name won the race
            raise Conflict(f"image {name!r} exists: remove it first") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"image {name}: {image.virtual_size / GiB:.1f} GiB, sha256 {image.sha256[:16]}…")
    return image


def remove_image(images_dir: Path, name: str, used_by: list[str] = ()) -> None:
    get(images_dir, name)  # NotFound
    if used_by:
        raise Conflict(f"image {name!r} is the base of VM(s) {', '.join(sorted(used_by))}: "
                       "destroy them first")
    d = image_dir(images_dir, name)
    gone = root(images_dir) / f".{name}.{os.getpid()}.removed"
    d.rename(gone)  # out of the listing at once, then deleted
    shutil.rmtree(gone)


def overlays_on(images_dir: Path, disks_dir: Path, name: str) -> list[str]:
    """The VMs whose system disks on storage are overlays on the image, read from the disks'
    own headers: a disk exists before its VM's record does, and after a create cut short."""
    base = disk_path(images_dir, name).resolve()
    disks = sorted(disks_dir.glob("*.qcow2")) if disks_dir.is_dir() else []
    return [d.stem for d in disks if (b := backing_file(d)) and Path(b).resolve() == base]


def backing_file(disk: Path) -> str | None:
    """The backing file a qcow2 header names (None: none, or not a qcow2 file)."""
    try:
        with disk.open("rb") as f:
            head = f.read(20)
            if len(head) < 20 or head[:4] != b"QFI\xfb":
                return None
            offset, size = struct.unpack(">QI", head[8:20])  # qcow2 spec: header fields 2, 3
            if not offset or not 0 < size <= 1023:
                return None
            f.seek(offset)
            return f.read(size).decode(errors="replace")
    except OSError:
        return None


def verify(images_dir: Path, name: str) -> OsImage:
    """The image, if storage still holds exactly what was stored; VmmgrError if not."""
    image = get(images_dir, name)
    actual = sha256_of(disk_path(images_dir, name))
    if actual != image.sha256:
        raise VmmgrError(f"image {name!r} is damaged on storage: its checksum is {actual[:16]}…, "
                         f"not {image.sha256[:16]}… as stored")
    return image


def inspect(source: Path) -> dict:
    """qemu-img's view of a file offered as an image: InvalidRequest unless it is a standalone,
    undamaged qcow2 or raw disk."""
    try:
        info = json.loads(_qemu_img(["info", "--output=json", str(source)], f"reading {source}"))
    except VmmgrError as err:
        raise InvalidRequest(f"{source} is not a disk image qemu-img can read: {err}") from None
    fmt = info.get("format")
    if fmt not in FORMATS:
        raise InvalidRequest(f"{source} is {fmt}: an image must be {' or '.join(FORMATS)}")
    if info.get("backing-filename"):
        raise InvalidRequest(f"{source} has a backing file ({info['backing-filename']}): "
                             "an image must stand alone (qemu-img convert it first)")
    if fmt == "qcow2":
        check = subprocess.run(["qemu-img", "check", "--output=json", "-f", "qcow2", str(source)],
                               capture_output=True, text=True)
        if check.returncode != 0:  # 2: corruptions, 3: leaks only (harmless), 1: cannot check
            try:
                report = json.loads(check.stdout)
            except ValueError:
                report = {}
            if check.returncode != 3 or report.get("corruptions"):
                why = (f"{report['corruptions']} corruption(s)" if report.get("corruptions")
                       else (check.stderr.strip() or "qemu-img check failed"))
                raise InvalidRequest(f"{source} is a damaged qcow2: {why}")
    return info


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _read_meta(d: Path) -> OsImage:
    data = json.loads((d / META).read_text())
    return OsImage(**{k: data[k] for k in OsImage.__dataclass_fields__ if k in data})


def _qemu_img(args: list[str], what: str) -> str:
    proc = subprocess.run(["qemu-img", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise VmmgrError(f"{what}: {proc.stderr.strip() or f'qemu-img exited {proc.returncode}'}")
    return proc.stdout
