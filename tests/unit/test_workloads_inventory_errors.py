import libvirt
import pytest

from vmmgr.errors import Conflict, HostUnreachable, InvalidRequest, NotFound, VmmgrError
from vmmgr.inventory import HostRecord, Inventory
from vmmgr.libvirt_errors import translate
from vmmgr.state import FleetState
from vmmgr.workloads import cmdline


def test_counter_cmdline():
    line = cmdline("counter", {"interval": "0.5", "count": "10"})
    assert line.endswith("vmmgr.workload=counter vmmgr.interval=0.5 vmmgr.count=10")
    assert "console=ttyS0" in line and "quiet" in line


@pytest.mark.parametrize("workload,params,match", [
    ("mine", {}, "unknown workload"),
    ("counter", {"speed": "1"}, "no parameter"),
    ("counter", {"count": "ten"}, "not a whole number"),
    ("counter", {"interval": "-1"}, "not a number from 0.01"),
    # strict numbers: what float() and int() take but a guest must never get
    ("counter", {"interval": "nan"}, "not a number"),
    ("counter", {"interval": "inf"}, "not a number"),
    ("counter", {"interval": "1e3"}, "not a number"),
    ("counter", {"count": "1" * 200}, "not a whole number"),
    ("counter", {"count": "\u00b2"}, "not a whole number"),  # a superscript two: isdigit() says yes
    ("counter", {"count": "\u0663"}, "not a whole number"),  # an Arabic-Indic three: int() takes it
    ("server", {"port": "99999"}, "from 1 to 65535"),
    ("server", {"port": "0"}, "from 1 to 65535"),
    ("fetch", {"from": "10.0.0.1:\u0668\u0660"}, "not IP:PORT"),
])
def test_bad_workloads(workload, params, match):
    with pytest.raises(InvalidRequest, match=match):
        cmdline(workload, params)


def test_inventory_round_trip_and_refusals(redis_url):
    inv = Inventory(FleetState(redis_url).r)
    inv.add(HostRecord("host1", "qemu+tls://h1/system"))
    inv.add(HostRecord("lab1", "qemu+tcp://10.0.0.1/system", "tcg", 1024, 4, lab=True))
    assert inv.get("lab1").memory_mib == 1024
    with pytest.raises(Conflict):
        inv.add(HostRecord("host1", "x"))
    with pytest.raises(NotFound, match="unknown host 'nope' \\(known hosts: host1, lab1\\)"):
        inv.get("nope")
    with pytest.raises(InvalidRequest):
        inv.add(HostRecord("bad'/>", "x"))
    inv.add(HostRecord("host10", "x"))
    assert [r.name for r in inv.records()] == ["host1", "host10", "lab1"]
    inv.add(HostRecord("host2", "x"))
    assert [r.name for r in inv.records()] == ["host1", "host2", "host10", "lab1"]
    inv.remove({"lab1", "host10", "host2"})
    assert [r.name for r in inv.records()] == ["host1"]


def test_a_fleet_names_a_site_for_every_host_or_for_none(redis_url):
    """A save or a reclaim goes to its host's site's workers: a host of no site in a fleet of
    named ones (or the reverse) would have its requests refused by every worker."""
    inv = Inventory(FleetState(redis_url).r)
    inv.add(HostRecord("h1", "x", site="east"))  # the first names it for the fleet
    inv.add(HostRecord("h2", "x", site="west"))
    with pytest.raises(InvalidRequest, match="host h3: the fleet's hosts name their sites "
                       r"\(h1, h2\): give it one with --site"):
        inv.add(HostRecord("h3", "x"))
    inv.remove({"h1", "h2"})
    inv.add(HostRecord("h1", "x"))
    with pytest.raises(InvalidRequest, match="host h2: the fleet's hosts name no site"):
        inv.add(HostRecord("h2", "x", site="west"))
    assert [(r.name, r.site) for r in inv.records()] == [("h1", "")]
    inv.add(HostRecord("h2", "x", site="west"), replace=True)  # the lab's regrouping: its own


def libvirt_error(code_name: str, domain_name: str = "VIR_FROM_QEMU"):
    err = libvirt.libvirtError("boom")
    err.err = (getattr(libvirt, code_name), getattr(libvirt, domain_name), "boom msg",
               2, None, None, None, 0, 0)
    return err


@pytest.mark.parametrize("code,domain,kind", [
    ("VIR_ERR_NO_DOMAIN", "VIR_FROM_QEMU", NotFound),
    ("VIR_ERR_OPERATION_INVALID", "VIR_FROM_QEMU", Conflict),
    ("VIR_ERR_SYSTEM_ERROR", "VIR_FROM_RPC", HostUnreachable),
    ("VIR_ERR_INTERNAL_ERROR", "VIR_FROM_QEMU", VmmgrError),
])
def test_translate(code, domain, kind):
    translated = translate(libvirt_error(code, domain), "look up vm")
    assert type(translated) is kind
    assert str(translated) == "look up vm: boom msg"
