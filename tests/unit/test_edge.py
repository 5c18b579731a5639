"""The edge's route bookkeeping over `wg`'s output (the lab tests drive a real wireguard-go), and
the safety of the commands sent to it."""

import json

import pytest

from vmmgr.addresses import AddressPool
from vmmgr.edge import HOLD_OUT_MAC, Edge, EdgeConfig, Peer, hold_gateway, host_address
from vmmgr.errors import InvalidRequest, VmmgrError
from vmmgr.paths import Paths
from vmmgr.state import FleetState

PEERS = {"host1": Peer("K1", "10.79.0.11", "10.77.0.11:51820"),
         "host2": Peer("K2", "10.79.0.12", "10.77.0.12:51820")}
EVIL = "10.78.0.9;id>edge-pwned;#"


@pytest.fixture
def store(redis_url):
    return FleetState(redis_url)


def edge(store, mocker, allowed: str):
    e = Edge(EdgeConfig(["true"], "wg-edge", PEERS), store)
    calls = []

    def wg(*args):
        calls.append(args)
        return allowed if args[0] == "show" else ""

    mocker.patch.object(e, "_wg", side_effect=wg)
    return e, calls


def test_routes_leave_out_the_tunnel_addresses(store, mocker):
    e, _ = edge(store, mocker, "K1\t10.79.0.11/32 10.78.0.2/32\nK2\t10.79.0.12/32\n")
    assert e.routes() == {"10.78.0.2": "host1"}


def test_a_move_sets_the_new_hosts_whole_list(store, mocker):
    e, calls = edge(store, mocker, "K1\t10.79.0.11/32 10.78.0.2/32\nK2\t10.79.0.12/32 10.78.0.5/32\n")
    e.route("10.78.0.2", "host2")
    # One `wg set` on the new peer: WireGuard takes the address from the old one itself.
    assert calls[-1] == ("set", "wg-edge", "peer", "K2", "allowed-ips",
                         "10.79.0.12/32,10.78.0.2/32,10.78.0.5/32")
    assert store.holder("edge", "routes") is None  # the store's lock was given back


def test_sync_changes_only_the_peers_that_differ(store, mocker):
    e, calls = edge(store, mocker, "K1\t10.79.0.11/32 10.78.0.2/32\nK2\t10.79.0.12/32\n")
    assert e.sync({"10.78.0.2": "host1", "10.78.0.3": "host2"}) == ["host2"]
    assert calls[-1][-1] == "10.79.0.12/32,10.78.0.3/32"


@pytest.mark.parametrize("bad", [EVIL, "10.78.0.9/32", "10.78.9", "010.78.0.9", " 10.78.0.9",
                                 "::1", "", "10.78.0.256"])
def test_anything_but_one_address_is_refused_before_any_command(store, mocker, bad):
    e, calls = edge(store, mocker, "K1\t10.79.0.11/32\n")
    with pytest.raises(InvalidRequest, match="not an IPv4 address"):
        host_address(bad)
    with pytest.raises(InvalidRequest):
        e.route(bad, "host1")
    with pytest.raises(InvalidRequest):
        e.sync({bad: "host1"})
    assert calls == []


def test_an_allocation_named_like_a_command_is_no_allocation(redis_url):
    import redis

    from vmmgr.addresses import KEY
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    r.hset(KEY, mapping={"10.78.0.5": "vm1", EVIL: "vm2", "10.99.0.1": "vm3"})  # last: not ours
    assert AddressPool(r, "10.78.0.0/24", "10.78.0.1").in_use() == {"10.78.0.5": "vm1"}


def test_an_ssh_prefix_gets_every_argument_quoted_for_the_edges_shell(store, tmp_path,
                                                                     monkeypatch):
    """A stand-in `ssh` that does what ssh's far side does: joins its arguments into one line and
    hands it to a shell. Unquoted, the interface name below would run `touch` on the "edge"."""
    edge_dir = tmp_path / "edge"
    edge_dir.mkdir()
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nshift\ncd "$EDGE_DIR" && PATH="$EDGE_DIR:$PATH" exec sh -c "$*"\n')
    fake.chmod(0o755)
    (edge_dir / "wg").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > args\n')
    (edge_dir / "wg").chmod(0o755)
    monkeypatch.setenv("EDGE_DIR", str(edge_dir))
    e = Edge(EdgeConfig([str(fake), "edge1"], "wg0;touch pwned;#", PEERS), store)
    e.route("10.78.0.7", "host1")
    assert not (edge_dir / "pwned").exists()
    assert (edge_dir / "args").read_text().splitlines() == [
        "set", "wg0;touch pwned;#", "peer", "K1", "allowed-ips", "10.79.0.11/32,10.78.0.7/32"]


def holding_edge(store, mocker, command=("true",)):
    e = Edge(EdgeConfig(list(command), "wg-edge", PEERS, hold_interface="vmhold"), store)
    calls = []
    mocker.patch.object(e, "_run", side_effect=lambda *a: calls.append(a) or "")
    return e, calls


def test_a_hold_routes_the_address_into_the_hold_interface_through_its_own_next_hop(store,
                                                                                  mocker):
    e, calls = holding_edge(store, mocker)
    e.hold("10.78.1.7")
    # The address's low 16 bits name its next hop: another VM's release never sends this one's.
    assert calls == [("ip", "route", "replace", "10.78.1.7/32", "via", "169.254.1.7", "dev",
                      "vmhold", "onlink")]
    assert hold_gateway("10.78.0.2") == "169.254.0.2" != hold_gateway("10.78.1.2")


def test_a_release_reroutes_first_then_sends_the_queue_in_one_round_trip(store, mocker):
    e, calls = holding_edge(store, mocker)
    e.release("10.78.0.2")
    [(sh, flag, script)] = calls
    assert (sh, flag) == ("sh", "-c")
    route, neigh = script.index("ip route del 10.78.0.2/32 dev vmhold"), script.index(
        f"ip neigh replace 169.254.0.2 lladdr {HOLD_OUT_MAC} dev vmhold nud permanent")
    assert route < neigh and script.endswith("ip neigh del 169.254.0.2 dev vmhold")


def test_an_edge_without_a_hold_interface_cannot_hold_and_bad_input_runs_nothing(store, mocker):
    e, calls = edge(store, mocker, "")
    assert not e.can_hold and e.held() == []
    with pytest.raises(VmmgrError, match="cannot hold"):
        e.hold("10.78.0.2")
    e, calls = holding_edge(store, mocker)
    with pytest.raises(InvalidRequest):
        e.release(EVIL)
    bad = Edge(EdgeConfig(["true"], "wg-edge", PEERS, hold_interface="vm;hold"), store)
    with pytest.raises(VmmgrError, match="not an interface name"):
        bad.hold("10.78.0.2")
    assert calls == []


def test_the_held_addresses_are_read_from_the_hold_interfaces_routes(store, mocker):
    e = Edge(EdgeConfig(["true"], "wg-edge", PEERS, hold_interface="vmhold"), store)
    mocker.patch.object(e, "_run", return_value="10.78.0.2 via 169.254.0.2 onlink \n"
                                                 "10.78.0.9 via 169.254.0.9 onlink \n")
    assert e.held() == ["10.78.0.2", "10.78.0.9"]


def test_an_old_edge_description_without_a_hold_still_loads(tmp_path):
    paths = Paths(tmp_path)
    (tmp_path / "edge.json").write_text(json.dumps(
        {"command": ["true"], "interface": "wg0", "peers": {}}))
    assert EdgeConfig.load(paths).hold_interface == ""
