"""The built-in guest image, made from Debian packages only.

Kernel: `boot/vmlinuz-*` from the .deb that `linux-image-cloud-amd64` depends on, downloaded and
unpacked into a scratch folder (never installed as the host's kernel). Initramfs: busybox-static,
the virtio modules from the same .deb, `guest_image/init.sh` and the C programs in `guest_image/`
(the `dirtier` workload, the `stream` generator) compiled statically with Debian's gcc. Both are cached under the image
directory; the initramfs's file name carries a hash of what went into it, so a change to the init
script builds a new one and an unchanged one is never rebuilt.
"""

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .errors import VmmgrError

KERNEL_META_PACKAGE = "linux-image-cloud-amd64"
BUSYBOX = Path("/bin/busybox")
GUEST_PROGRAMS = ("dirtier", "stream", "qga")
# In load order (init.sh loads them in this order too).
GUEST_MODULES = (
    "virtio_ring", "virtio", "virtio_pci_modern_dev", "virtio_pci_legacy_dev", "virtio_pci",
    "failover", "net_failover", "virtio_net", "virtio_blk", "virtio_console",
)


@dataclass(frozen=True)
class BuiltinImage:
    kernel: Path
    initrd: Path


def _guest_file(name: str) -> bytes:
    return resources.files("vmmgr").joinpath("guest_image", name).read_bytes()


def init_script() -> bytes:
    return _guest_file("init.sh")


def ensure_builtin(images_dir: Path, log=lambda msg: None) -> BuiltinImage:
    """Return the built-in image, building whatever part of it is missing."""
    dest = images_dir / "builtin"
    dest.mkdir(parents=True, exist_ok=True)
    kernel, modules = _ensure_kernel(dest, log)
    return BuiltinImage(kernel=kernel, initrd=_ensure_initramfs(dest, modules, log))


def _ensure_kernel(dest: Path, log) -> tuple[Path, Path]:
    kernels = sorted(dest.glob("vmlinuz-*"))
    if kernels:
        kernel = kernels[-1]
        return kernel, dest / f"modules-{kernel.name.removeprefix('vmlinuz-')}"
    package = _kernel_package()
    log(f"downloading guest kernel {package} (unpacked, not installed)")
    with tempfile.TemporaryDirectory(prefix="vmmgr-kernel-") as tmp:
        tmp = Path(tmp)
        _run(["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", package], cwd=tmp)
        debs = list(tmp.glob("*.deb"))
        if len(debs) != 1:
            raise VmmgrError(f"apt-get download {package} gave {len(debs)} .deb files")
        _run(["dpkg-deb", "-x", str(debs[0]), str(tmp / "x")])
        (vmlinuz,) = (tmp / "x" / "boot").glob("vmlinuz-*")
        version = vmlinuz.name.removeprefix("vmlinuz-")
        staging = dest / f".modules-{version}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        found = {p.stem: p for p in (tmp / "x" / "lib" / "modules" / version).rglob("*.ko")}
        for name in GUEST_MODULES:
            if name not in found:
                raise VmmgrError(f"module {name}.ko missing from {package}")
            shutil.copy2(found[name], staging / f"{name}.ko")
        modules = dest / f"modules-{version}"
        shutil.rmtree(modules, ignore_errors=True)
        staging.rename(modules)
        # The kernel goes in last: its presence marks the kernel part complete.
        shutil.copy2(vmlinuz, dest / f".{vmlinuz.name}.tmp")
        os.replace(dest / f".{vmlinuz.name}.tmp", dest / vmlinuz.name)
        return dest / vmlinuz.name, modules


def _kernel_package() -> str:
    out = _run(["apt-cache", "depends", KERNEL_META_PACKAGE])
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Depends: linux-image-"):
            return line.split(":", 1)[1].strip()
    raise VmmgrError(
        f"cannot resolve {KERNEL_META_PACKAGE} (run 'apt-get update' first): {out.strip()!r}"
    )


def _ensure_initramfs(dest: Path, modules: Path, log) -> Path:
    digest = hashlib.sha256(init_script())
    for program in GUEST_PROGRAMS:
        digest.update(_guest_file(f"{program}.c"))
    for name in GUEST_MODULES:
        digest.update((modules / f"{name}.ko").read_bytes())
    digest.update(BUSYBOX.read_bytes())
    initrd = dest / f"initramfs-{digest.hexdigest()[:16]}.gz"
    if initrd.exists():
        return initrd
    log(f"building guest initramfs {initrd.name}")
    with tempfile.TemporaryDirectory(prefix="vmmgr-initramfs-") as tmp:
        root = Path(tmp) / "root"
        for sub in ("bin", "dev", "proc", "sys", "tmp", "lib/modules"):
            (root / sub).mkdir(parents=True)
        shutil.copy2(BUSYBOX, root / "bin" / "busybox")
        (root / "bin" / "sh").symlink_to("busybox")
        (root / "init").write_bytes(init_script())
        (root / "init").chmod(0o755)
        # What busybox cannot do (verify memory, make a checkable stream) is C: static, so the
        # initramfs needs no libc.
        for program in GUEST_PROGRAMS:
            _compile(program, root / "bin" / program)
        for name in GUEST_MODULES:
            shutil.copy2(modules / f"{name}.ko", root / "lib" / "modules" / f"{name}.ko")
        # The kernel opens /dev/console for init's output before init can mount devtmpfs.
        _run(["mknod", "-m", "600", str(root / "dev" / "console"), "c", "5", "1"])
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
        cpio = subprocess.run(
            ["cpio", "--quiet", "-o", "-H", "newc", "--reproducible"],
            input="\n".join(["."] + files).encode(), cwd=root, capture_output=True, check=True,
        ).stdout
        partial = dest / f".{initrd.name}.tmp"
        partial.write_bytes(_gzip(cpio))
        os.replace(partial, initrd)
    return initrd


def stream_tool(images: Path) -> Path:
    """The host's copy of the guest's `stream` generator: checkers and outside servers use it."""
    tool = images / "builtin" / f"stream-{hashlib.sha256(_guest_file('stream.c')).hexdigest()[:12]}"
    if not tool.exists():
        tool.parent.mkdir(parents=True, exist_ok=True)
        _compile("stream", tool)
    return tool


def _compile(program: str, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="vmmgr-cc-") as tmp:
        src = Path(tmp) / f"{program}.c"
        src.write_bytes(_guest_file(f"{program}.c"))
        partial = Path(tmp) / program
        _run(["gcc", "-static", "-O2", "-o", str(partial), str(src)])
        shutil.copy2(partial, out)


def _gzip(data: bytes) -> bytes:
    return subprocess.run(["gzip", "-9", "-n"], input=data, capture_output=True, check=True).stdout


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise VmmgrError(f"{' '.join(cmd)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout
