"""The console and API as an attacker tries them: each finding of the review has its test."""

import json
import threading

import pytest

from vmmgr import users as users_mod
from vmmgr.inventory import HostRecord, Inventory
from vmmgr.paths import Paths
from vmmgr.state import FleetState
from vmmgr.users import Users
from webui import _secret_key, create_app, limits

from .conftest import PASSWORD, csrf_of, login


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


# ---- sessions and tokens -----------------------------------------------------------------------

def test_the_session_cookie_is_secure_httponly_and_lax(home):
    client = create_app(home, TESTING=True).test_client()
    page = client.get("/login")
    client.post("/login", data={"name": "viewer", "password": PASSWORD,
                                "csrf_token": csrf_of(page.get_data(as_text=True))})
    cookie = client.get_cookie("session")
    assert cookie.secure and cookie.http_only and cookie.same_site == "Lax"


def test_the_plain_http_lab_server_turns_secure_off(home, mocker):
    from vmmgr.cli import users as cli_users

    made = mocker.patch("webui.create_app")
    cli_users.web.callback.__wrapped__(home, "127.0.0.1", 8080)
    assert made.call_args.kwargs["SESSION_COOKIE_SECURE"] is False
    made.return_value.run.assert_called_once_with(host="127.0.0.1", port=8080, threaded=True)


def test_logging_out_ends_the_session_even_for_a_copy_of_its_cookie(app):
    client, thief = login(app.test_client(), "viewer"), app.test_client()
    thief.set_cookie("session", client.get_cookie("session").value)
    assert thief.get("/").status_code == 200
    client.post("/logout", data={"csrf_token": csrf_of(client.get("/").get_data(as_text=True))})
    assert thief.get("/").status_code == 302  # to the login page: the session is over


def test_a_new_password_ends_every_session_and_token(app, home, tokens):
    client = login(app.test_client(), "operator")
    api = app.test_client()
    assert api.get("/api/v1/hosts", headers=auth(tokens["operator"])).status_code == 200
    Users(home.users).add("operator", "a brand new password", "operator", replace=True)
    assert client.get("/").status_code == 302
    assert api.get("/api/v1/hosts", headers=auth(tokens["operator"])).status_code == 401
    assert api.get("/api/v1/hosts", headers=auth(tokens["admin"])).status_code == 200  # others keep theirs


def test_one_token_is_revoked_and_the_others_work_on(app, home):
    users = Users(home.users)
    first, second = users.new_token("operator", "ci"), users.new_token("operator", "laptop")
    listed = {t["label"]: t["id"] for t in users.tokens("operator")}
    assert set(listed) == {"ci", "laptop"} and listed["ci"] == users.token_id(first)
    users.revoke_token("operator", listed["ci"])
    api = app.test_client()
    assert api.get("/api/v1/hosts", headers=auth(first)).status_code == 401
    assert api.get("/api/v1/hosts", headers=auth(second)).status_code == 200
    with pytest.raises(Exception, match="no token"):
        users.revoke_token("operator", listed["ci"])


def test_login_is_limited_per_address_and_name_never_per_name_alone(app, redis_url):
    client = app.test_client()
    token = csrf_of(client.get("/login").get_data(as_text=True))

    def attempt(name, password, address="10.0.0.1"):
        return client.post("/login", data={"name": name, "password": password,
                                           "csrf_token": token},
                           environ_base={"REMOTE_ADDR": address})
    for _ in range(limits.PER_NAME):
        assert attempt("admin", "guess").status_code == 401
    r = attempt("admin", PASSWORD)  # counted before hashing: even the right one waits now
    assert r.status_code == 429 and 0 < int(r.headers["Retry-After"]) <= limits.WINDOW
    assert "Too many login attempts" in r.get_data(as_text=True)
    # Nobody can lock admin out from elsewhere, and this address may still try other names.
    assert attempt("admin", PASSWORD, address="10.0.0.2").status_code == 302
    assert attempt("viewer", PASSWORD).status_code == 302


def test_a_burst_of_guesses_from_one_address_is_held_to_its_limit(app, redis_url, monkeypatch):
    monkeypatch.setattr(limits, "PER_ADDRESS", 5)
    client = app.test_client()
    token = csrf_of(client.get("/login").get_data(as_text=True))
    codes = [client.post("/login", data={"name": f"user{i}", "password": "guess",
                                         "csrf_token": token}).status_code for i in range(8)]
    assert codes == [401] * 5 + [429] * 3


def test_unknown_and_known_names_cost_one_hash_each(home, mocker):
    users = Users(home.users)
    users.authenticate("nobody", "x" * 12)  # the decoy is made once
    spy = mocker.spy(users_mod, "hash_password")
    assert users.authenticate("nobody", "x" * 12) is None
    assert spy.call_count == 1
    assert users.authenticate("viewer", "x" * 12) is None
    assert spy.call_count == 2


def test_scrypt_at_current_guidance_and_old_hashes_redone_at_login(home, monkeypatch):
    monkeypatch.setitem(users_mod.SCRYPT, "n", 2**17)  # what production uses (the fixture lowers it)
    assert users_mod.SCRYPT == {"n": 2**17, "r": 8, "p": 1}  # OWASP: N=2^17, r=8, p=1
    users = Users(home.users)
    old = users_mod.hash_password("an old password", n=2**14)
    data = json.loads(home.users.read_text())
    data["viewer"]["password"] = "scrypt$" + old.split("$", 4)[4]  # the format before
    home.users.write_text(json.dumps(data))
    assert users.authenticate("viewer", "an old password")
    stored = json.loads(home.users.read_text())["viewer"]["password"]
    assert stored.startswith(f"scrypt${2**17}$8$1$")
    assert users.authenticate("viewer", "an old password")


# ---- the web secret -------------------------------------------------------------------------------

def test_a_weak_web_secret_is_refused(home, monkeypatch):
    monkeypatch.setenv("VMMGR_WEB_SECRET", "changeme")
    with pytest.raises(RuntimeError, match="too weak"):
        create_app(home)


def test_workers_starting_at_once_all_get_the_same_whole_key(tmp_path):
    for trial in range(30):
        paths = Paths(tmp_path / f"home{trial}")
        keys, start = [], threading.Barrier(4)

        def worker():
            start.wait()
            # the key's own code (CPython 3.11's compiler is not thread-safe for a whole app)
            keys.append(_secret_key(paths))
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(keys)) == 1 and len(keys[0]) == 64, keys
        assert (paths.web_secret.stat().st_mode & 0o777) == 0o600
        assert [p.name for p in paths.home.iterdir()] == ["web-secret"]  # no temporary left


# ---- requests -------------------------------------------------------------------------------------

def test_security_headers(app):
    r = app.test_client().get("/login")
    csp = r.headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    assert "Strict-Transport-Security" not in r.headers  # plain HTTP: HSTS would mean nothing
    r = app.test_client().get("/login", base_url="https://console.example")
    assert r.headers["Strict-Transport-Security"].startswith("max-age=")


def test_a_large_body_is_refused_before_it_is_read(app, tokens):
    r = app.test_client().post("/api/v1/vms", data=b"{" + b" " * (2 << 20) + b"}",
                               headers=auth(tokens["operator"]) | {"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json["error"]["code"] == "invalid_request"


@pytest.mark.parametrize("memory", ["\u00b2", "1" * 200, "-1", "1e3"])
def test_form_numbers_are_ascii_digits_or_refused(as_role, redis_url, memory):
    client = as_role("operator")
    token = csrf_of(client.get("/").get_data(as_text=True))
    r = client.post("/vms", data={"name": "a", "memory_mib": memory, "csrf_token": token},
                    follow_redirects=True)
    assert r.status_code == 200 and "memory_mib must be a whole number" in r.get_data(as_text=True)
    assert FleetState(redis_url).recent_tasks() == []


@pytest.mark.parametrize("params,message", [
    ({"interval": "nan"}, "not a number"), ({"interval": "inf"}, "not a number"),
    ({"count": "1" * 200}, "not a whole number")])
def test_workload_parameters_are_strict(app, tokens, redis_url, params, message):
    r = app.test_client().post("/api/v1/vms", json={"name": "a", "workload": "counter",
                                                    "params": params},
                               headers=auth(tokens["operator"]))
    assert r.status_code == 400 and message in r.json["error"]["message"]
    assert FleetState(redis_url).recent_tasks() == []


def test_deeply_nested_json_is_a_400(app, tokens):
    r = app.test_client().post("/api/v1/vms", data="[" * 100000 + "]" * 100000,
                               headers=auth(tokens["operator"]) | {"Content-Type": "application/json"})
    assert r.status_code in (400, 413)


# ---- streams --------------------------------------------------------------------------------------

def test_a_progress_stream_for_an_unknown_vm_is_a_404_at_once(as_role):
    r = as_role("viewer").get("/vms/nosuch/progress")
    assert r.status_code == 404


def test_a_console_viewer_reads_the_tail_not_the_whole_log(app, consoles, mocker):
    from webui import backend

    consoles.next_segment("big", "host1").write_bytes(b"x" * (8 << 20) + "é".encode() * 10)
    reads = mocker.spy(consoles, "chunks")
    with app.test_request_context():
        text = "".join(backend.console_stream("big", tail=21))
    assert text == "x" + "é" * 10
    size = (8 << 20) + 20
    assert reads.call_args_list[0].args[1] == size - 21  # it began at the tail: no 8 MiB read


# ---- what viewers see --------------------------------------------------------------------------

def test_viewers_see_no_host_uris_or_hypervisor_errors(app, tokens, redis_url):
    from flask import g

    from vmmgr.users import User
    from webui import redact

    Inventory(FleetState(redis_url).r).add(HostRecord("host1", "qemu+tls://10.1.2.3/system"))
    api = app.test_client()
    [host] = api.get("/api/v1/hosts", headers=auth(tokens["viewer"])).json
    assert "uri" not in host and "10.1.2.3" not in json.dumps(host)
    assert host["error"] == "does not answer"
    [host] = api.get("/api/v1/hosts", headers=auth(tokens["operator"])).json
    assert host["uri"] == "qemu+tls://10.1.2.3/system"
    failed = [{"status": "failed", "error": "unable to connect to qemu+tls://10.1.2.3/system"}]
    with app.test_request_context():
        g.user = User("v", "viewer")
        assert redact.deep(failed)[0]["error"] == "unable to connect to <host>"
        assert redact.deep({"record": {"name": "h9", "uri": "qemu+tls://10.1.2.4/system"}}) == {
            "record": {"name": "h9"}}
        g.user = User("o", "operator")
        assert redact.deep(failed) == failed
