"""The lab's sites and the WAN between them: which host is in which site, and the shaping."""

import pytest

from vmmgr.lab_wan import Wan, latency, shaping, site_names


def test_consecutive_hosts_share_a_site_as_evenly_as_may_be():
    assert site_names(3, 2) == ["site1", "site1", "site2"]
    assert site_names(4, 2) == ["site1", "site1", "site2", "site2"]
    assert site_names(3, 3) == ["site1", "site2", "site3"]
    assert site_names(3, 1) == ["", "", ""]  # one site: the fleet names none


def test_a_site_without_a_host_is_refused():
    with pytest.raises(ValueError, match="each site needs a host"):
        site_names(2, 3)


def test_only_the_far_hosts_are_sent_over_the_wan():
    cmds = shaping("eth0", ["10.77.0.13"], Wan(20, 200))
    assert cmds[0] == ["tc", "qdisc", "del", "dev", "eth0", "root"]
    wan_class = next(c for c in cmds if "1:20" in c and c[1] == "class")
    assert wan_class[wan_class.index("rate") + 1] == "200mbit"
    root = next(c for c in cmds if c[1] == "qdisc" and "root" in c and c[2] == "add")
    assert root[root.index("default") + 1] == "10"  # everything else: the LAN class
    filters = [c for c in cmds if c[1] == "filter"]
    assert [f[f.index("dst") + 1] for f in filters] == ["10.77.0.13/32"]
    assert all(f[-1] == "1:20" for f in filters)  # the WAN class, and nothing else goes there


def test_the_latency_and_loss_go_under_the_wan_class():
    delay = latency("eth0", Wan(20, 200))
    assert delay[delay.index("parent") + 1] == "1:20" and "netem" in delay
    assert delay[delay.index("delay") + 1] == "20ms" and "loss" not in delay
    lossy = latency("eth0", Wan(40, 100, 0.5))
    assert lossy[lossy.index("loss") + 1] == "0.5%"
    assert latency("eth0", Wan(0, 100)) is None  # a rate alone needs no netem


def test_no_wan_or_no_far_host_takes_the_shaping_away():
    assert shaping("eth0", ["10.77.0.13"], None) == [["tc", "qdisc", "del", "dev", "eth0", "root"]]
    assert shaping("eth0", [], Wan()) == [["tc", "qdisc", "del", "dev", "eth0", "root"]]


def test_a_wan_with_no_rate_is_refused():
    with pytest.raises(ValueError):
        Wan(20, 0)
    assert Wan(20, 200, 1).words() == "40 ms RTT at 200 Mbit/s, 1 % loss"
