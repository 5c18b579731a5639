"""The address pool: unique under concurrency, kept until released, a clear error when empty."""

import threading

import pytest

from vmmgr.addresses import AddressPool, mac_for
from vmmgr.errors import Conflict, InvalidRequest


def test_addresses_skip_the_gateway_and_are_kept_per_vm(tmp_path):
    pool = AddressPool(tmp_path, "10.9.0.0/29", "10.9.0.1")
    assert pool.allocate("a") == "10.9.0.2"
    assert pool.allocate("b") == "10.9.0.3"
    assert pool.allocate("a") == "10.9.0.2"  # asking again changes nothing
    assert pool.release("a") == "10.9.0.2"
    assert pool.address_of("a") is None
    assert pool.allocate("c") == "10.9.0.2"  # freed, handed out again


def test_concurrent_creates_never_share_an_address(tmp_path):
    pool = AddressPool(tmp_path, "10.9.0.0/24", "10.9.0.1")
    got, barrier = {}, threading.Barrier(40)

    def take(i):
        barrier.wait()
        got[i] = AddressPool(tmp_path, "10.9.0.0/24", "10.9.0.1").allocate(f"vm{i}")

    threads = [threading.Thread(target=take, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got.values())) == 40
    assert pool.in_use() == {ip: f"vm{i}" for i, ip in got.items()}


def test_an_exhausted_pool_refuses_clearly(tmp_path):
    pool = AddressPool(tmp_path, "10.9.0.0/30", "10.9.0.1")  # two hosts: gateway and one VM
    pool.allocate("a")
    with pytest.raises(Conflict, match=r"address pool 10.9.0.0/30 is exhausted: all 1 addresses"):
        pool.allocate("b")
    assert pool.address_of("b") is None


def test_a_bad_pool_is_refused(tmp_path):
    with pytest.raises(InvalidRequest):
        AddressPool(tmp_path, "10.9.0.0/33", "10.9.0.1")


def test_macs_follow_addresses():
    assert mac_for("10.78.0.7") == "52:54:00:4e:00:07"
    assert mac_for("10.78.1.7") != mac_for("10.78.0.7")
