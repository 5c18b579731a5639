"""The REST API's positive cases against the lab: schemathesis sends the document's own example
bodies to every action on a real fleet and checks each answer against the document, including
that a valid request is accepted (202, not a refusal), and follows each queued task to its end
through the documented task endpoint. Reads are checked on real rows (VMs, hosts, migrations,
events, usage), which an empty inventory never has."""

import time

import pytest
import schemathesis

from vmmgr.users import Users
from webui import create_app
from webui.openapi import document

USER, PASSWORD = "api-positive", "a long test password"
VM = document()["paths"]["/vms"]["post"]["requestBody"]["content"]["application/json"][
    "schema"]["example"]["name"]


@pytest.fixture
def api(lab, paths, fleet):
    users = Users(paths.users)
    users.add(USER, PASSWORD, "admin", replace=True)
    token = users.new_token(USER)
    schema = schemathesis.openapi.from_wsgi("/api/v1/openapi.json", create_app(paths))
    try:
        yield Api(schema, {"Authorization": f"Bearer {token}"})
    finally:
        users.remove(USER)
        if fleet.find(VM):
            fleet.destroy(VM)


class Api:
    def __init__(self, schema, headers):
        self.schema, self.headers = schema, headers

    def call(self, method: str, path: str, body=None, **path_parameters):
        """One request as a schemathesis case, validated against the document."""
        operation = self.schema[path][method]
        example = _example(operation) if body is None else body
        kwargs = {} if example is None else {"body": example, "media_type": "application/json"}
        case = operation.Case(path_parameters=path_parameters or None, **kwargs)
        return case.call_and_validate(headers=self.headers)

    def act(self, method: str, path: str, body=None, **path_parameters) -> dict:
        """An action: answered 202, then followed to its end; its final status."""
        r = self.call(method, path, body, **path_parameters)
        assert r.status_code == 202, r.text
        return self.wait(r.json()["task"])

    def wait(self, task: str, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.call("GET", "/tasks/{task_id}", task_id=task).json()
            if status["state"] in ("SUCCESS", "FAILURE"):
                return status
            time.sleep(0.3)
        raise AssertionError(f"task {task} did not end in {timeout} s")


def _example(operation):
    body = operation.definition.raw.get("requestBody")
    return body and body["content"]["application/json"]["schema"].get("example")


def test_every_action_is_accepted_and_conforms_on_the_lab(api):
    done = api.act("POST", "/vms")  # the document's example: a counter VM on host1
    assert done["state"] == "SUCCESS", done
    api.call("GET", "/vms/{name}", name=VM)
    assert api.act("POST", "/vms/{name}/migrate", name=VM)["result"]["target"] == "host2"

    # A slow migration, cancelled while it copies: the VM stays on host2.
    r = api.call("POST", "/vms/{name}/migrate", {"target": "host1", "bandwidth_mibps": 2}, name=VM)
    moving = r.json()["task"]
    deadline = time.monotonic() + 60
    while api.call("GET", "/tasks/{task_id}", task_id=moving).json()["progress"] is None:
        assert time.monotonic() < deadline, "the slow migration shows no progress"
        time.sleep(0.3)
    api.act("POST", "/vms/{name}/cancel", name=VM)
    assert api.wait(moving)["state"] == "FAILURE"

    assert api.act("POST", "/vms/{name}/suspend", {"mode": "save"}, name=VM)["state"] == "SUCCESS"
    assert api.act("POST", "/vms/{name}/resume", name=VM)["state"] == "SUCCESS"  # to host3
    rows = {v["name"]: v for v in api.call("GET", "/vms").json()}
    assert rows[VM]["host"] == "host3" and rows[VM]["state"] == "running", rows[VM]

    assert api.act("POST", "/hosts/{name}/drain", name="host3")["state"] == "SUCCESS"
    assert api.act("POST", "/hosts/{name}/enable", name="host3")["state"] == "SUCCESS"
    reclaimed = api.act("POST", "/hosts/{name}/reclaim", name="host3")  # deadline_s: 120
    assert reclaimed["state"] == "SUCCESS" and reclaimed["result"]["deadline_s"] > 100, reclaimed
    assert api.act("POST", "/hosts/{name}/enable", name="host3")["state"] == "SUCCESS"

    for path, params in (("/hosts", {}), ("/hosts/{name}", {"name": "host1"}),
                         ("/vms/{name}/targets", {"name": VM}),
                         ("/vms/{name}/migrations", {"name": VM}), ("/tasks", {}),
                         ("/events", {}), ("/usage", {}), ("/audit", {})):
        assert api.call("GET", path, **params).status_code == 200, path
    migrations = api.call("GET", "/vms/{name}/migrations", name=VM).json()
    assert [m["status"] for m in migrations].count("completed") >= 2, migrations

    assert api.act("DELETE", "/vms/{name}", name=VM)["state"] == "SUCCESS"
    assert all(v["name"] != VM for v in api.call("GET", "/vms").json())
