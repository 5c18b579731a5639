"""The OpenAPI 3.0 document of `/api/v1`, kept next to the routes it describes (tests check that
every route is documented and that the API honours every documented response)."""

from vmmgr.spec import NAME_RE
from vmmgr.users import ROLES

from . import bodies

NAME = {"type": "string", "pattern": NAME_RE.pattern, "maxLength": 63}
STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _obj(props: dict, required: list | None = None, extra: bool = True) -> dict:
    schema = {"type": "object", "properties": props, "additionalProperties": extra}
    if required:
        schema["required"] = required
    return schema


def _nullable(schema: dict) -> dict:
    return schema | {"nullable": True}


SCHEMAS = {
    "Error": _obj({"error": _obj({"code": {"type": "string", "enum": [
        "invalid_request", "unauthenticated", "forbidden", "not_found", "method_not_allowed",
        "conflict", "operation_failed", "migration_failed", "host_unreachable",
        "broker_unavailable", "http_error"]}, "message": STR}, ["code", "message"])},
        ["error"]),
    "Host": _obj({"name": STR, "uri": STR, "accel": STR, "state": STR, "reachable": BOOL,
                  "memory_mib": INT, "vcpus": INT, "used_memory_mib": INT, "used_vcpus": INT,
                  "free_memory_mib": INT, "free_vcpus": INT,
                  "vms": {"type": "array", "items": STR}, "error": STR,
                  "devices": {"type": "array", "items": _obj(
                      {"address": STR, "model": STR, "kind": STR}, ["address", "model", "kind"])},
                  "free_devices": {"type": "array", "items": STR}},
                 ["name", "accel", "state", "reachable"]),  # no uri for viewers
    "MovesBy": _obj({"mode": {"type": "string", "enum": [
        "live migration", "guest hibernation", "suspend to disk", "resume"]}, "reason": STR},
                    ["mode", "reason"]),
    "VM": _obj({"name": STR, "host": STR, "state": STR, "memory_mib": INT, "vcpus": INT,
                "workload": STR, "address": STR, "suspended_from": STR,
                "device_model": STR, "device_count": INT, "live": BOOL, "not_live_because": STR,
                "site_disk": STR, "moves_by": {"$ref": "#/components/schemas/MovesBy"}},
               ["name", "host", "state", "memory_mib", "vcpus", "address", "moves_by"]),
    "Migration": _obj({"status": STR, "source": STR, "target": STR, "downtime_ms":
                       _nullable(INT), "total_ms": _nullable(INT), "error": STR},
                      ["status", "source", "target"]),
    "Operation": _nullable(_obj({"task": STR, "what": STR}, ["task", "what"])),
    "Target": _obj({"host": STR, "ok": BOOL, "reason": STR, "free_memory_mib": _nullable(INT)},
                   ["host", "ok", "reason", "free_memory_mib"]),
    "Queued": _obj({"task": STR, "op": STR, "queue": STR}, ["task", "op", "queue"]),
    "TaskStatus": _obj({"task": STR, "op": STR, "queue": STR, "state": STR, "worker": STR,
                        "runs": INT, "submitted_at": NUM,
                        "progress": _nullable({"type": "object"}),
                        "events": {"type": "array", "items": STR},
                        "result": _nullable({}), "error": _nullable(STR)},
                       ["task", "op", "state"]),
    "TaskRecord": {"type": "object", "additionalProperties": STR},
    "Event": _obj({"id": STR, "time": STR, "kind": STR, "vm": STR, "host": STR, "task": STR,
                   "message": STR}, ["id", "time", "kind", "message"]),
}
SCHEMAS["Image"] = _obj({"name": STR, "format": STR, "virtual_size": INT, "size": INT,
                         "sha256": STR, "source": STR, "created": NUM, "recipe": STR})
SCHEMAS["SSHLogin"] = _obj({"user": STR, "address": _nullable(STR), "host_keys": {
    "type": "array", "items": STR}, "known_hosts": STR, "command": STR},
    ["user", "address", "host_keys", "known_hosts", "command"])
SCHEMAS["UsageReport"] = _obj({"since": NUM, "until": NUM, "vms": {"type": "array", "items": _obj(
    {"vm": STR, **{k: NUM for k in ("running", "migrating", "blackout", "suspended", "parked",
                                    "hibernated", "stopped")}}, ["vm"])}},
    ["since", "until", "vms"])
SCHEMAS["AuditEntry"] = _obj({k: STR for k in ("time", "who", "via", "client", "token", "action",
                                               "target", "outcome", "task", "result")}
                             | {"args": {}}, ["time", "who", "via", "action", "outcome"])
SCHEMAS["VMDetail"] = {"allOf": [{"$ref": "#/components/schemas/VM"}, _obj({
    "operation": {"$ref": "#/components/schemas/Operation"},
    "migrations": {"type": "array", "items": {"$ref": "#/components/schemas/Migration"}}},
    ["operation", "migrations"])]}

# Request bodies: the models that validate them (webui/bodies.py), in OpenAPI's dialect.
BODIES = {name: bodies.openapi_schema(model) for name, model in {
    "create": bodies.Create, "migrate": bodies.Migrate, "drain": bodies.Drain,
    "resume": bodies.Resume, "suspend": bodies.Suspend, "empty": bodies.Empty,
    "stop": bodies.Stop,
    "reclaim": bodies.Reclaim}.items()}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict:
    words = {400: "Bad request: nothing was changed", 401: "No valid API token",
             403: "The token's role may not do this", 404: "Unknown host, VM or task",
             409: "Refused: busy, no room, exists, or wrong state",
             502: "The operation failed in libvirt", 503: "A host or the broker does not answer"}
    return {str(s): _json(_ref("Error"), words[s]) for s in statuses}


READ = (400, 401, 404, 502, 503)
ACT = (400, 401, 403, 404, 409, 502, 503)


def _op(summary: str, ok: tuple[int, dict, str], errors: tuple, body: str | None = None,
        role: str = "viewer", params: list | None = None) -> dict:
    status, schema, words = ok
    op = {"summary": summary, "description": f"Needs the {role} role.",
          "responses": {str(status): _json(schema, words)} | _errors(*errors)}
    if body:
        op["requestBody"] = {"required": body in ("create", "migrate"),
                             "content": {"application/json": {"schema": BODIES[body]}}}
    if params:
        op["parameters"] = params
    return op


def _path_param(name: str) -> dict:
    return {"name": name, "in": "path", "required": True, "schema": STR}


def _action(summary: str, body: str | None = None) -> dict:
    return {"post": _op(summary, (202, _ref("Queued"), "Queued; follow it at /tasks/{task}"),
                        ACT, body, "operator")}


def _list(name: str) -> dict:
    return {"type": "array", "items": _ref(name)}


COUNT = {"name": "count", "in": "query", "required": False,
         "schema": {"type": "integer", "minimum": 1, "maximum": 1000}}


VM_PAGE = [{"name": "limit", "in": "query", "required": False,
            "description": "Rows per page (1,000 if not given)",
            "schema": {"type": "integer", "minimum": 1, "maximum": 5000}},
           {"name": "after", "in": "query", "required": False,
            "description": "The page starts after this VM name (the Link header's next page)",
            "schema": NAME}]


WHEN = {"type": "string", "pattern": "^[0-9A-Za-z:.+-]{1,40}$"}
USAGE_WINDOW = [{"name": "since", "in": "query", "required": False, "schema": WHEN,
                 "description": "Unix seconds, ISO 8601, or 90m/6h/7d before now (default 30d)"},
                {"name": "until", "in": "query", "required": False, "schema": WHEN,
                 "description": "The same forms (default: now)"}]


def document() -> dict:
    vm, host = [_path_param("name")], [_path_param("name")]
    paths = {
        "/hosts": {"get": _op("Hosts with capacity, state and VMs", (200, _list("Host"), "Hosts"),
                              (401, 502, 503))},
        "/hosts/{name}": {"get": _op("One host", (200, _ref("Host"), "The host"), READ)},
        "/hosts/{name}/drain": _action("Empty a host by live migration only", "drain"),
        "/hosts/{name}/reclaim": _action("Empty a host now: migrate what fits, suspend the rest; "
                                         "with deadline_s, a plan that makes every VM safe "
                                         "(running elsewhere or saved) within it",
                                         "reclaim"),
        "/hosts/{name}/enable": _action("Put a host back in service; parked VMs resume", "empty"),
        "/vms": {"get": _op("Every VM, running or suspended, by name, a page at a time; the "
                            "Link header names the next page (rel=next) while more follow",
                            (200, _list("VM"), "VMs"), (400, 401, 502, 503), params=VM_PAGE),
                 "post": _op("Create a VM running a built-in workload",
                             (202, _ref("Queued"), "Queued"), ACT, "create", "operator")},
        "/vms/{name}": {"get": _op("One VM with its current operation and migrations",
                                   (200, _ref("VMDetail"), "The VM"), READ),
                        "delete": _op("Power a VM off and remove it",
                                      (202, _ref("Queued"), "Queued"), ACT, role="operator")},
        "/vms/{name}/targets": {"get": _op(
            "Every host as a migration target: can it take the VM, and if not, why",
            (200, _list("Target"), "Targets, those with room first"), READ)},
        "/vms/{name}/migrations": {"get": _op("The VM's migration attempts",
                                              (200, _list("Migration"), "Attempts"), READ)},
        "/vms/{name}/ssh": {"get": _op(
            "How to log in to a VM from an OS image: its user and address, and its SSH host "
            "keys as it printed them at first boot (empty until then), to pin",
            (200, _ref("SSHLogin"), "Login"), READ)},
        "/vms/{name}/migrate": _action("Live-migrate the VM", "migrate"),
        "/vms/{name}/cancel": _action("Abort the VM's running migration; it stays where it was",
                                      "empty"),
        "/vms/{name}/suspend": _action("Suspend the VM to shared storage and free its host "
                                       "(mode guest: the guest hibernates itself)", "suspend"),
        "/vms/{name}/resume": _action("Restore a suspended VM", "resume"),
        "/vms/{name}/stop": _action("Shut the VM down cleanly (its OS is asked; timeout: the "
                                    "seconds it gets, default 120); it keeps its host, disk and "
                                    "address", "stop"),
        "/vms/{name}/start": _action("Boot a stopped VM again", "empty"),
        "/vms/{name}/reboot": _action("Ask the VM's OS to reboot", "empty"),
        "/images": {"get": _op("The OS images disk-backed VMs start from, on shared storage",
                               (200, _list("Image"), "Images"), (401, 503))},
        "/tasks": {"get": _op("Recent tasks", (200, _list("TaskRecord"), "Tasks"),
                              (400, 401, 503), params=[COUNT])},
        "/tasks/{task_id}": {"get": _op("A task: progress and events while it runs, then its "
                                        "result or error", (200, _ref("TaskStatus"), "The task"),
                                        (401, 404, 503), params=[_path_param("task_id")])},
        "/events": {"get": _op("The event log, oldest first", (200, _list("Event"), "Events"),
                               (400, 401, 503), params=[COUNT])},
        "/usage": {"get": _op("Seconds each VM ran, moved (blackouts apart), waited suspended "
                              "or parked and slept hibernated in [since, until)",
                              (200, _ref("UsageReport"), "Usage"), (400, 401, 503),
                              params=USAGE_WINDOW)},
        "/audit": {"get": _op("The audit trail: who asked for what, on what, when, and how it "
                              "ended", (200, _list("AuditEntry"), "Requests, oldest first"),
                              (400, 401, 403, 503), params=USAGE_WINDOW + [
                                  {"name": "who", "in": "query", "required": False,
                                   "schema": STR}, {"name": "on", "in": "query",
                                                    "required": False, "schema": STR}],
                              role="admin")},
    }
    for path, item in paths.items():
        if "{name}" in path:
            item["parameters"] = host if path.startswith("/hosts") else vm
    return {
        "openapi": "3.0.3",
        "info": {"title": "vmmgr", "version": "1",
                 "description": "Resumable compute on QEMU/KVM. Authenticate with "
                                "`Authorization: Bearer <token>` (`vmmgr user token NAME`). "
                                "Roles: " + " < ".join(ROLES) + "."},
        "servers": [{"url": "/api/v1"}],
        "components": {"schemas": SCHEMAS, "securitySchemes": {
            "token": {"type": "http", "scheme": "bearer"}}},
        "security": [{"token": []}],
        "paths": paths,
    }
