"""A disk-backed VM's spec and its cloud-init seed: what is refused before anything is made, and
what the seed tells cloud-init."""

import email
import json

import pytest

from vmmgr import os_images, seed
from vmmgr.errors import InvalidRequest, NotFound
from vmmgr.spec import make_spec

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeKeyForTestsOnly0123456789abcdefghij me@laptop"


@pytest.fixture
def store(tmp_path):
    raw = tmp_path / "base.raw"
    with raw.open("wb") as f:
        f.truncate(3 * 2**30 - 4096)  # rounds up to 3 GiB
    images = tmp_path / "images"
    os_images.import_image(images, "base", raw)
    return images


def test_a_vm_from_an_image_takes_the_images_size_unless_told(store):
    spec = make_spec("vm1", memory_mib=512, vcpus=1, image_root=store, image="base",
                     ssh_keys=[KEY])
    assert spec.disk_gib == 3 and spec.kernel is None and spec.ssh_keys == (KEY,)
    assert make_spec("vm1", memory_mib=512, vcpus=1, image_root=store, image="base",
                     disk_gib=20).disk_gib == 20


@pytest.mark.parametrize("kwargs,message", [
    ({"image": "nope"}, "unknown image 'nope'"),
    ({"image": "base", "disk_gib": 2}, "needs at least 3 GiB"),
    ({"image": "base", "ssh_keys": ["not a key"]}, "invalid SSH public key"),
    ({"image": "base", "ssh_keys": [KEY + "\nssh-rsa AAAA second"]}, "invalid SSH public key"),
    ({"image": "base", "user_data": "runcmd: [reboot]"}, "must start with #cloud-config"),
    ({"image": "base", "user_data": "#cloud-config\n" + "x" * 70000}, "at most"),
    ({"image": "base", "kernel": "k"}, "either an OS image or a kernel"),
    ({"image": "../etc"}, "invalid image name"),
    ({}, "needs an OS image"),
])
def test_bad_image_requests_are_refused(store, kwargs, message):
    with pytest.raises((InvalidRequest, NotFound), match=message):
        make_spec("vm1", memory_mib=512, vcpus=1, image_root=store, **kwargs)


def test_the_network_config_puts_the_stable_address_behind_the_gateway():
    config = json.loads(seed.network_config("52:54:00:0a:4e:00", "10.78.0.5", "10.78.0.1"))
    eth0 = config["ethernets"]["eth0"]
    assert config["version"] == 2 and eth0["match"] == {"macaddress": "52:54:00:0a:4e:00"}
    assert eth0["addresses"] == ["10.78.0.5/32"] and eth0["gateway4"] == "10.78.0.1"


def test_user_data_gives_the_key_and_merges_the_users_own_after_ours():
    ours = seed.user_data((KEY,))
    assert ours.startswith("#cloud-config\n")
    config = json.loads(ours.split("\n", 1)[1])
    assert config["users"][0]["ssh_authorized_keys"] == [KEY]
    assert config["users"][0]["name"] == seed.USER and config["ssh_pwauth"] is False

    merged = email.message_from_string(seed.user_data((KEY,), "#!/bin/sh\necho hello\n"))
    parts = [p for p in merged.walk() if not p.is_multipart()]
    assert [p.get_content_type() for p in parts] == ["text/cloud-config", "text/x-shellscript"]
    assert parts[1].get_payload(decode=True).decode() == "#!/bin/sh\necho hello\n"


def test_meta_data_names_the_instance_by_the_vms_uuid():
    assert json.loads(seed.meta_data("uuid-1", "vm1")) == {"instance-id": "uuid-1",
                                                           "local-hostname": "vm1"}


def test_a_vm_with_devices_gets_its_hibernation_swap_made_and_enabled_at_boot(store, tmp_path):
    """The seed's bootcmd makes the swap disk swap once and enables it at every boot. A
    hibernation image still on it when userspace boots is stale (the initramfs did not resume
    it): it is overwritten, so no later boot resumes it over a changed filesystem."""
    spec = make_spec("vm1", memory_mib=512, vcpus=1, image_root=store, image="base",
                     gpu_model="a100-80g", gpu_count=1)
    assert spec.gpu_count == 1
    assert "bootcmd" not in seed.user_data((KEY,))
    config = json.loads(seed.user_data((KEY,), hibernation_swap=True).split("\n", 1)[1])
    script = config["bootcmd"][0][2]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "swapon").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/swapon.log\n")
    (fake / "swapon").chmod(0o755)

    def boot(disk):
        import os
        import subprocess
        env = {**os.environ, "PATH": f"{fake}:/usr/sbin:/sbin:{os.environ['PATH']}"}
        subprocess.run(["sh", "-c", script.replace(seed.SWAP_DEVICE, str(disk))], env=env,
                       check=True, capture_output=True)
        return (tmp_path / "swapon.log").read_text() if (tmp_path / "swapon.log").exists() else ""

    def fstype(disk):
        import subprocess
        return subprocess.run(["blkid", "-o", "value", "-s", "TYPE", str(disk)],
                              capture_output=True, text=True).stdout.strip()

    disk = tmp_path / "swap.img"
    with disk.open("wb") as f:
        f.truncate(8 * 2**20)
    assert boot(disk) == f"{disk}\n" and fstype(disk) == "swap"  # first boot: made, enabled
    made = disk.read_bytes()
    assert boot(disk) == f"{disk}\n{disk}\n" and disk.read_bytes() == made  # not made again
    with disk.open("r+b") as f:  # as the kernel leaves it after writing a hibernation image
        f.seek(4096 - 10)
        f.write(b"S1SUSPEND\0")
    assert fstype(disk) == "swsuspend"
    assert boot(disk).count(str(disk)) == 3 and fstype(disk) == "swap"  # the stale image gone
