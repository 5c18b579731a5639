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
