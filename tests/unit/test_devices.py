"""Passed-through devices without a hypervisor: parsing, assignment into domain XML (and
re-targeting at another host), free devices, migratability, placement and how a VM would move."""

from pathlib import Path

import pytest

from vmmgr import devices
from vmmgr.devices import Device
from vmmgr.errors import InvalidRequest
from vmmgr.host import Capacity
from vmmgr.movability import how_it_moves
from vmmgr.placement import choose_host, refusal, target_choices
from vmmgr.render import domain_xml
from vmmgr.spec import VMSpec

GPU = Device("0000:65:00.0", "a100-80g")
STANDIN = Device("0000:65:00.0", "lab-gpu", "standin")


def gpu_xml(**over) -> str:
    spec = VMSpec(name="g", memory_mib=256, vcpus=1, kernel=Path("/k"), initrd=None,
                  cmdline="console=ttyS0", gpu_model="a100-80g", gpu_count=1,
                  swap_disk="/s/g-swap.img", **over)
    return domain_xml(spec, accel="kvm", console_path=Path("/c/1-h1.log"))


@pytest.mark.parametrize("text,expected", [
    ("0000:65:00.0=a100-80g", GPU),
    ("0000:65:00.0=lab-gpu:standin", STANDIN),
    ("0000:AB:01.7=x", Device("0000:ab:01.7", "x")),
])
def test_parse(text, expected):
    assert devices.parse(text) == expected


@pytest.mark.parametrize("text", ["0000:65:00.0", "65:00.0=x", "0000:65:00.9=x",
                                  "0000:65:00.0=a'/><x", "0000:65:00.0=x:magic"])
def test_parse_refuses_bad_devices(text):
    with pytest.raises(InvalidRequest):
        devices.parse(text)


def test_a_vm_without_devices_is_live_migratable():
    xml = domain_xml(VMSpec(name="p", memory_mib=128, vcpus=1, kernel=Path("/k"), initrd=None,
                            cmdline=""), accel="tcg", console_path=Path("/c"))
    assert devices.live_migratable(xml) == (True, "no device blocks live migration")
    assert devices.wanted(xml) == ("", 0) and devices.held(xml) == []


def test_assign_adds_a_hostdev_and_records_it_then_retargets():
    xml = devices.assign(gpu_xml(), [GPU], "h1")
    assert devices.wanted(xml) == ("a100-80g", 1) and devices.held(xml) == ["0000:65:00.0"]
    assert "<address domain=\"0x0000\" bus=\"0x65\" slot=\"0x00\" function=\"0x0\"" in xml
    live, why = devices.live_migratable(xml)
    assert not live and "passes through PCI device 0000:65:00.0" in why
    # On another host the element and the record follow that host's device; no duplicate.
    moved = devices.assign(xml, [Device("0000:b1:00.0", "a100-80g")], "h2")
    assert devices.held(moved) == ["0000:b1:00.0"] and moved.count("<hostdev") == 1


def test_the_lab_standin_is_an_ivshmem_peer_that_blocks_migration():
    xml = devices.assign(gpu_xml(), [STANDIN], "host1")
    assert "<shmem name=\"vmmgr-host1-0000-65-00.0\" role=\"peer\">" in xml
    live, why = devices.live_migratable(xml)
    assert not live and "ivshmem" in why


def test_free_devices_and_placement_count_them():
    declared = (GPU, Device("0000:66:00.0", "a100-80g"))
    assert devices.free(declared, {"0000:65:00.0"}) == [declared[1]]
    with_one = Capacity(1024, 8, 0, 0, (), ("a100-80g",))
    assert refusal(with_one, 128, 1, "a100-80g", 1) is None
    assert refusal(with_one, 128, 1, "a100-80g", 2) == "needs 2 a100-80g devices, 1 free"
    assert refusal(with_one, 128, 1, "h100", 1) == "needs 1 h100 device, 0 free"
    none = Capacity(4096, 8, 0, 0, ())
    assert choose_host({"big": none, "gpu": with_one}, 128, 1, "a100-80g", 1)[0] == "gpu"


def test_how_a_vm_with_a_device_would_move():
    hosts = {"h1": ("active", Capacity(1024, 8, 256, 1, ("g",), ())),
             "h2": ("active", Capacity(1024, 8, 0, 0, (), ("a100-80g",))),
             "h3": ("active", Capacity(1024, 8, 0, 0, (), ()))}
    choices = target_choices("h1", 256, 1, hosts, "a100-80g", 1)
    how = how_it_moves(choices, live=False, not_live_because="passes through PCI device x")
    assert how["mode"] == "guest hibernation"
    assert how["reason"].startswith("it passes through PCI device x: never live-migrated")
    assert how["reason"].endswith("boots from its image on h2")
    hosts["h2"] = ("draining", hosts["h2"][1])
    how = how_it_moves(target_choices("h1", 256, 1, hosts, "a100-80g", 1), live=False,
                       not_live_because="passes through PCI device x")
    assert "stays parked until a host can take it" in how["reason"]
    assert "h3: needs 1 a100-80g device, 0 free" in how["reason"]
    # Without devices: live migration where there is room.
    assert how_it_moves(target_choices("h1", 256, 1, hosts))["mode"] == "live migration"


def test_a_swap_disk_is_private_to_its_owner(tmp_path):
    """A hibernation image is the guest's whole memory: 0600, even over an older world-readable
    file of the same name."""
    from types import SimpleNamespace

    from vmmgr.fleet import Fleet

    old = tmp_path / "disks" / "g-swap.img"
    old.parent.mkdir()
    old.write_bytes(b"x")
    old.chmod(0o644)
    fleet = SimpleNamespace(swap_disk_path=lambda vm: tmp_path / "disks" / f"{vm}-swap.img")
    path = Fleet._make_swap_disk(fleet, SimpleNamespace(name="g", memory_mib=64))
    assert path == old and (path.stat().st_mode & 0o777) == 0o600
    assert path.stat().st_size == 128 * 1024 * 1024
