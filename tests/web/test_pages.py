"""The console's pages through Flask's test client: login, roles, CSRF, refusals flashed with
nothing changed, and the live streams' wire format."""

import json

import pytest

from vmmgr import os_images
from vmmgr.requests import Request
from vmmgr.state import FleetState

from .conftest import PASSWORD, csrf_of

PAGES = ["/", "/vms", "/events", "/vms/vm1", "/vms/vm1/summary", "/vms/vm1/progress",
         "/vms/vm1/console"]
ACTIONS = ["/vms", "/vms/vm1/migrate", "/vms/vm1/cancel", "/vms/vm1/suspend", "/vms/vm1/resume",
           "/vms/vm1/destroy", "/vms/vm1/stop", "/vms/vm1/start", "/vms/vm1/reboot",
           "/hosts/host1/drain", "/hosts/host1/reclaim",
           "/hosts/host1/enable"]


@pytest.mark.parametrize("url", PAGES + ACTIONS)
def test_everything_needs_a_login(app, url):
    client = app.test_client()
    r = client.post(url) if url in ACTIONS else client.get(url)
    assert r.status_code in (302, 400), url  # to the login page (or CSRF refuses the post first)
    if r.status_code == 302:
        assert "/login?next=" in r.headers["Location"]


def test_login_refuses_a_wrong_password_and_never_redirects_off_site(app):
    client = app.test_client()
    token = csrf_of(client.get("/login").get_data(as_text=True))
    r = client.post("/login", data={"name": "admin", "password": "wrong", "csrf_token": token})
    assert r.status_code == 401 and "Wrong name or password" in r.get_data(as_text=True)
    r = client.post("/login", data={"name": "nobody", "password": PASSWORD, "csrf_token": token})
    assert r.status_code == 401
    r = client.post("/login", data={"name": "admin", "password": PASSWORD})
    assert r.status_code == 400  # no CSRF token
    r = client.post("/login?next=//evil.example/x",
                    data={"name": "admin", "password": PASSWORD, "csrf_token": token})
    assert r.status_code == 302 and r.headers["Location"] == "/"
    assert client.get("/").status_code == 200


def test_logout_ends_the_session(as_role):
    client = as_role("viewer")
    token = csrf_of(client.get("/").get_data(as_text=True))
    assert client.post("/logout", data={"csrf_token": token}).status_code == 302
    assert client.get("/").status_code == 302


@pytest.mark.parametrize("url", ["/", "/vms", "/events"])
def test_a_viewer_sees_the_pages_without_action_forms(as_role, url):
    r = as_role("viewer").get(url)
    assert r.status_code == 200
    assert 'id="create"' not in r.get_data(as_text=True)


def test_an_operator_gets_the_create_form(as_role):
    assert 'id="create"' in as_role("operator").get("/vms").get_data(as_text=True)


@pytest.mark.parametrize("url", ["/vms/vm1", "/vms/vm1/summary", "/vms/vm1/console"])
def test_an_unknown_vm_is_a_404_page(as_role, url):
    r = as_role("viewer").get(url)
    assert r.status_code == 404 and "unknown VM &#39;vm1&#39;" in r.get_data(as_text=True)


@pytest.mark.parametrize("url", ACTIONS)
def test_a_viewer_cannot_act(as_role, url):
    client = as_role("viewer")
    token = csrf_of(client.get("/").get_data(as_text=True))
    assert client.post(url, data={"csrf_token": token}).status_code == 403


@pytest.mark.parametrize("url", ACTIONS)
def test_actions_need_the_csrf_token(as_role, url):
    assert as_role("operator").post(url, data={}).status_code == 400


@pytest.mark.parametrize("url,form,message", [
    ("/vms", {"name": "bad/name"}, "invalid VM name"),
    ("/vms", {"name": "a", "memory_mib": "lots"}, "memory_mib must be a whole number"),
    ("/vms", {"name": "a", "params": "interval"}, "KEY=VALUE"),
    ("/vms", {"name": "a"}, "no host has room for a"),
    ("/vms", {"name": "a", "image": "no-such-image"}, "unknown image &#39;no-such-image&#39;"),
    ("/vms", {"name": "a", "image": "base", "ssh_key": "not a key"}, "invalid SSH public key"),
    ("/vms", {"name": "a", "image": "base", "disk_gib": "1"}, "needs at least 3 GiB"),
    ("/vms", {"name": "a", "image": "base", "user_data": "runcmd: []"}, "#cloud-config"),
    ("/vms", {"name": "a", "image": "base"}, "no host has room for a"),
    ("/vms", {"name": "a", "image": "base", "local_disk": "on", "gpu_model": "lab-gpu"},
     "no --local-disk"),
    ("/vms/vm1/migrate", {"target": "host2"}, "unknown host &#39;host2&#39;"),
    ("/vms/vm1/migrate", {"target": "host2", "policy": "warp"}, "unknown policy"),
    ("/vms/vm1/cancel", {}, "unknown VM &#39;vm1&#39;"),
    ("/vms/vm1/suspend", {}, "unknown VM &#39;vm1&#39;"),
    ("/vms/vm1/resume", {}, "unknown VM &#39;vm1&#39;"),
    ("/vms/vm1/destroy", {}, "unknown VM &#39;vm1&#39;"),
    ("/vms/vm1/stop", {}, "unknown VM &#39;vm1&#39;"),
    ("/vms/vm1/start", {}, "unknown VM &#39;vm1&#39;"),
    ("/vms/vm1/reboot", {}, "unknown VM &#39;vm1&#39;"),
    ("/hosts/host1/drain", {}, "unknown host &#39;host1&#39;"),
    ("/hosts/host1/reclaim", {}, "unknown host &#39;host1&#39;"),
    ("/hosts/host1/reclaim", {"deadline": "soon"}, "is not a duration"),
    ("/hosts/host1/reclaim", {"deadline": "2d"}, "is not a duration"),
    ("/hosts/host1/reclaim", {"deadline": "0s"}, "more than 0 s and at most a day"),
    ("/hosts/host1/enable", {}, "unknown host &#39;host1&#39;"),
])
def test_refusals_are_shown_and_change_nothing(as_role, home, tmp_path, redis_url, url, form,
                                               message):
    raw = tmp_path / "base.raw"  # an image of 3 GiB for the image refusals
    with raw.open("wb") as f:
        f.truncate(3 * 2**30)
    os_images.import_image(home.images, "base", raw)
    client = as_role("operator")
    token = csrf_of(client.get("/").get_data(as_text=True))
    r = client.post(url, data=form | {"csrf_token": token}, follow_redirects=True)
    assert r.status_code in (200, 404)  # back on the page (a 404 page for an unknown VM)
    assert 'class="flash error"' in r.get_data(as_text=True)
    assert message in r.get_data(as_text=True)
    assert FleetState(redis_url).recent_tasks() == []


def test_an_unknown_action_is_404(as_role):
    client = as_role("operator")
    token = csrf_of(client.get("/").get_data(as_text=True))
    assert client.post("/vms/vm1/explode", data={"csrf_token": token}).status_code == 404
    assert client.post("/hosts/host1/explode", data={"csrf_token": token}).status_code == 404


def test_an_accepted_action_is_queued_and_its_progress_streamed(as_role, redis_url, mocker):
    mocker.patch("webui.pages.requests.suspend",
                 return_value=Request("suspend", {"vm": "vm1"}, "host1",
                                      ("vm", "vm1", "suspend of vm1")))
    client = as_role("operator")
    token = csrf_of(client.get("/").get_data(as_text=True))
    r = client.post("/vms/vm1/suspend", data={"csrf_token": token}, follow_redirects=True)
    assert "suspend queued (task " in r.get_data(as_text=True)
    state = FleetState(redis_url)
    [task] = state.recent_tasks()
    assert task["what"] == "suspend of vm1" and task["queue"] == "host.host1"
    assert state.events()[-1]["message"] == "suspend submitted by operator (web console)"

    # The progress stream (ended after SSE_MAX_SECONDS=1 here) names the queued operation.
    stream = client.get("/vms/vm1/progress").get_data(as_text=True)
    snapshots = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: ")]
    assert snapshots and snapshots[0]["operation"]["task"] == task["id"]
    assert snapshots[0]["operation"]["what"] == "suspend of vm1"
    assert snapshots[0]["operation"]["state"] == "PENDING"


def test_a_reconcile_check_holding_the_vm_is_not_shown_as_its_operation(app, redis_url):
    from vmmgr.locks import HOUSEKEEPING
    from webui import backend

    state = FleetState(redis_url)
    state.acquire("vm", "vm1", "node-1", f"{HOUSEKEEPING}check of vm1's record", 30)
    with app.test_request_context():
        assert backend.operation("vm1") is None  # nothing to follow or cancel
    state.release("vm", "vm1", "node-1")
    state.acquire("vm", "vm1", "task-1", "migration of vm1 to host2", 30)
    with app.test_request_context():
        assert backend.operation("vm1") == {"task": "task-1", "what": "migration of vm1 to host2"}
    state.release("vm", "vm1", "task-1")


def test_the_console_stream_sends_the_tail_then_what_follows(app, consoles):
    from webui import backend

    consoles.next_segment("vm1", "host1").write_bytes(b"tick 0\ntick 1\n")
    consoles.next_segment("vm1", "host2").write_bytes(b"tick 2\n\xff\n")
    with app.test_request_context():
        assert "".join(backend.console_stream("vm1")) == "tick 0\ntick 1\ntick 2\n\ufffd\n"
        assert "".join(backend.console_stream("vm1", tail=9)) == "tick 2\n\ufffd\n"


def test_the_vms_page_shows_a_page_of_rows_and_links_the_next(as_role, redis_url, mocker):
    from vmmgr import view
    from vmmgr.fleet import VMInfo

    mocker.patch("webui.pages.VM_PAGE", 3)
    names = [f"vm{i}" for i in range(7)]
    FleetState(redis_url).replace_vm_views(
        [view.guest_row(VMInfo(n, "h1", "running", 128, 1, "counter")) for n in names])
    client, seen, url = as_role("viewer"), [], "/vms"
    while url:
        html = client.get(url).get_data(as_text=True)
        shown = [n for n in names if f'id="vm-{n}"' in html]
        assert 1 <= len(shown) <= 3
        seen += shown
        url = (html[:html.index('id="next-page"')].rsplit('href="', 1)[1].split('"')[0]
               if 'id="next-page"' in html else None)
    assert seen == names
    r = client.get("/vms?after=../x")
    assert r.status_code == 400


def test_a_vm_from_an_image_shows_how_to_log_in_and_its_power_buttons(as_role, redis_url, consoles):
    """Its host keys as it printed them (what `vm ssh` pins); Stop and Reboot while it runs,
    Start once it is shut off; a viewer sees the keys but no buttons."""
    from vmmgr import view
    from vmmgr.fleet import VMInfo

    consoles.next_segment("dev1", "host1").write_bytes(
        b"boot\n-----BEGIN SSH HOST KEY KEYS-----\nssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIkey"
        b" root@dev1\n-----END SSH HOST KEY KEYS-----\nlogin:\n")
    st = FleetState(redis_url)
    for state, shown, hidden in (("running", ["Stop (clean shutdown)", "Reboot"], [">Start<"]),
                                 ("shutoff", [">Start<"], ["Stop (clean shutdown)", ">Reboot<"])):
        st.replace_vm_views([view.guest_row(VMInfo("dev1", "h1", state, 512, 1, "",
                                                   address="10.78.0.9"))])
        html = as_role("operator").get("/vms/dev1").get_data(as_text=True)
        assert 'id="login"' in html and "10.78.0.9 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIkey" in html
        assert "vmmgr vm ssh dev1 -i KEY" in html
        assert all(s in html for s in shown) and not any(s in html for s in hidden), state
    viewer = as_role("viewer").get("/vms/dev1").get_data(as_text=True)
    assert 'id="login"' in viewer and "Stop (clean shutdown)" not in viewer


def test_the_api_gives_a_vms_login_with_its_host_keys(app, consoles, redis_url, tokens):
    from vmmgr import view
    from vmmgr.fleet import VMInfo
    from .test_api import auth

    consoles.next_segment("dev2", "host1").write_bytes(
        b"-----BEGIN SSH HOST KEY KEYS-----\nssh-ed25519 AAAAkey root@dev2\n"
        b"-----END SSH HOST KEY KEYS-----\n")
    FleetState(redis_url).replace_vm_views([view.guest_row(VMInfo(
        "dev2", "h1", "running", 512, 1, "", address="10.78.0.9"))])
    r = app.test_client().get("/api/v1/vms/dev2/ssh", headers=auth(tokens["viewer"]))
    assert r.status_code == 200, r.get_json()
    assert r.get_json() == {"user": "vmmgr", "address": "10.78.0.9",
                            "host_keys": ["ssh-ed25519 AAAAkey"],
                            "known_hosts": "10.78.0.9 ssh-ed25519 AAAAkey\n",
                            "command": "ssh vmmgr@10.78.0.9"}


def test_the_fleet_page_names_each_hosts_site(as_role, home):
    from vmmgr.inventory import HostRecord, Inventory
    from vmmgr.state import FleetState

    inventory = Inventory(FleetState(home.redis_url_file.read_text().strip()).r)
    inventory.add(HostRecord("east1", "qemu+tls://192.0.2.11/system", site="east"))
    # (a fleet names sites for all its hosts or none: this one's record is written as is)
    inventory.add(HostRecord("plain1", "qemu+tls://192.0.2.12/system"), replace=True)
    html = as_role("viewer").get("/").get_data(as_text=True)
    east = html[html.index('id="host-east1"'):html.index('id="host-plain1"')]
    assert '<span class="badge" title="site">east</span>' in east
    plain = html[html.index('id="host-plain1"'):]
    assert 'title="site"' not in plain.split("</h2>")[0]  # a host in no named site shows none
