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
MAX_DISK_GIB = 16384
MAX_USER_DATA = 64 * 1024  # bytes: a cloud-config or script, not a payload
SSH_KEY_RE = re.compile(r"^(ssh-(rsa|ed25519|dss)|ecdsa-sha2-nistp(256|384|521)|"
                        r"sk-(ssh-ed25519|ecdsa-sha2-nistp256)@openssh\.com) [A-Za-z0-9+/=]+( [ -~]*)?$")


@dataclass(frozen=True)
class VMSpec:
    name: str
    memory_mib: int
    vcpus: int
    kernel: Path | None  # None: the VM boots its own disk (`image`)
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
    # A disk-backed VM: a qcow2 overlay (`disk`, on shared storage) on the OS image `image`, and
    # a cloud-init NoCloud seed (`seed`) with its hostname, SSH keys, address and user-data.
    image: str = ""
    disk_gib: int = 0
    ssh_keys: tuple[str, ...] = ()
    user_data: str = ""
    disk: str = ""
    seed: str = ""
    # The overlay on the host's own storage (`local_disks`) instead of shared storage: it moves
    # with the VM, copied by the migration.
    local_disk: bool = False
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


def validate_ssh_key(key: str) -> str:
    """One OpenSSH public key line (`ssh-ed25519 AAAA... comment`)."""
    key = key.strip() if isinstance(key, str) else key
    if not isinstance(key, str) or "\n" in key or not SSH_KEY_RE.match(key):
        raise InvalidRequest("invalid SSH public key: give one line as in ~/.ssh/id_ed25519.pub "
                             "(type, base64 key, optional comment)")
    return key


def validate_user_data(text: str) -> str:
    if not isinstance(text, str) or len(text.encode()) > MAX_USER_DATA:
        raise InvalidRequest(f"invalid user-data: text of at most {MAX_USER_DATA} bytes")
    if text and not text.startswith(("#cloud-config", "#!")):
        raise InvalidRequest("invalid user-data: it must start with #cloud-config or #! "
                             "(a cloud-config document or a script)")
    return text


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
    kernel: str | Path | None = None,
    initrd: str | Path | None = None,
    cmdline: str = "",
    image_root: Path,
    workload: str = "",
    gpu_model: str = "",
    gpu_count: int = 0,
    group: str = "",
    image: str = "",
    disk_gib: int = 0,
    ssh_keys: tuple[str, ...] | list[str] = (),
    user_data: str = "",
    local_disk: bool = False,
) -> VMSpec:
    """Validate every field and build the spec; raises InvalidRequest naming the first bad one.

    A VM boots either a kernel (and initrd) from the image directory, or its own disk made from
    the OS image `image` (`os_images`), never both."""
    if image:
        from . import os_images  # the image store is only asked about disk-backed VMs

        if kernel or initrd:
            raise InvalidRequest("a VM boots either an OS image or a kernel, not both")
        stored = os_images.get(image_root, validate_name(image, "image"))  # NotFound
        smallest = -(-stored.virtual_size // 2**30)
        disk_gib = disk_gib or smallest
        if not isinstance(disk_gib, int) or isinstance(disk_gib, bool) or not (
                smallest <= disk_gib <= MAX_DISK_GIB):
            raise InvalidRequest(f"invalid disk size {disk_gib!r} GiB: image {image} needs at "
                                 f"least {smallest} GiB (at most {MAX_DISK_GIB})")
        if local_disk and gpu_count:
            raise InvalidRequest("a VM with passed-through devices keeps its disk on shared "
                                 "storage: it moves by hibernating into it (no --local-disk)")
    elif kernel is None:
        raise InvalidRequest("a VM needs an OS image (--image) or a kernel (--kernel)")
    elif disk_gib or ssh_keys or user_data or local_disk:
        raise InvalidRequest("a disk size, a local disk, SSH keys and user-data go with an OS "
                             "image (--image)")
    return VMSpec(
        name=validate_name(name),
        memory_mib=validate_memory(memory_mib),
        vcpus=validate_vcpus(vcpus),
        kernel=validate_image_path(kernel, image_root, "kernel") if kernel else None,
        initrd=validate_image_path(initrd, image_root, "initrd") if initrd else None,
        cmdline=validate_cmdline(cmdline),
        workload=workload,
        gpu_model=validate_gpu(gpu_model, gpu_count)[0],
        gpu_count=gpu_count,
        group=validate_name(group, "group") if group else "",
        image=image,
        disk_gib=disk_gib if image else 0,
        ssh_keys=tuple(validate_ssh_key(k) for k in ssh_keys),
        user_data=validate_user_data(user_data),
        local_disk=bool(local_disk) if image else False,
    )
