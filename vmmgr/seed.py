"""The cloud-init NoCloud seed of a disk-backed VM: a small ISO 9660 volume labelled `cidata`
with its meta-data, user-data and network configuration, so the OS image itself is never changed.

- meta-data: the instance id (the VM's UUID: cloud-init runs its once-per-instance steps once per
  VM, not again after a move or a reboot) and the hostname.
- user-data: vmmgr's cloud-config (a `vmmgr` user with sudo and the given SSH keys; the C.UTF-8
  locale, which every Debian has), then the user's own user-data, as a MIME multipart that
  cloud-init merges in order.
- network-config (version 2): the stable address as a /32 behind the gateway, on the NIC with
  the VM's MAC. The gateway is given as `gateway4`: ifupdown (Debian's renderer) adds it `onlink`,
  which a /32 needs; cloud-init 22.4 renders an `on-link` route through net-tools' `route`,
  which images lack (both seen on the lab).

The texts are pure functions; `write` makes the ISO with genisoimage.
"""

import json
import subprocess
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from pathlib import Path

from .errors import VmmgrError

USER = "vmmgr"


def meta_data(instance_id: str, hostname: str) -> str:
    return json.dumps({"instance-id": instance_id, "local-hostname": hostname}) + "\n"


SWAP_DEVICE = "/dev/disk/by-id/virtio-vmmgr-swap"  # the swap disk's serial (domain template)
# Every boot: the hibernation swap disk enabled, made swap first unless it already is. By the time
# this runs the initramfs has had its one chance to resume from the disk, so a hibernation image
# still on it (blkid: swsuspend) is stale: it is overwritten, never left for a later boot to
# resume from a filesystem that has changed since.
SWAP_ON = (f"if [ -e {SWAP_DEVICE} ]; then "
           f"[ \"$(blkid -o value -s TYPE {SWAP_DEVICE})\" = swap ] || "
           f"mkswap -L vmmgr-swap {SWAP_DEVICE}; swapon {SWAP_DEVICE} || true; fi")


def vmmgr_cloud_config(ssh_keys: tuple[str, ...], hibernation_swap: bool = False) -> str:
    config = {
        "users": [{"name": USER, "shell": "/bin/bash", "sudo": "ALL=(ALL) NOPASSWD:ALL",
                   "lock_passwd": True, "ssh_authorized_keys": list(ssh_keys)}],
        "ssh_pwauth": False,
        "locale": "C.UTF-8",
    }
    if hibernation_swap:
        config["bootcmd"] = [["sh", "-c", SWAP_ON]]
    return "#cloud-config\n" + json.dumps(config, indent=1) + "\n"  # JSON is YAML


def user_data(ssh_keys: tuple[str, ...], users_own: str = "", hibernation_swap: bool = False
              ) -> str:
    ours = vmmgr_cloud_config(ssh_keys, hibernation_swap)
    if not users_own:
        return ours
    parts = MIMEMultipart()
    for text in (ours, users_own):
        subtype = "cloud-config" if text.startswith("#cloud-config") else "x-shellscript"
        parts.attach(MIMEText(text, subtype))
    return parts.as_string()


def network_config(mac: str, address: str, gateway: str) -> str:
    if not address:  # no stable addresses in this fleet: whatever NIC it has asks DHCP
        return json.dumps({"version": 2, "ethernets": {"any": {
            "match": {"name": "e*"}, "dhcp4": True}}}) + "\n"
    return json.dumps({"version": 2, "ethernets": {"eth0": {
        "match": {"macaddress": mac}, "set-name": "eth0",
        "addresses": [f"{address}/32"], "gateway4": gateway}}}) + "\n"


def write(path: Path, files: dict[str, str]) -> Path:
    """The seed volume at `path` (0600: user-data may hold secrets)."""
    staging = path.with_name(f".{path.name}.d")
    staging.mkdir(parents=True, exist_ok=True)
    try:
        for name, text in files.items():
            (staging / name).write_text(text)
        proc = subprocess.run(["genisoimage", "-quiet", "-output", str(path), "-volid", "cidata",
                               "-joliet", "-rock", *sorted(files)], cwd=staging,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise VmmgrError(f"cloud-init seed for {path.name}: {proc.stderr.strip()}")
        path.chmod(0o600)
        return path
    finally:
        for name in files:
            (staging / name).unlink(missing_ok=True)
        staging.rmdir()
