"""The lab's management-network MACs are fixed: a rebuilt host or edge keeps its own."""

from vmmgr.edge import HOLD_OUT_MAC
from vmmgr.lab import BRIDGE_MAC, GUEST_GATEWAY_MAC, host_mac
from vmmgr.lab_net import EDGE_MAC


def test_every_lab_nic_has_its_own_fixed_locally_administered_unicast_mac():
    macs = [host_mac(i) for i in range(1, 10)] + [BRIDGE_MAC, EDGE_MAC]
    assert len(set(macs + [GUEST_GATEWAY_MAC, HOLD_OUT_MAC])) == len(macs) + 2
    for mac in macs:
        first = int(mac.split(":")[0], 16)
        assert len(mac.split(":")) == 6 and first & 0b10 and not first & 0b1, mac
    assert host_mac(2) == host_mac(2) != host_mac(3)
