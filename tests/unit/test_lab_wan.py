"""The lab's sites and the WAN between them: which host is in which site, and the shaping."""

import pytest

from vmmgr.lab_wan import Wan, shaping, site_names


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
    netem = next(c for c in cmds if "netem" in c)
    assert netem[netem.index("delay") + 1] == "20ms" and netem[netem.index("rate") + 1] == "200mbit"
    assert "loss" not in netem
    filters = [c for c in cmds if c[1] == "filter"]
    assert [f[f.index("dst") + 1] for f in filters] == ["10.77.0.13/32"]
    assert all(f[-1] == "1:4" for f in filters)  # the netem band, and nothing else goes there


def test_loss_is_shaped_when_asked_for():
    netem = next(c for c in shaping("eth0", ["10.77.0.12"], Wan(40, 100, 0.5)) if "netem" in c)
    assert netem[netem.index("loss") + 1] == "0.5%"


def test_no_wan_or_no_far_host_takes_the_shaping_away():
    assert shaping("eth0", ["10.77.0.13"], None) == [["tc", "qdisc", "del", "dev", "eth0", "root"]]
    assert shaping("eth0", [], Wan()) == [["tc", "qdisc", "del", "dev", "eth0", "root"]]


def test_a_wan_with_no_rate_is_refused():
    with pytest.raises(ValueError):
        Wan(20, 0)
    assert Wan(20, 200, 1).words() == "40 ms RTT at 200 Mbit/s, 1 % loss"
