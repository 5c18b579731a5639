"""REST API through Flask's test client: auth, roles, bad input and refusals (all real, against an
empty inventory and a private Redis), and the queued-task path with the fleet check stubbed."""

import pytest

from vmmgr import os_images
from vmmgr.requests import Request
from vmmgr.state import FleetState
from webui.openapi import document

GETS = ["/api/v1/images", "/api/v1/hosts", "/api/v1/hosts/host1", "/api/v1/vms", "/api/v1/vms/vm1",
        "/api/v1/vms/vm1/targets", "/api/v1/vms/vm1/migrations", "/api/v1/vms/vm1/ssh",
        "/api/v1/tasks",
        "/api/v1/tasks/abc", "/api/v1/events"]
ACTIONS = [("post", "/api/v1/hosts/host1/drain"), ("post", "/api/v1/hosts/host1/reclaim"),
           ("post", "/api/v1/hosts/host1/enable"), ("post", "/api/v1/vms"),
           ("delete", "/api/v1/vms/vm1"), ("post", "/api/v1/vms/vm1/migrate"),
           ("post", "/api/v1/vms/vm1/cancel"), ("post", "/api/v1/vms/vm1/suspend"),
           ("post", "/api/v1/vms/vm1/resume"), ("post", "/api/v1/vms/vm1/stop"),
           ("post", "/api/v1/vms/vm1/start"), ("post", "/api/v1/vms/vm1/reboot")]


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def error_code(response) -> str:
    return response.get_json()["error"]["code"]


@pytest.mark.parametrize("method,url", [("get", u) for u in GETS] + ACTIONS)
def test_no_token_or_a_wrong_one_is_401(app, method, url):
    client = app.test_client()
    for headers in ({}, auth("vmmgr_not-a-token"), {"Authorization": "Basic YTpi"}):
        r = getattr(client, method)(url, headers=headers)
        assert r.status_code == 401 and error_code(r) == "unauthenticated", (url, headers)


@pytest.mark.parametrize("method,url", ACTIONS)
def test_a_viewer_cannot_act(app, tokens, method, url):
    r = getattr(app.test_client(), method)(url, headers=auth(tokens["viewer"]), json={})
    assert r.status_code == 403 and error_code(r) == "forbidden"
    assert "needs the operator role" in r.get_json()["error"]["message"]


def test_listings_of_an_empty_fleet(app, tokens):
    client = app.test_client()
    for url in ("/api/v1/images", "/api/v1/hosts", "/api/v1/vms", "/api/v1/tasks",
                "/api/v1/events"):
        r = client.get(url, headers=auth(tokens["viewer"]))
        assert r.status_code == 200 and r.get_json() == [], url


def test_images_are_listed_with_their_size_and_checksum(app, home, tokens, tmp_path, as_role):
    raw = tmp_path / "tiny.raw"
    raw.write_bytes(b"\0" * (1 << 20))
    stored = os_images.import_image(home.images, "tiny", raw)
    r = app.test_client().get("/api/v1/images", headers=auth(tokens["viewer"]))
    assert r.status_code == 200 and r.get_json() == [stored.as_dict()]
    page = as_role("viewer").get("/").get_data(as_text=True)
    assert "<td>tiny</td>" in page and stored.sha256[:16] in page


@pytest.mark.parametrize("url,message", [
    ("/api/v1/hosts/host1", "unknown host 'host1'"),
    ("/api/v1/vms/vm1", "unknown VM 'vm1'"),
    ("/api/v1/vms/vm1/targets", "unknown VM 'vm1'"),
    ("/api/v1/vms/vm1/migrations", "unknown VM 'vm1'"),
    ("/api/v1/tasks/abc", "unknown task 'abc'"),
])
def test_unknown_things_are_404(app, tokens, url, message):
    r = app.test_client().get(url, headers=auth(tokens["viewer"]))
    assert r.status_code == 404 and error_code(r) == "not_found"
    assert message in r.get_json()["error"]["message"]


@pytest.mark.parametrize("method,url,body,status,message", [
    ("post", "/api/v1/vms", None, 400, "field 'name' is required"),
    ("post", "/api/v1/vms", [1, 2], 400, "must be a JSON object"),
    ("post", "/api/v1/vms", {"name": "a", "colour": "red"}, 400, "unknown field(s): colour"),
    ("post", "/api/v1/vms", {"name": "a", "memory_mib": "128"}, 400, "must be an integer"),
    ("post", "/api/v1/vms", {"name": "a", "memory_mib": True}, 400, "must be an integer"),
    ("post", "/api/v1/vms", {"name": "../etc"}, 400, "invalid VM name"),
    ("post", "/api/v1/vms", {"name": "a'/><x"}, 400, "invalid VM name"),
    ("post", "/api/v1/vms", {"name": "a", "memory_mib": 10}, 400,
     "field 'memory_mib': should be greater than or equal to 32"),
    ("post", "/api/v1/vms", {"name": "a", "workload": "bitcoin"}, 400, "unknown workload"),
    ("post", "/api/v1/vms", {"name": "a", "params": {"x": 1}}, 400, "map names to strings"),
    ("post", "/api/v1/vms", {"name": "a"}, 409, "no host has room for a"),
    ("post", "/api/v1/vms", {"name": "a", "host": "h9"}, 404, "unknown host 'h9'"),
    ("post", "/api/v1/vms/vm1/migrate", {}, 400, "field 'target' is required"),
    ("post", "/api/v1/vms/vm1/migrate", {"target": "h2", "policy": "warp"}, 400,
     "unknown policy 'warp'"),
    ("post", "/api/v1/vms/vm1/migrate", {"target": "h2", "bandwidth_mibps": -1}, 400,
     "field 'bandwidth_mibps': should be greater than or equal to 0"),
    ("post", "/api/v1/vms/vm1/migrate", {"target": "h2", "bandwidth_mibps": 1.5}, 400,
     "field 'bandwidth_mibps' must be an integer"),
    ("post", "/api/v1/vms", {"name": "a", "vcpus": None, "memory_mib": 1e9}, 400,
     "field 'memory_mib' must be an integer"),
    ("post", "/api/v1/vms/vm1/migrate", {"target": "h2"}, 404, "unknown host 'h2'"),
    ("post", "/api/v1/vms/vm1/cancel", None, 404, "unknown VM 'vm1'"),
    ("post", "/api/v1/vms/vm1/suspend", None, 404, "unknown VM 'vm1'"),
    ("post", "/api/v1/vms/vm1/resume", {"host": "../x"}, 400, "invalid host name"),
    ("post", "/api/v1/vms/vm1/resume", None, 404, "unknown VM 'vm1'"),
    ("delete", "/api/v1/vms/vm1", None, 404, "unknown VM 'vm1'"),
    ("post", "/api/v1/vms/vm1/stop", {"timeout": 0}, 400, "field 'timeout': should be greater"),
    ("post", "/api/v1/vms/vm1/stop", {"timeout": 5000}, 400, "field 'timeout': should be less"),
    ("post", "/api/v1/vms/vm1/stop", {"force": True}, 400, "unknown field(s): force"),
    ("post", "/api/v1/vms/vm1/stop", None, 404, "unknown VM 'vm1'"),
    ("post", "/api/v1/vms/vm1/start", None, 404, "unknown VM 'vm1'"),
    ("post", "/api/v1/vms/vm1/reboot", None, 404, "unknown VM 'vm1'"),
    ("post", "/api/v1/hosts/h1/drain", {"timeout": 0}, 400,
     "field 'timeout': should be greater than 0"),
    ("post", "/api/v1/hosts/h1/drain", {"timeout": "5"}, 400, "field 'timeout' must be a number"),
    ("post", "/api/v1/hosts/h1/drain", None, 404, "unknown host 'h1'"),
    ("post", "/api/v1/hosts/h1/reclaim", {"now": True}, 400, "unknown field(s): now"),
    ("post", "/api/v1/hosts/h1/reclaim", {"deadline_s": 0}, 400,
     "field 'deadline_s': should be greater than 0"),
    ("post", "/api/v1/hosts/h1/reclaim", {"deadline_s": "30s"}, 400,
     "field 'deadline_s' must be a number"),
    ("post", "/api/v1/hosts/h1/reclaim", {"deadline_s": 30}, 404, "unknown host 'h1'"),
    ("post", "/api/v1/vms", {"name": "a", "group": "../x"}, 400, "invalid group name"),
    ("post", "/api/v1/hosts/h1/enable", None, 404, "unknown host 'h1'"),
])
def test_bad_requests_are_refused_and_queue_nothing(app, tokens, redis_url, method, url, body,
                                                    status, message):
    r = getattr(app.test_client(), method)(url, headers=auth(tokens["operator"]), json=body)
    assert r.status_code == status, r.get_json()
    assert message in r.get_json()["error"]["message"]
    assert FleetState(redis_url).recent_tasks() == []


def test_a_body_that_is_not_json_is_refused(app, tokens):
    r = app.test_client().post("/api/v1/vms", headers=auth(tokens["operator"]), data="name=a",
                               content_type="text/plain")
    assert r.status_code == 400 and "JSON object" in r.get_json()["error"]["message"]


def test_wrong_method_and_unknown_path_answer_json(app, tokens):
    client = app.test_client()
    r = client.put("/api/v1/vms", headers=auth(tokens["admin"]))
    assert r.status_code == 405 and error_code(r) == "method_not_allowed"
    r = client.get("/api/v1/nothing", headers=auth(tokens["admin"]))
    assert r.status_code == 404 and error_code(r) == "not_found"


def test_an_accepted_action_is_queued_with_its_lock_and_can_be_followed(app, tokens, redis_url,
                                                                        mocker):
    checked = Request("migrate", {"vm": "vm1", "target": "host2", "policy": None,
                                  "bandwidth": 20}, "host1", ("vm", "vm1", "migration of vm1 to host2"))
    build = mocker.patch("webui.api.requests.migrate", return_value=checked)
    client = app.test_client()
    r = client.post("/api/v1/vms/vm1/migrate", headers=auth(tokens["operator"]),
                    json={"target": "host2", "bandwidth_mibps": 20})
    assert r.status_code == 202, r.get_json()
    queued = r.get_json()
    assert queued["op"] == "migrate" and queued["queue"] == "host.host1"
    assert build.call_args.args[1:] == ("vm1", "host2", None, 20)
    state = FleetState(redis_url)
    assert state.holder("vm", "vm1") == f"{queued['task']} migration of vm1 to host2"
    # A second request for the busy VM is refused at once, naming the first.
    r = client.post("/api/v1/vms/vm1/migrate", headers=auth(tokens["operator"]),
                    json={"target": "host2"})
    assert r.status_code == 409 and queued["task"] in r.get_json()["error"]["message"]
    # The task can be followed (no worker here: it waits in its queue).
    r = client.get(f"/api/v1/tasks/{queued['task']}", headers=auth(tokens["viewer"]))
    assert r.status_code == 200 and r.get_json()["state"] == "PENDING"
    assert [t["id"] for t in client.get("/api/v1/tasks", headers=auth(tokens["viewer"]))
            .get_json()] == [queued["task"]]
    events = client.get("/api/v1/events", headers=auth(tokens["viewer"])).get_json()
    assert events[-1]["message"] == "migrate submitted by operator (web API)"


def test_without_a_broker_records_are_503(home, tokens):
    from webui import create_app

    home.redis_url_file.unlink()
    r = create_app(home).test_client().get("/api/v1/events", headers=auth(tokens["viewer"]))
    assert r.status_code == 503 and error_code(r) == "broker_unavailable"


def test_every_api_route_is_documented(app):
    documented = {(path, method) for path, item in document()["paths"].items()
                  for method in item if method != "parameters"}
    served = set()
    for rule in app.url_map.iter_rules():
        if rule.rule.startswith("/api/v1/") and rule.endpoint != "api.openapi":
            path = rule.rule.removeprefix("/api/v1").replace("<", "{").replace(">", "}")
            served |= {(path, m.lower()) for m in rule.methods - {"HEAD", "OPTIONS"}}
    assert served == documented
    assert app.test_client().get("/api/v1/openapi.json").get_json()["openapi"] == "3.0.3"


def test_the_vm_list_comes_a_page_at_a_time_with_a_link_to_the_next(app, tokens, redis_url):
    from vmmgr import view
    from vmmgr.fleet import VMInfo
    from vmmgr.inventory import HostRecord, Inventory

    state = FleetState(redis_url)
    Inventory(state.r).add(HostRecord("h1", "qemu+tls://10.0.0.1/system", "kvm", 65536, 32))
    state.set_hosts({"h1": {"state": "active", "reachable": True}})
    names = [f"vm{i:02d}" for i in range(25)]
    state.replace_vm_views([view.guest_row(VMInfo(n, "h1", "running", 128, 1, "counter"))
                            for n in reversed(names)])
    client, seen, url, links = app.test_client(), [], "/api/v1/vms?limit=10", 0
    while url:
        r = client.get(url, headers=auth(tokens["viewer"]))
        assert r.status_code == 200 and len(r.get_json()) <= 10
        seen += [v["name"] for v in r.get_json()]
        assert all(v["moves_by"]["mode"] for v in r.get_json())  # completed rows, not raw ones
        link = r.headers.get("Link")
        url = link[1:link.index(">")] if link else None
        links += bool(link)
    assert seen == names and links == 2  # 10 + 10 + 5, in name order, nothing twice
    whole = client.get("/api/v1/vms", headers=auth(tokens["viewer"]))
    assert [v["name"] for v in whole.get_json()] == names and "Link" not in whole.headers


@pytest.mark.parametrize("query,message", [
    ("limit=0", "limit must be a whole number from 1 to 5000"),
    ("limit=5001", "limit must be a whole number from 1 to 5000"),
    ("limit=%C2%B2", "limit must be a whole number"),  # a superscript two: isdigit, not int()
    ("limit=ten", "limit must be a whole number"),
    ("after=..%2Fetc", "invalid VM name"),
    ("page=2", "unknown query parameter(s): page"),
])
def test_bad_paging_is_refused(app, tokens, query, message):
    r = app.test_client().get(f"/api/v1/vms?{query}", headers=auth(tokens["viewer"]))
    assert r.status_code == 400 and message in r.get_json()["error"]["message"]


def test_a_vm_whose_disk_is_on_its_sites_storage_lists_no_target_in_another_site(
        app, tokens, redis_url):
    """The migrate dialog's targets say what a move there would be refused for."""
    from dataclasses import asdict

    from vmmgr import view
    from vmmgr.fleet import VMInfo
    from vmmgr.host import Capacity
    from vmmgr.inventory import HostRecord, Inventory

    state = FleetState(redis_url)
    inventory = Inventory(state.r)
    for name, site in (("h1", "east"), ("h2", "east"), ("h3", "west")):
        inventory.add(HostRecord(name, f"qemu+tls://{name}/system", site=site))
        state.set_host(name, {"state": "active", "reachable": True,
                              **asdict(Capacity(4096, 8, 0, 0, ()))})
    disk = "/var/lib/vmmgr/storage/disks/vm1.qcow2"
    state.replace_vm_views([view.guest_row(VMInfo("vm1", "h1", "running", 512, 1, "",
                                                  site_disk=disk))])
    r = app.test_client().get("/api/v1/vms/vm1/targets", headers=auth(tokens["viewer"]))
    assert r.status_code == 200, r.get_json()
    got = {c["host"]: (c["ok"], c["reason"]) for c in r.get_json()}
    assert got["h2"] == (True, "")
    assert got["h3"] == (False, f"another site: {disk} is on its site's storage")
    assert got["h1"][0] is False
    # and how it would move on a reclaim names only its site's hosts
    r = app.test_client().get("/api/v1/vms/vm1", headers=auth(tokens["viewer"]))
    assert r.get_json()["moves_by"] == {"mode": "live migration", "reason": "fits on h2"}
