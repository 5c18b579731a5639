"""What a VM is, validated before anything reaches libvirt.

A `VMSpec` is the whole description of a VM; `validate_*` are the only gate between operator input
and the XML we render. Names become XML text and file names, so they are held to a strict pattern;
image paths must resolve inside the image directory (no `..`, no symlink out of it).
"""

import re
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InvalidRequest

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
MIN_MEMORY_MIB = 32
MAX_MEMORY_MIB = 4 * 1024 * 1024
MAX_VCPUS = 256
MAX_CMDLINE = 2048


@dataclass(frozen=True)
class VMSpec:
    name: str
    memory_mib: int
    vcpus: int
    kernel: Path
    initrd: Path | None
    cmdline: str
    workload: str = ""  # the built-in workload's name, empty for a user kernel
    address: str = ""  # the stable address (`addresses`), empty without a network
    gateway: str = ""
    # Passed-through devices (GPUs): `gpu_count` of model `gpu_model`. Such a VM moves by guest
    # hibernation, so it gets a swap disk on shared storage (`swap_disk`) and a guest agent channel.
    gpu_model: str = ""
    gpu_count: int = 0
    # A job of several VMs (a training run's ranks): placed, moved, parked and resumed together.
    group: str = ""
    swap_disk: str = ""
    uuid: str = field(default_factory=lambda: str(uuidlib.uuid4()))


def validate_name(name: str, what: str = "VM") -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidRequest(
            f"invalid {what} name {name!r}: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def validate_memory(memory_mib: int) -> int:
    if not isinstance(memory_mib, int) or not MIN_MEMORY_MIB <= memory_mib <= MAX_MEMORY_MIB:
        raise InvalidRequest(
            f"invalid memory {memory_mib!r} MiB: must be {MIN_MEMORY_MIB}..{MAX_MEMORY_MIB}"
        )
    return memory_mib


def validate_vcpus(vcpus: int) -> int:
    if not isinstance(vcpus, int) or not 1 <= vcpus <= MAX_VCPUS:
        raise InvalidRequest(f"invalid vCPU count {vcpus!r}: must be 1..{MAX_VCPUS}")
    return vcpus


def validate_gpu(model: str, count: int) -> tuple[str, int]:
    if not count and not model:
        return "", 0
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 8:
        raise InvalidRequest(f"invalid device count {count!r}: must be 1..8")
    if not isinstance(model, str) or not NAME_RE.match(model):
        raise InvalidRequest(f"invalid device model {model!r}")
    return model, count


def validate_cmdline(cmdline: str) -> str:
    if len(cmdline) > MAX_CMDLINE or any(not (32 <= ord(c) < 127) for c in cmdline):
        raise InvalidRequest(
            f"invalid kernel command line: printable ASCII only, at most {MAX_CMDLINE} characters"
        )
    return cmdline


def validate_image_path(path: str | Path, root: Path, what: str) -> Path:
    """The real path of an image file, which must lie inside `root` (after resolving links)."""
    root = root.resolve()
    given = Path(path)
    if not given.is_absolute():
        given = root / given
    real = given.resolve()
    if real != root and root not in real.parents:
        raise InvalidRequest(f"{what} path {str(path)!r} is outside the image directory {root}")
    if not real.is_file():
        raise InvalidRequest(f"{what} {str(path)!r} does not exist (looked for {real})")
    return real


def make_spec(
    name: str,
    *,
    memory_mib: int,
    vcpus: int,
    kernel: str | Path,
    initrd: str | Path | None,
    cmdline: str,
    image_root: Path,
    workload: str = "",
    gpu_model: str = "",
    gpu_count: int = 0,
    group: str = "",
) -> VMSpec:
    """Validate every field and build the spec; raises InvalidRequest naming the first bad one."""
    return VMSpec(
        name=validate_name(name),
        memory_mib=validate_memory(memory_mib),
        vcpus=validate_vcpus(vcpus),
        kernel=validate_image_path(kernel, image_root, "kernel"),
        initrd=validate_image_path(initrd, image_root, "initrd") if initrd else None,
        cmdline=validate_cmdline(cmdline),
        workload=workload,
        gpu_model=validate_gpu(gpu_model, gpu_count)[0],
        gpu_count=gpu_count,
        group=validate_name(group, "group") if group else "",
    )
