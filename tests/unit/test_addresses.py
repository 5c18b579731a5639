"""The address pool, in a real (throwaway) Redis: unique under concurrency, kept until released,
a clear error when empty, files of an older vmmgr moved in."""

import threading

import pytest
import redis

from vmmgr.addresses import KEY, AddressPool, mac_for
from vmmgr.errors import Conflict, InvalidRequest


@pytest.fixture
def r(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def test_addresses_skip_the_gateway_and_are_kept_per_vm(r):
    pool = AddressPool(r, "10.9.0.0/29", "10.9.0.1")
    assert pool.allocate("a") == "10.9.0.2"
    assert pool.allocate("b") == "10.9.0.3"
    assert pool.allocate("a") == "10.9.0.2"  # asking again changes nothing
    assert r.hgetall(KEY) == {"10.9.0.2": "a", "10.9.0.3": "b"}  # in the store, not on a disk
    assert pool.release("a") == "10.9.0.2"
    assert pool.address_of("a") is None
    assert pool.allocate("c") == "10.9.0.2"  # freed, handed out again


def test_concurrent_creates_never_share_an_address(redis_url):
    got, barrier = {}, threading.Barrier(40)

    def take(i):
        client = redis.Redis.from_url(redis_url, decode_responses=True)  # a node of its own
        barrier.wait()
        got[i] = AddressPool(client, "10.9.0.0/24", "10.9.0.1").allocate(f"vm{i}")

    threads = [threading.Thread(target=take, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got.values())) == 40
    pool = AddressPool(redis.Redis.from_url(redis_url, decode_responses=True), "10.9.0.0/24",
                       "10.9.0.1")
    assert pool.in_use() == {ip: f"vm{i}" for i, ip in got.items()}


def test_an_exhausted_pool_refuses_clearly(r):
    pool = AddressPool(r, "10.9.0.0/30", "10.9.0.1")  # two hosts: gateway and one VM
    pool.allocate("a")
    with pytest.raises(Conflict, match=r"address pool 10.9.0.0/30 is exhausted: all 1 addresses"):
        pool.allocate("b")
    assert pool.address_of("b") is None


def test_a_late_release_never_frees_an_address_that_passed_to_another_vm(r):
    pool = AddressPool(r, "10.9.0.0/29", "10.9.0.1")
    ip = pool.allocate("a")
    r.hset(KEY, ip, "b")  # freed and taken by b ...
    pool.in_use = lambda: {ip: "a"}  # ... after a's release looked its address up
    assert pool.release("a") == ip
    assert r.hget(KEY, ip) == "b"


def test_a_claim_records_a_running_vms_address_or_names_who_holds_it(r):
    pool = AddressPool(r, "10.9.0.0/29", "10.9.0.1")
    assert pool.claim("10.9.0.5", "a") is None and pool.address_of("a") == "10.9.0.5"
    assert pool.claim("10.9.0.5", "a") is None  # again: nothing changes
    assert pool.claim("10.9.0.5", "b") == "a"
    assert pool.in_use() == {"10.9.0.5": "a"}
    for bad in ("10.9.0.1", "10.10.0.5", "10.9.0.5; reboot"):
        with pytest.raises(InvalidRequest):
            pool.claim(bad, "c")


def test_entries_not_of_the_pool_are_no_allocation(r):
    r.hset(KEY, mapping={"10.9.0.5": "vm1", "10.9.0.5;reboot": "vm2", "10.99.0.1": "vm3"})
    assert AddressPool(r, "10.9.0.0/24", "10.9.0.1").in_use() == {"10.9.0.5": "vm1"}


def test_the_files_of_an_older_vmmgr_move_into_the_store_once(r, tmp_path):
    root = tmp_path / "addresses"
    root.mkdir()
    (root / "10.9.0.2").write_text("old1\n")
    (root / "10.9.0.3").write_text("old2\n")
    pool = AddressPool(r, "10.9.0.0/24", "10.9.0.1")
    assert pool.import_files(root) == 2 and not root.exists()
    assert pool.in_use() == {"10.9.0.2": "old1", "10.9.0.3": "old2"}
    assert pool.allocate("new") == "10.9.0.4"  # the imported ones are taken
    assert pool.import_files(root) == 0


def test_an_old_file_that_clashes_or_is_half_written_stays_for_the_operator(r, tmp_path):
    root = tmp_path / "addresses"
    root.mkdir()
    r.hset(KEY, "10.9.0.2", "newer")
    (root / "10.9.0.2").write_text("older\n")  # the store gives it to another VM
    (root / "10.9.0.3").write_text("")  # its writer had not written the name yet
    (root / "not-an-address").write_text("x\n")
    pool = AddressPool(r, "10.9.0.0/24", "10.9.0.1")
    assert pool.import_files(root) == 0
    assert sorted(p.name for p in root.iterdir()) == ["10.9.0.2.conflict", "10.9.0.3",
                                                      "not-an-address"]
    assert pool.in_use() == {"10.9.0.2": "newer"}
    (root / "10.9.0.3").write_text("late\n")
    assert pool.import_files(root) == 1 and pool.address_of("late") == "10.9.0.3"


def test_a_bad_pool_is_refused(r):
    with pytest.raises(InvalidRequest):
        AddressPool(r, "10.9.0.0/33", "10.9.0.1")


def test_macs_follow_addresses():
    assert mac_for("10.78.0.7") == "52:54:00:4e:00:07"
    assert mac_for("10.78.1.7") != mac_for("10.78.0.7")
