from vmmgr.host import Capacity
from vmmgr.placement import choose_host, refusal


def cap(memory=1024, used=0, vcpus=4, used_vcpus=0):
    return Capacity(memory, vcpus, used, used_vcpus, ())


def test_fits_exactly():
    assert refusal(cap(memory=1024, used=896), 128, 1) is None


def test_memory_is_never_overcommitted():
    assert "needs 256 MiB, 128 MiB free of 1024 MiB" == refusal(cap(used=896), 256, 1)


def test_vcpu_budget():
    assert "needs 2 vCPUs, 1 free of 4" == refusal(cap(used_vcpus=3), 128, 2)


def test_choose_host_with_most_room_and_explain_the_rest():
    chosen, refused = choose_host(
        {"a": cap(used=512), "b": cap(used=128), "c": cap(used=1000)}, 128, 1)
    assert chosen == "b"
    assert refused == {"c": "needs 128 MiB, 24 MiB free of 1024 MiB"}


def test_choose_host_none_fits():
    chosen, refused = choose_host({"a": cap(used=1024)}, 128, 1)
    assert chosen is None and set(refused) == {"a"}


def test_a_host_in_the_same_site_comes_before_a_roomier_one_elsewhere():
    sites = {"a1": "east", "a2": "east", "b1": "west"}
    caps = {"a1": cap(used=768), "a2": cap(used=512), "b1": cap(used=0)}
    assert choose_host(caps, 128, 1, site_of=sites, near="east")[0] == "a2"
    assert choose_host(caps, 128, 1, site_of=sites, near="west")[0] == "b1"
    assert choose_host(caps, 128, 1)[0] == "b1"  # no site asked for: the most room


def test_another_site_only_when_the_own_one_is_full():
    sites = {"a1": "east", "b1": "west"}
    chosen, refused = choose_host({"a1": cap(used=1000), "b1": cap(used=512)}, 128, 1,
                                  site_of=sites, near="east")
    assert chosen == "b1" and set(refused) == {"a1"}


def test_hosts_of_a_fleet_that_names_no_site_are_all_near():
    caps = {"a": cap(used=512), "b": cap(used=128)}
    assert choose_host(caps, 128, 1, site_of={"a": "", "b": ""}, near="")[0] == "b"
