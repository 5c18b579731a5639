"""Passed-through devices (VFIO GPUs): what hosts declare, what VMs ask for and hold, and whether
a VM can be live-migrated at all.

A host declares its devices in the inventory. A VM asks for `count` devices of one `model`; the
ones it holds are recorded in its domain XML's vmmgr metadata, so a host's free devices are its
declared ones minus those its defined VMs record. Moving such a VM (guest hibernation, never live
migration) re-targets the device elements at the new host's free devices.

In the lab, a "standin" device plays the GPU: an ivshmem-plain device in peer role, which QEMU
refuses to migrate ("Migration is disabled when using feature 'peer mode' in device 'ivshmem'")
and so also refuses to save, exactly like a VFIO device without migration support.
"""

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from .errors import InvalidRequest
from .spec import NAME_RE

XMLNS = "https://vmmgr.dev/xmlns/vm/1"
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"  # libvirt's namespace for QEMU's own options
PCI_RE = re.compile(r"^([0-9a-f]{4}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")
KINDS = ("vfio", "standin")
FIRST_DEVICE_SLOT = 0x10  # guest PCI slot of a VM's first passed-through device


@dataclass(frozen=True)
class Device:
    address: str  # PCI address on its host, e.g. 0000:65:00.0
    model: str  # what a VM asks for, e.g. a100-80g; hosts with equal models are interchangeable
    kind: str = "vfio"

    def __post_init__(self):
        if not PCI_RE.match(self.address):
            raise InvalidRequest(f"device address {self.address!r} is not a PCI address "
                                 "like 0000:65:00.0")
        if not NAME_RE.match(self.model):
            raise InvalidRequest(f"device model {self.model!r}: use letters, digits, '.', '_', '-'")
        if self.kind not in KINDS:
            raise InvalidRequest(f"device kind must be one of {', '.join(KINDS)}")


def parse(text: str) -> Device:
    """ADDRESS=MODEL or ADDRESS=MODEL:KIND, as the CLI takes it."""
    address, sep, rest = text.partition("=")
    model, _, kind = rest.partition(":")
    if not sep:
        raise InvalidRequest(f"a device is ADDRESS=MODEL[:KIND], not {text!r}")
    return Device(address.lower(), model, kind or "vfio")


def held(domain_xml: str) -> list[str]:
    """The device addresses a VM holds on its host (from its metadata)."""
    root = ET.fromstring(domain_xml)
    return [el.get("address") for el in root.findall(f"./metadata/{{{XMLNS}}}vm/{{{XMLNS}}}device")]


def wanted(domain_xml: str) -> tuple[str, int]:
    """(model, count) of the devices a VM asks for; ("", 0) for none."""
    el = ET.fromstring(domain_xml).find(f"./metadata/{{{XMLNS}}}vm/{{{XMLNS}}}gpu")
    return (el.get("model"), int(el.get("count"))) if el is not None else ("", 0)


def free(declared: tuple[Device, ...], held_addresses: set[str]) -> list[Device]:
    return [d for d in declared if d.address not in held_addresses]


def assign(domain_xml: str, devices: list[Device], host: str) -> str:
    """The domain XML holding `devices` (of `host`) instead of whatever it held before."""
    ET.register_namespace("vmmgr", XMLNS)
    ET.register_namespace("qemu", QEMU_NS)
    root = ET.fromstring(domain_xml)
    meta = root.find(f"./metadata/{{{XMLNS}}}vm")
    for el in meta.findall(f"{{{XMLNS}}}device"):
        meta.remove(el)
    devs = root.find("./devices")
    for el in devs.findall("hostdev") + devs.findall("shmem"):
        devs.remove(el)
    for i, d in enumerate(devices):
        ET.SubElement(meta, f"{{{XMLNS}}}device", address=d.address, model=d.model, kind=d.kind)
        el = _element(d, host)
        # The i-th device at the same guest address on every host (see the domain template).
        ET.SubElement(el, "address", type="pci", domain="0x0000", bus="0x00",
                      slot=f"0x{FIRST_DEVICE_SLOT + i:02x}", function="0x0")
        devs.append(el)
    return ET.tostring(root, encoding="unicode")


def _element(d: Device, host: str) -> ET.Element:
    if d.kind == "standin":
        # The shared-memory object is named per host and address: unique on the machine.
        el = ET.Element("shmem", name=f"vmmgr-{host}-{d.address.replace(':', '-')}", role="peer")
        ET.SubElement(el, "model", type="ivshmem-plain")
        ET.SubElement(el, "size", unit="M").text = "4"
        return el
    domain, bus, slot, function = PCI_RE.match(d.address).groups()
    el = ET.Element("hostdev", mode="subsystem", type="pci", managed="yes")
    ET.SubElement(ET.SubElement(el, "source"), "address", domain=f"0x{domain}", bus=f"0x{bus}",
                  slot=f"0x{slot}", function=f"0x{function}")
    return el


def live_migratable(domain_xml: str) -> tuple[bool, str]:
    """Whether QEMU can live-migrate this domain, and why not: decided from the XML before
    anything is tried, so such a VM never enters a live migration (or a host-level save)."""
    devs = ET.fromstring(domain_xml).find("./devices")
    blockers = []
    for el in devs.findall("hostdev"):
        a = el.find("./source/address")
        where = (f"{a.get('domain', '0x0000')[2:]}:{a.get('bus')[2:]}:{a.get('slot')[2:]}."
                 f"{a.get('function')[2:]}" if a is not None else "a host device")
        blockers.append(f"passes through PCI device {where} (VFIO: its state is not in "
                        "QEMU's migration stream)")
    for el in devs.findall("shmem"):
        if el.get("role") == "peer":
            blockers.append(f"has ivshmem device {el.get('name')} in peer role (the lab's GPU "
                            "stand-in: QEMU disables migration for it)")
    if blockers:
        return False, "; ".join(blockers)
    return True, "no device blocks live migration"


# What libvirt/QEMU say when a live migration (or save) is refused because of a device.
BLOCKER_MESSAGES = ("Migration is disabled", "non-migratable device", "hostdev",
                    "cannot migrate a domain with <hostdev", "VFIO device doesn't support migration")


def is_blocker_refusal(message: str) -> bool:
    return any(m.lower() in message.lower() for m in BLOCKER_MESSAGES)
