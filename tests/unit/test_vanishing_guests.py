"""A host's listing is a moment: a domain listed can be gone when it is read (the incoming twin of
a cancelled migration, a destroyed VM). Readers skip it instead of failing the whole page or plan.
These fake libvirt domains answer like the real ones do for a vanished domain."""

from pathlib import Path
from types import SimpleNamespace

import libvirt
import pytest

from vmmgr.devices import Device
from vmmgr.errors import NotFound, VmmgrError
from vmmgr.fleet import Fleet
from vmmgr.guest import Guest, read_each
from vmmgr.host import Host
from vmmgr.inventory import HostRecord

XML = """<domain type='qemu'><name>{name}</name><metadata>
<vmmgr:vm xmlns:vmmgr='https://vmmgr.dev/xmlns/vm/1'>{held}</vmmgr:vm></metadata><devices/></domain>"""


def no_domain() -> libvirt.libvirtError:
    err = libvirt.libvirtError("Domain not found")
    err.err = (libvirt.VIR_ERR_NO_DOMAIN, libvirt.VIR_FROM_QEMU, "Domain not found: no domain",
               2, None, None, None, 0, 0)
    return err


def domain(mocker, name: str, mib: int, gone: bool = False, held: str = ""):
    dom = mocker.Mock(spec=libvirt.virDomain)
    dom.name.return_value = name
    read = dict(maxMemory=mib * 1024, info=[1, mib * 1024, mib * 1024, 1, 0], isPersistent=1,
                state=[libvirt.VIR_DOMAIN_RUNNING, 1], hasCurrentSnapshot=0,
                XMLDesc=XML.format(name=name, held=held))
    for method, value in read.items():
        getattr(dom, method).side_effect = no_domain() if gone else None
        getattr(dom, method).return_value = value
    return dom


def host_with(mocker, *domains, devices=()) -> Host:
    host = Host(HostRecord("h1", "test:///default", accel="qemu", memory_mib=1024, vcpus=2,
                           devices=devices))
    conn = mocker.Mock(spec=libvirt.virConnect)
    conn.getInfo.return_value = ["x86_64", 2048, 2, 0, 0, 0, 0, 0]
    conn.listAllDomains.return_value = list(domains)
    host._conn = conn
    return host


def test_read_each_skips_only_the_vanished(mocker):
    alive, gone = domain(mocker, "a", 128), domain(mocker, "b", 128, gone=True)
    guests = [Guest(alive, "h1"), Guest(gone, "h1")]
    assert read_each(guests, lambda g: (g.name, g.memory_mib())) == [("a", 128)]


def test_read_each_still_raises_other_errors(mocker):
    broken = domain(mocker, "a", 128)
    err = libvirt.libvirtError("internal error")
    err.err = (libvirt.VIR_ERR_INTERNAL_ERROR, libvirt.VIR_FROM_QEMU, "boom", 2, None, None, None,
               0, 0)
    broken.maxMemory.side_effect = err
    with pytest.raises(VmmgrError) as raised:
        read_each([Guest(broken, "h1")], lambda g: g.memory_mib())
    assert not isinstance(raised.value, NotFound)


def test_capacity_counts_what_is_still_there(mocker):
    gpu = Device("0000:65:00.0", "lab-gpu", "standin")
    host = host_with(mocker, domain(mocker, "a", 128),
                     domain(mocker, "twin", 256, gone=True,
                            held="<vmmgr:device address='0000:65:00.0'/>"),
                     devices=(gpu,))
    cap = host.capacity()
    assert (cap.used_memory_mib, cap.used_vcpus, cap.vms) == (128, 1, ("a",))
    assert cap.free_devices == ("lab-gpu",)  # the vanished twin held it; now nothing does
    assert host.free_devices("lab-gpu") == [gpu]


def test_fleet_listing_skips_a_vanished_domain(mocker):
    host = host_with(mocker, domain(mocker, "a", 128), domain(mocker, "twin", 256, gone=True))
    fleet = Fleet.__new__(Fleet)
    fleet.paths = SimpleNamespace(storage=Path("/srv/vmmgr/storage"))
    mocker.patch.object(Fleet, "hosts", return_value=[host])
    assert [(i.name, i.host, i.memory_mib) for i in fleet.vms()] == [("a", "h1", 128)]
