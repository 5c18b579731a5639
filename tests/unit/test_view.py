"""The fleet view's pure parts: host rows from VM rows, and how each VM would move, computed once
per VM size (and the same answer as the one-VM function gives)."""

import random

from vmmgr import view
from vmmgr.devices import Device
from vmmgr.host import Capacity
from vmmgr.inventory import HostRecord
from vmmgr.movability import MovesIndex, how_it_moves
from vmmgr.placement import target_choices


def vm(name, host, mib=128, vcpus=1, held=(), state="running"):
    return {"name": name, "host": host, "state": state, "memory_mib": mib, "vcpus": vcpus,
            "workload": "counter", "device_model": "", "device_count": 0, "live": True,
            "not_live_because": "", "address": "", "held": list(held)}


def test_host_rows_count_the_vms_on_each_host_and_the_devices_they_hold():
    records = [HostRecord("h1", "u1", memory_mib=1024, vcpus=8,
                          devices=(Device("0000:65:00.0", "gpu"), Device("0000:66:00.0", "gpu"))),
               HostRecord("h2", "u2", state="draining"),  # totals come from the snapshot
               HostRecord("h3", "u3")]  # never seen by a reconcile: no totals known
    snapshot = {"h2": {"reachable": True, "memory_mib": 2048, "vcpus": 4}}
    rows = [vm("a", "h1", 256, 2, held=["0000:65:00.0"]), vm("b", "h1"), vm("c", "h2", 512),
            vm("d", "-", 128, state="parked")]
    h1, h2, h3 = view.host_rows(records, snapshot, rows)
    assert (h1["used_memory_mib"], h1["used_vcpus"], h1["vms"]) == (384, 3, ["a", "b"])
    assert h1["free_memory_mib"] == 640 and h1["free_devices"] == ["gpu"]
    assert (h2["memory_mib"], h2["free_memory_mib"], h2["state"]) == (2048, 1536, "draining")
    assert h3["reachable"] is False and "reconcile" in h3["error"]


def _fleet(n_hosts, seed=1):
    rnd = random.Random(seed)
    hosts = {}
    for i in range(n_hosts):
        used = rnd.choice([0, 256, 512, 896, 1024])
        hosts[f"h{i}"] = ("active" if i % 7 else "draining",
                          Capacity(1024, 8, used, used // 128, (), ()) if i % 11 else None)
    return hosts


def test_the_index_answers_as_the_one_vm_function_on_small_fleets():
    hosts = _fleet(6)
    index = MovesIndex(hosts)
    for own in hosts:
        for mib in (128, 512, 1024):
            expected = how_it_moves(target_choices(own, mib, 1, hosts))
            assert index.moves(own, mib, 1) == expected, (own, mib)
    expected = how_it_moves(target_choices("h1", 128, 1, hosts), False, "has a GPU")
    assert index.moves("h1", 128, 1, live=False, not_live_because="has a GPU") == expected


def test_on_a_large_fleet_the_first_hosts_are_named_and_the_rest_counted():
    hosts = _fleet(1000)
    index = MovesIndex(hosts)
    fits = [c["host"] for c in target_choices("h3", 128, 1, hosts) if c["ok"]]
    moves = index.moves("h3", 128, 1)
    assert moves["mode"] == "live migration"
    assert moves["reason"] == f"fits on {', '.join(fits[:5])} and {len(fits) - 5} more"
    nowhere = index.moves("h3", 4096, 1)
    assert nowhere["mode"] == "suspend to disk" and nowhere["reason"].endswith("and 994 more hosts)")


def test_capacities_straight_from_the_rows_match_the_host_rows():
    from vmmgr.overview import capacities
    records = [HostRecord("h1", "u1", memory_mib=1024, vcpus=8,
                          devices=(Device("0000:65:00.0", "gpu"), Device("0000:66:00.0", "gpu"))),
               HostRecord("h2", "u2", state="draining"), HostRecord("h3", "u3")]
    snapshot = {"h2": {"reachable": True, "memory_mib": 2048, "vcpus": 4}}
    rows = [vm("a", "h1", 256, 2, held=["0000:65:00.0"]), vm("b", "h1"), vm("c", "h2", 512),
            vm("d", "-", 128, state="parked")]
    direct = view.capacities(records, snapshot, rows)
    via_rows = capacities(view.host_rows(records, snapshot, rows))
    for name in ("h1", "h2", "h3"):
        state, cap = direct[name]
        state2, cap2 = via_rows[name]
        assert state == state2 and (cap is None) == (cap2 is None)
        if cap:
            assert (cap.memory_mib, cap.vcpus, cap.used_memory_mib, cap.used_vcpus,
                    cap.free_devices) == (cap2.memory_mib, cap2.vcpus, cap2.used_memory_mib,
                                          cap2.used_vcpus, tuple(cap2.free_devices))
