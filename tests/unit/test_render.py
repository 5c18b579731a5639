"""Golden-file tests of the domain XML. Regenerate on purpose with `pytest --regen-golden`."""

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from vmmgr.render import XMLNS, address_of, domain_xml, group_of, set_console_path
from vmmgr.spec import VMSpec

GOLDEN = Path(__file__).parent.parent / "golden"


def spec(**over) -> VMSpec:
    fields = dict(
        name="web-1", memory_mib=128, vcpus=2,
        kernel=Path("/srv/vmmgr/images/builtin/vmlinuz"),
        initrd=Path("/srv/vmmgr/images/builtin/initramfs.gz"),
        cmdline="console=ttyS0 quiet vmmgr.workload=counter",
        workload="counter", uuid="8d1c7a3e-2b2f-4d8e-9a1b-3c4d5e6f7a8b",
    )
    return VMSpec(**(fields | over))


@pytest.mark.parametrize("case,accel,over", [
    ("counter-tcg", "tcg", {}),
    ("counter-kvm", "kvm", {}),
    ("no-initrd-tcg", "tcg", {"initrd": None, "workload": ""}),
    ("address-tcg", "tcg", {"address": "10.78.0.7", "gateway": "10.78.0.1"}),
    ("gpu-kvm", "kvm", {"gpu_model": "a100-80g", "gpu_count": 1,
                        "swap_disk": "/srv/vmmgr/storage/disks/web-1-swap.img"}),
    ("image-gpu-tcg", "tcg", {"kernel": None, "initrd": None, "cmdline": "", "workload": "",
                              "image": "debian-12", "disk": "/srv/vmmgr/storage/disks/web-1.qcow2",
                              "seed": "/srv/vmmgr/storage/disks/web-1-seed.iso",
                              "address": "10.78.0.7", "gateway": "10.78.0.1",
                              "gpu_model": "a100-80g", "gpu_count": 1,
                              "swap_disk": "/srv/vmmgr/storage/disks/web-1-swap.img"}),
])
def test_domain_xml_matches_golden(case, accel, over, regen_golden):
    xml = domain_xml(spec(**over), accel=accel,
                     console_path=Path("/srv/vmmgr/consoles/web-1/000001-host1.log"))
    golden = GOLDEN / f"domain-{case}.xml"
    if regen_golden:
        golden.write_text(xml)
    assert xml == golden.read_text()


def test_values_are_escaped_even_if_validation_were_bypassed():
    xml = domain_xml(spec(cmdline="a'/><evil/>", name="x"), accel="tcg",
                     console_path=Path("/c/000001-h.log"))
    root = ET.fromstring(xml)
    assert root.find("./os/cmdline").text == "a'/><evil/>"
    assert root.find(".//evil") is None


def test_unknown_accel_is_refused():
    with pytest.raises(ValueError):
        domain_xml(spec(), accel="xen", console_path=Path("/c/1.log"))


def test_set_console_path_moves_serial_and_console_and_keeps_metadata():
    xml = domain_xml(spec(), accel="tcg", console_path=Path("/c/web-1/000001-host1.log"))
    moved = ET.fromstring(set_console_path(xml, Path("/c/web-1/000002-host2.log")))
    paths = {s.get("path") for s in moved.iter("source") if s.get("path")}
    assert paths == {"/c/web-1/000002-host2.log"}
    assert moved.find(f"./metadata/{{{XMLNS}}}vm/{{{XMLNS}}}workload").text == "counter"


def test_the_address_is_in_the_metadata_the_nic_and_the_command_line():
    xml = domain_xml(spec(address="10.78.0.7", gateway="10.78.0.1"), accel="tcg",
                     console_path=Path("/c.log"))
    assert address_of(xml) == "10.78.0.7"
    root = ET.fromstring(xml)
    assert root.find("./devices/interface/mac").get("address") == "52:54:00:4e:00:07"
    assert root.find("./os/cmdline").text.endswith("vmmgr.ip=10.78.0.7 vmmgr.gw=10.78.0.1")
    plain = domain_xml(spec(), accel="tcg", console_path=Path("/c.log"))
    assert address_of(plain) is None and ET.fromstring(plain).find("./devices/interface") is None


def test_a_job_is_kept_in_the_metadata_and_survives_a_console_move():
    xml = domain_xml(spec(group="train-7"), accel="tcg", console_path=Path("/c.log"))
    assert group_of(xml) == "train-7"
    assert group_of(set_console_path(xml, Path("/d.log"))) == "train-7"
    assert group_of(domain_xml(spec(), accel="tcg", console_path=Path("/c.log"))) == ""


def test_every_device_has_its_fixed_guest_pci_slot():
    """So the guest sees the same hardware at the same place on every host (and a passed-through
    device comes back where it was after a move)."""
    from vmmgr import devices
    xml = domain_xml(spec(kernel=None, initrd=None, cmdline="", workload="", image="debian-12",
                          disk="/d.qcow2", seed="/s.iso", address="10.78.0.7",
                          gateway="10.78.0.1", gpu_model="a100-80g", gpu_count=2,
                          swap_disk="/w.img"),
                     accel="tcg", console_path=Path("/c/1.log"))
    held = [devices.Device("0000:65:00.0", "a100-80g"), devices.Device("0000:66:00.0", "a100-80g")]
    for host, addresses in (("h1", held), ("h2", list(reversed(held)))):
        root = ET.fromstring(devices.assign(xml, addresses, host))
        slots = {}
        for el in root.find("./devices"):
            a = el.find("./address")
            if a is not None:
                key = el.find("./target").get("dev") if el.tag == "disk" else f"{el.tag}{len(slots)}"
                slots[key] = (a.get("bus"), a.get("slot"))
        assert slots["vda"] == ("0x00", "0x04") and slots["vdb"] == ("0x00", "0x05")
        assert slots["vdc"] == ("0x00", "0x07")
        assert [v for k, v in slots.items() if k.startswith("hostdev")] == [
            ("0x00", "0x10"), ("0x00", "0x11")]
        assert ("0x00", "0x03") in slots.values() and ("0x00", "0x06") in slots.values()
