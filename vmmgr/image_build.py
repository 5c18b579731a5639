"""`vmmgr image build debian-12`: a cloud-style bootable disk made from Debian packages only.

The disk: an MBR partition table with one ext4 partition, extlinux as the bootloader, and a
debootstrapped Debian 12 with the distribution's own cloud kernel, systemd, cloud-init (NoCloud
only, so a boot never waits on a metadata service that is not there), openssh-server,
qemu-guest-agent, python3 and python3-numpy. It holds no host keys and no machine id: cloud-init
and systemd make them at a VM's first boot, so VMs from one image never share them.

It is cached: the image records a hash of its recipe (suite, packages, the files written here),
and a build whose recipe matches the stored image's returns at once. A changed recipe builds a new
image, which replaces the old one only if no VM stands on it.

Needs root (loop devices, mount, chroot), debootstrap and extlinux.
"""

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from . import os_images
from .apt_sources import debian_mirror
from .errors import Conflict, InvalidRequest, VmmgrError

GiB = 2**30
PART_START = 2048  # sectors: the partition starts at 1 MiB
MBR = Path("/usr/lib/syslinux/mbr/mbr.bin")  # syslinux-common


@dataclass(frozen=True)
class Recipe:
    suite: str
    base: tuple[str, ...]  # debootstrap's own (what apt in the chroot needs)
    packages: tuple[str, ...]  # then apt-get install in the chroot: it orders their setup
    disk_gib: int


RECIPES = {
    "debian-12": Recipe(
        suite="bookworm",
        base=("systemd-sysv", "udev", "dbus", "ca-certificates"),
        packages=(
            "linux-image-cloud-amd64", "initramfs-tools", "ifupdown", "isc-dhcp-client",
            "iproute2", "netbase", "cloud-init", "openssh-server", "qemu-guest-agent", "sudo",
            "python3", "python3-numpy", "e2fsprogs", "procps", "less",
        ),
        disk_gib=3,
    ),
}

# Written into the image; part of the recipe's hash.
CLOUD_CFG = """\
# vmmgr: the seed comes on a NoCloud volume; probing for other datasources only costs boot time.
datasource_list: [ NoCloud, None ]
"""
INTERFACES = """\
auto lo
iface lo inet loopback

source /etc/network/interfaces.d/*
"""
EXTLINUX_CONF = """\
DEFAULT debian
PROMPT 0
TIMEOUT 0
LABEL debian
  LINUX /boot/{kernel}
  INITRD /boot/{initrd}
  APPEND root=UUID={uuid} ro console=tty0 console=ttyS0,115200
"""
FSTAB = "UUID={uuid} / ext4 errors=remount-ro 0 1\n"
# A VM that moves by guest hibernation (it holds passed-through devices) has a swap disk with the
# serial vmmgr-swap (the domain template; the seed makes it swap). Booting on its new host, its
# initramfs restores the image written there, before the root filesystem is mounted; a boot
# without such a disk, or with plain swap on it, goes on as usual.
INITRAMFS_RESUME = """\
#!/bin/sh
PREREQ=""
prereqs() { echo "$PREREQ"; }
case "$1" in prereqs) prereqs; exit 0 ;; esac
# klibc's tools only (no busybox in this initramfs): cat, blkid, the shell's own expansions.
. /scripts/functions
wait_for_udev 10
[ -e /sys/power/resume ] || exit 0
for b in /sys/class/block/vd*; do
	[ "$(cat "$b/serial" 2>/dev/null)" = vmmgr-swap ] || continue
	[ "$(blkid -o value -s TYPE "/dev/${b##*/}" 2>/dev/null)" = swsuspend ] || exit 0
	log_begin_msg "vmmgr: resuming from the hibernation image on ${b##*/}"
	cat "$b/dev" > /sys/power/resume  # returns only if it could not resume
	log_failure_msg "vmmgr: could not resume from ${b##*/}"
	exit 0
done
"""
INITRAMFS_RESUME_PATH = "etc/initramfs-tools/scripts/local-premount/vmmgr-resume"


def recipe_hash(recipe: Recipe) -> str:
    text = json.dumps([recipe.suite, recipe.base, recipe.packages, recipe.disk_gib, CLOUD_CFG,
                       INTERFACES, EXTLINUX_CONF, FSTAB, INITRAMFS_RESUME, 3])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build(images_dir: Path, name: str, used_by: list[str] = (), log=lambda msg: None
          ) -> os_images.OsImage:
    """The image `name` as its recipe makes it: the stored one if its recipe matches."""
    if name not in RECIPES:
        raise InvalidRequest(f"no recipe for {name!r} (recipes: {', '.join(RECIPES)}); "
                             "other images come in with `vmmgr image import`")
    recipe = RECIPES[name]
    wanted = recipe_hash(recipe)
    stored = {i.name: i for i in os_images.list_images(images_dir)}.get(name)
    if stored is not None:
        if stored.recipe == wanted:
            log(f"image {name} is up to date (recipe {wanted})")
            return stored
        if not stored.recipe:
            raise Conflict(f"image {name!r} was imported, not built: remove it first")
        if used_by:
            raise Conflict(f"image {name!r} changed recipe but VM(s) {', '.join(sorted(used_by))} "
                           "stand on it: destroy them first")
    if os.geteuid() != 0:
        raise VmmgrError("building an image needs root (loop devices, mount, chroot)")
    for tool in ("debootstrap", "extlinux", "sfdisk", "losetup", "mkfs.ext4"):
        if shutil.which(tool) is None:
            raise VmmgrError(f"building an image needs {tool} (./run setup installs it)")
    os_images.root(images_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".build-{name}-", dir=os_images.root(images_dir)) as tmp:
        raw = Path(tmp) / "disk.raw"
        _make_disk(raw, recipe, Path(tmp) / "root", log)
        if stored is not None:
            os_images.remove_image(images_dir, name)
        return os_images.import_image(
            images_dir, name, raw, log, recipe=wanted,
            origin=f"build {name} (Debian {recipe.suite}, recipe {wanted})")


def _make_disk(raw: Path, recipe: Recipe, mnt: Path, log) -> None:
    with raw.open("wb") as f:
        f.truncate(recipe.disk_gib * GiB)
    _run(["sfdisk", "-q", str(raw)], input=f"label: dos\nstart={PART_START}, type=83, bootable\n")
    fs_uuid = str(uuid.uuid4())
    offset = PART_START * 512
    loop = _run(["losetup", "--find", "--show", "--offset", str(offset),
                 "--sizelimit", str(recipe.disk_gib * GiB - offset), str(raw)]).strip()
    mnt.mkdir()
    mounted = False
    try:
        # extlinux 6.04 reads ext4 only without the 64bit and metadata_csum features.
        _run(["mkfs.ext4", "-q", "-L", "root", "-U", fs_uuid, "-O", "^64bit,^metadata_csum",
              loop])
        _run(["mount", loop, str(mnt)])
        mounted = True
        mirror = debian_mirror(recipe.suite)
        log(f"debootstrap {recipe.suite} from {mirror}")
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(recipe.base)}",
              recipe.suite, str(mnt), mirror], timeout=1800)
        # Before the kernel's package makes the initramfs, so that it holds the script.
        script = mnt / INITRAMFS_RESUME_PATH
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(INITRAMFS_RESUME)
        script.chmod(0o755)
        log(f"installing {len(recipe.packages)} packages in the image (a few minutes)")
        _install(mnt, recipe, mirror)
        _configure(mnt, fs_uuid)
        log("installing the bootloader (extlinux)")
        _run(["extlinux", "--install", str(mnt / "boot" / "extlinux")])
    finally:
        if mounted:
            _run(["umount", str(mnt)])
        _run(["losetup", "-d", loop])
    with raw.open("r+b") as f:  # the MBR's boot code hands over to extlinux in the partition
        f.write(MBR.read_bytes()[:440])


def _install(mnt: Path, recipe: Recipe, mirror: str) -> None:
    """apt-get install in the chroot, with this machine's apt settings for the while (they may be
    what reaches the mirror) and no service started."""
    (mnt / "etc" / "apt" / "sources.list").write_text(f"deb {mirror} {recipe.suite} main\n")
    borrowed = []
    for conf in sorted(Path("/etc/apt/apt.conf.d").glob("*")):
        target = mnt / "etc" / "apt" / "apt.conf.d" / f"zz-build-{conf.name}"
        if conf.is_file():
            shutil.copy(conf, target)
            borrowed.append(target)
    no_services = mnt / "usr" / "sbin" / "policy-rc.d"
    no_services.write_text("#!/bin/sh\nexit 101\n")
    no_services.chmod(0o755)
    shutil.copy("/etc/resolv.conf", mnt / "etc" / "resolv.conf")
    mounts = []
    try:
        for kind, target in (("proc", "proc"), ("sysfs", "sys")):
            _run(["mount", "-t", kind, kind, str(mnt / target)])
            mounts.append(mnt / target)
        _run(["mount", "--bind", "/dev", str(mnt / "dev")])
        mounts.append(mnt / "dev")
        env = "DEBIAN_FRONTEND=noninteractive"
        _run(["chroot", str(mnt), "env", env, "apt-get", "update", "-q"], timeout=900)
        _run(["chroot", str(mnt), "env", env, "apt-get", "install", "-y", "-q",
              "--no-install-recommends", *recipe.packages], timeout=1800)
        _run(["chroot", str(mnt), "apt-get", "clean"])
    finally:
        for target in reversed(mounts):
            subprocess.run(["umount", "-l", str(target)], check=False)
        for path in (*borrowed, no_services):
            path.unlink(missing_ok=True)
    (mnt / "etc" / "resolv.conf").unlink(missing_ok=True)  # cloud-init and DHCP write their own


def _configure(mnt: Path, fs_uuid: str) -> None:
    boot = mnt / "boot"
    kernels = sorted(boot.glob("vmlinuz-*"))
    if not kernels:
        raise VmmgrError("the image has no kernel: linux-image-cloud-amd64 did not install")
    kernel = kernels[-1].name
    initrd = f"initrd.img-{kernel.removeprefix('vmlinuz-')}"
    if not (boot / initrd).is_file():
        raise VmmgrError(f"the image has no {initrd}: initramfs-tools did not run")
    (boot / "extlinux").mkdir(exist_ok=True)
    (boot / "extlinux" / "extlinux.conf").write_text(
        EXTLINUX_CONF.format(kernel=kernel, initrd=initrd, uuid=fs_uuid))
    (mnt / "etc" / "fstab").write_text(FSTAB.format(uuid=fs_uuid))
    (mnt / "etc" / "network" / "interfaces").write_text(INTERFACES)
    (mnt / "etc" / "cloud" / "cloud.cfg.d" / "90-vmmgr.cfg").write_text(CLOUD_CFG)
    (mnt / "etc" / "hostname").write_text("debian\n")
    # Made per VM at its first boot: never shared between VMs from this image.
    (mnt / "etc" / "machine-id").write_text("")
    for key in (mnt / "etc" / "ssh").glob("ssh_host_*"):
        key.unlink()
    shutil.rmtree(mnt / "var" / "lib" / "apt" / "lists", ignore_errors=True)
    (mnt / "var" / "lib" / "apt" / "lists" / "partial").mkdir(parents=True)
    for deb in (mnt / "var" / "cache" / "apt" / "archives").glob("*.deb"):
        deb.unlink()


def _run(cmd: list[str], input: str | None = None, timeout: float = 600) -> str:
    proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        detail = (proc.stderr.strip() or proc.stdout.strip())[-1500:]
        raise VmmgrError(f"image build: {cmd[0]} failed ({proc.returncode}): {detail}")
    return proc.stdout
