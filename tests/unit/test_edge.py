"""The edge's route bookkeeping over `wg`'s output (the lab tests drive a real wireguard-go)."""

from vmmgr.edge import Edge, EdgeConfig, Peer
from vmmgr.paths import Paths

PEERS = {"host1": Peer("K1", "10.79.0.11", "10.77.0.11:51820"),
         "host2": Peer("K2", "10.79.0.12", "10.77.0.12:51820")}


def edge(tmp_path, mocker, allowed: str):
    e = Edge(EdgeConfig(["true"], "wg-edge", PEERS), Paths(tmp_path))
    calls = []

    def wg(*args):
        calls.append(args)
        return allowed if args[0] == "show" else ""

    mocker.patch.object(e, "_wg", side_effect=wg)
    return e, calls


def test_routes_leave_out_the_tunnel_addresses(tmp_path, mocker):
    e, _ = edge(tmp_path, mocker, "K1\t10.79.0.11/32 10.78.0.2/32\nK2\t10.79.0.12/32\n")
    assert e.routes() == {"10.78.0.2": "host1"}


def test_a_move_sets_the_new_hosts_whole_list(tmp_path, mocker):
    e, calls = edge(tmp_path, mocker, "K1\t10.79.0.11/32 10.78.0.2/32\nK2\t10.79.0.12/32 10.78.0.5/32\n")
    e.route("10.78.0.2", "host2")
    # One `wg set` on the new peer: WireGuard takes the address from the old one itself.
    assert calls[-1] == ("set", "wg-edge", "peer", "K2", "allowed-ips",
                         "10.79.0.12/32,10.78.0.2/32,10.78.0.5/32")


def test_sync_changes_only_the_peers_that_differ(tmp_path, mocker):
    e, calls = edge(tmp_path, mocker, "K1\t10.79.0.11/32 10.78.0.2/32\nK2\t10.79.0.12/32\n")
    assert e.sync({"10.78.0.2": "host1", "10.78.0.3": "host2"}) == ["host2"]
    assert calls[-1][-1] == "10.79.0.12/32,10.78.0.3/32"
