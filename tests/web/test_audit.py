"""The audit trail: requests from the console, the API and the CLI, refused or queued, with who,
from where and how they ended; kept for a configurable time."""

import time
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from tasks import runtime
from vmmgr import audit
from vmmgr.cli import cli
from vmmgr.cli.base import _audit_refusal
from vmmgr.errors import NotFound
from vmmgr.requests import Request
from vmmgr.state import FleetState
from vmmgr.users import Users

from .conftest import PASSWORD, csrf_of


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def trail(redis_url, **kw):
    return audit.trail(FleetState(redis_url).r, 0, time.time() + 1, **kw)


def test_a_console_action_is_recorded_with_who_and_from_where(as_role, redis_url, mocker):
    mocker.patch("webui.pages.requests.suspend",
                 return_value=Request("suspend", {"vm": "vm1"}, "host1",
                                      ("vm", "vm1", "suspend of vm1")))
    client = as_role("operator")
    token = csrf_of(client.get("/").get_data(as_text=True))
    client.post("/vms/vm1/suspend", data={"csrf_token": token})
    client.post("/vms/vm2/destroy", data={"csrf_token": token})  # unknown VM: refused
    rows = [r for r in trail(redis_url) if r["action"] != "login"]
    queued, refused = rows
    assert (queued["who"], queued["via"], queued["client"], queued["action"], queued["target"],
            queued["outcome"]) == ("operator", "web", "127.0.0.1", "suspend", "vm1", "queued")
    assert queued["task"] and queued["result"] == ""  # no worker ran it here
    assert (refused["action"], refused["target"]) == ("destroy", "vm2")
    assert refused["outcome"].startswith("refused: unknown VM")


def test_an_api_request_names_the_token(app, tokens, redis_url, home):
    r = app.test_client().post("/api/v1/vms/vm9/suspend", headers=auth(tokens["operator"]))
    assert r.status_code == 404
    [row] = trail(redis_url)
    assert (row["who"], row["via"]) == ("operator", "api")
    assert row["token"] == Users(home.users).token_id(tokens["operator"])
    assert row["outcome"].startswith("refused: unknown VM")


def test_logins_are_recorded_failed_or_not(app, redis_url):
    client = app.test_client()
    token = csrf_of(client.get("/login").get_data(as_text=True))
    client.post("/login", data={"name": "admin", "password": "guess", "csrf_token": token})
    client.post("/login", data={"name": "admin", "password": PASSWORD, "csrf_token": token})
    assert [r["outcome"] for r in trail(redis_url, who="admin")] == [
        "refused: wrong name or password", "ok"]


def test_only_an_admin_reads_the_trail(app, tokens, redis_url):
    audit.record(FleetState(redis_url).r, audit.cli_actor(), "vm destroy", "vm1", {}, "queued")
    api = app.test_client()
    assert api.get("/api/v1/audit", headers=auth(tokens["operator"])).status_code == 403
    r = api.get("/api/v1/audit?on=vm1", headers=auth(tokens["admin"]))
    assert r.status_code == 200 and [e["action"] for e in r.json] == ["vm destroy"]
    assert api.get("/api/v1/audit?since=later",
                   headers=auth(tokens["admin"])).status_code == 400


def test_a_task_outcome_is_joined_to_its_request(redis_url, mocker):
    state = FleetState(redis_url)
    mocker.patch.object(runtime, "state", return_value=state)
    audit.record(state.r, audit.cli_actor(), "migrate", "vm1", {}, "queued", task="t-1")
    fake = SimpleNamespace(name="vmmgr.migrate",
                           request=SimpleNamespace(id="t-1", delivery_info={}),
                           update_state=lambda **kw: None)
    runtime.run_once(fake, None, lambda run: {"moved": True})
    [row] = trail(redis_url)
    assert row["result"] == "ok" and row["via"] == "cli"


@pytest.fixture(autouse=True)
def fresh_cli(monkeypatch):
    from vmmgr.cli import dispatch
    monkeypatch.setattr(dispatch, "handed_over", False)  # one command per process, as in use


def test_the_cli_records_its_refusals_and_reads_the_trail(home, redis_url, monkeypatch):
    monkeypatch.setenv("VMMGR_HOME", str(home.home))
    _audit_refusal(["vm", "destroy", "vm7"], NotFound("unknown VM 'vm7'"))
    _audit_refusal(["vm", "list"], NotFound("nothing"))  # a read: not a refused request
    out = CliRunner().invoke(cli, ["--home", str(home.home), "audit"])
    assert out.exit_code == 0 and "vm destroy" in out.output and "vm7" in out.output
    assert "refused: unknown VM" in out.output and "vm list" not in out.output


def test_old_entries_go_after_the_kept_time(redis_url, monkeypatch):
    r = FleetState(redis_url).r
    r.xadd(audit.STREAM, {"time": "1", "who": "old", "via": "cli", "action": "x"},
           id=f"{int((time.time() - 3 * 86400) * 1000)}-0")
    monkeypatch.setenv("VMMGR_AUDIT_DAYS", "1")
    for i in range(3):
        audit.record(r, audit.cli_actor(), "vm create", f"v{i}", {}, "queued")
    assert all(row["who"] != "old" for row in trail(redis_url))


def test_the_cli_keeps_no_password_and_no_refusal_after_the_hand_over(home, redis_url,
                                                                      monkeypatch):
    from vmmgr.cli import dispatch
    from vmmgr.errors import Conflict

    _audit_refusal(["--home", str(home.home), "user", "add", "bob", "--password",
                    "hunter2hunter2"], Conflict("user 'bob' already exists"))
    [row] = trail(redis_url)
    assert row["action"] == "user add" and row["target"] == "bob"
    assert "hunter2" not in str(row) and row["args"]["role"] == "viewer"
    monkeypatch.setattr(dispatch, "handed_over", True)  # a task ran it and failed: its outcome
    _audit_refusal(["--home", str(home.home), "vm", "destroy", "vm1"], NotFound("gone"))
    assert len(trail(redis_url)) == 1


@pytest.mark.parametrize("argv,action,target", [
    (["--home", "/x", "migrate", "start", "vm1", "--to", "h2"], "migrate start", "vm1"),
    (["migrate", "--to", "h2", "vm1"], "migrate start", "vm1"),
    (["host", "reclaim", "host1"], "host reclaim", "host1")])
def test_the_cli_names_the_command_and_its_target(argv, action, target, mocker):
    recorded = mocker.patch("vmmgr.cli.base.audit_cli")
    _audit_refusal(argv, NotFound("x"))
    assert recorded.call_args.args[1:3] == (action, target)
