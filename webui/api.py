"""REST API `/api/v1`: every listing and action of the console, JSON in and out.

Actions answer 202 with the queued task (`GET /api/v1/tasks/<id>` follows it); refusals answer at
once with `{"error": {"code", "message"}}` and change nothing. The OpenAPI document is served at
`/api/v1/openapi.json`.
"""

from flask import Blueprint, g, jsonify, request, url_for

from vmmgr import audit, guest_ssh, os_images, overview, requests, seed
from vmmgr.errors import InvalidRequest, NotFound, VmmgrError
from vmmgr.spec import validate_name

from . import backend, redact
from .bodies import Create, Drain, Empty, Migrate, Reclaim, Resume, Stop, Suspend, parse
from .auth import api_role
from .openapi import document

bp = Blueprint("api", __name__, url_prefix="/api/v1")
QUERY = {"api.list_tasks": {"count"}, "api.list_events": {"count"},
         "api.list_vms": {"limit", "after"}, "api.get_usage": {"since", "until"},
         "api.get_audit": {"since", "until", "who", "on"}}  # the rest: none
VM_PAGE, VM_PAGE_MAX = 1000, 5000


@bp.before_request
def _no_unknown_query_parameters():
    unknown = sorted(set(request.args) - QUERY.get(request.endpoint, set()))
    if unknown and request.endpoint:
        raise InvalidRequest(f"unknown query parameter(s): {', '.join(unknown)}")

def act(build):
    """Check a request against the fleet (`build(fleet)` raises a refusal), queue it: 202."""
    with backend.fleet() as fleet:
        try:
            req = build(fleet)
        except VmmgrError as err:
            backend.refused(f"{request.method} {request.path}", request.view_args.get("name", ""),
                            request.get_json(silent=True) or {}, err)
            raise
    task = backend.submit(req)
    backend.state().event(f"{task['op']} submitted by {g.user.name} (web API)", task=task["task"])
    return jsonify(task), 202


@bp.get("/openapi.json")
def openapi():
    return jsonify(document())


# ---- images -------------------------------------------------------------------------------

@bp.get("/images")
@api_role("viewer")
def list_images():
    return jsonify([i.as_dict() for i in os_images.list_images(backend.paths().images)])


# ---- hosts --------------------------------------------------------------------------------

@bp.get("/hosts")
@api_role("viewer")
def list_hosts():
    with backend.fleet() as fleet:
        return jsonify(redact.hosts(overview.host_rows(fleet)))


@bp.get("/hosts/<name>")
@api_role("viewer")
def get_host(name):
    validate_name(name, "host")
    with backend.fleet() as fleet:
        fleet.host(name)  # NotFound for an unknown host
        return jsonify(redact.hosts([r for r in overview.host_rows(fleet) if r["name"] == name])[0])


@bp.post("/hosts/<name>/drain")
@api_role("operator")
def drain_host(name):
    data = parse(Drain)
    return act(lambda fleet: requests.evacuate(fleet, validate_name(name, "host"), deadline=False,
                                               timeout=data.get("timeout", 600.0)))


@bp.post("/hosts/<name>/reclaim")
@api_role("operator")
def reclaim_host(name):
    data = parse(Reclaim)
    return act(lambda fleet: requests.evacuate(fleet, validate_name(name, "host"), deadline=True,
                                               deadline_s=data.get("deadline_s")))


@bp.post("/hosts/<name>/enable")
@api_role("operator")
def enable_host(name):
    parse(Empty)
    return act(lambda fleet: requests.enable(fleet, validate_name(name, "host")))


# ---- VMs ----------------------------------------------------------------------------------

@bp.get("/vms")
@api_role("viewer")
def list_vms():
    """By name, a page at a time: a fleet of 20,000 VMs is 4.6 MB of rows. When more follow, the
    `Link` header names the next page (rel="next", RFC 8288), as GitHub's API does."""
    limit = _whole("limit", VM_PAGE, VM_PAGE_MAX)
    after = request.args.get("after")
    if after is not None:
        validate_name(after)
    with backend.fleet() as fleet:
        rows, last = overview.vm_page(fleet, after=after or "", limit=limit)
    response = jsonify(rows)
    if last is not None:
        response.headers["Link"] = f'<{url_for("api.list_vms", limit=limit, after=last)}>; rel="next"'
    return response


@bp.post("/vms")
@api_role("operator")
def create_vm():
    data = parse(Create)
    if data.get("image"):
        if data.get("workload") or data.get("params"):
            raise InvalidRequest("give either an image or a built-in workload")
        return act(lambda fleet: requests.create_from_image(
            fleet, data["name"], data["image"], memory_mib=data.get("memory_mib", 512),
            vcpus=data.get("vcpus", 1), host=data.get("host"),
            disk_gib=data.get("disk_gib") or 0, ssh_keys=data.get("ssh_keys") or (),
            user_data=data.get("user_data") or "", group=data.get("group", ""),
            gpu_model=data.get("gpu_model", ""),
            gpu_count=data.get("gpu_count", 1 if data.get("gpu_model") else 0),
            local_disk=bool(data.get("local_disk"))))
    return act(lambda fleet: requests.create(
        fleet, data["name"], workload=data.get("workload") or "counter",
        params=data.get("params"), memory_mib=data.get("memory_mib", 128),
        vcpus=data.get("vcpus", 1), host=data.get("host"), gpu_model=data.get("gpu_model", ""),
        gpu_count=data.get("gpu_count", 1 if data.get("gpu_model") else 0),
        group=data.get("group", "")))


@bp.get("/vms/<name>")
@api_role("viewer")
def get_vm(name):
    validate_name(name)
    with backend.fleet() as fleet:
        row = overview.vm_row(fleet, name)
    return jsonify(redact.deep(row | {"operation": backend.operation(name),
                                      "migrations": backend.state().migrations(name)}))


@bp.delete("/vms/<name>")
@api_role("operator")
def destroy_vm(name):
    return act(lambda fleet: requests.destroy(fleet, name))


@bp.get("/vms/<name>/targets")
@api_role("viewer")
def vm_targets(name):
    validate_name(name)
    with backend.fleet() as fleet:
        return jsonify(overview.targets(fleet, name))


@bp.get("/vms/<name>/ssh")
@api_role("viewer")
def vm_ssh(name):
    validate_name(name)
    with backend.fleet() as fleet:
        row = overview.vm_row(fleet, name)  # NotFound for an unknown VM
    address = row["address"] if row.get("address", "-") != "-" else None
    keys = backend.ssh_host_keys(name)
    return jsonify({"user": seed.USER, "address": address, "host_keys": keys,
                    "known_hosts": guest_ssh.known_hosts(address, keys) if address else "",
                    "command": f"ssh {seed.USER}@{address}" if address else ""})


@bp.get("/vms/<name>/migrations")
@api_role("viewer")
def vm_migrations(name):
    validate_name(name)
    with backend.fleet() as fleet:
        overview.vm_row(fleet, name)  # NotFound for an unknown VM
    return jsonify(redact.deep(backend.state().migrations(name)))


@bp.post("/vms/<name>/migrate")
@api_role("operator")
def migrate_vm(name):
    data = parse(Migrate)
    return act(lambda fleet: requests.migrate(
        fleet, validate_name(name), validate_name(data["target"], "host"), data.get("policy"),
        data.get("bandwidth_mibps")))


@bp.post("/vms/<name>/cancel")
@api_role("operator")
def cancel_migration(name):
    parse(Empty)
    return act(lambda fleet: requests.cancel(fleet, name))


@bp.post("/vms/<name>/suspend")
@api_role("operator")
def suspend_vm(name):
    data = parse(Suspend)
    return act(lambda fleet: requests.suspend(fleet, name, data.get("mode")))


@bp.post("/vms/<name>/resume")
@api_role("operator")
def resume_vm(name):
    data = parse(Resume)
    host = data.get("host")
    host = validate_name(host, "host") if host else None
    return act(lambda fleet: requests.resume(fleet, name, host))


@bp.post("/vms/<name>/stop")
@api_role("operator")
def stop_vm(name):
    data = parse(Stop)
    return act(lambda fleet: requests.stop(fleet, name, data.get("timeout")))


@bp.post("/vms/<name>/start")
@api_role("operator")
def start_vm(name):
    parse(Empty)
    return act(lambda fleet: requests.start(fleet, name))


@bp.post("/vms/<name>/reboot")
@api_role("operator")
def reboot_vm(name):
    parse(Empty)
    return act(lambda fleet: requests.reboot(fleet, name))


# ---- tasks and events ---------------------------------------------------------------------

@bp.get("/tasks")
@api_role("viewer")
def list_tasks():
    return jsonify(redact.deep(backend.state().recent_tasks(_count(50))))


@bp.get("/tasks/<task_id>")
@api_role("viewer")
def get_task(task_id):
    status = backend.task_status(task_id) if len(task_id) <= 64 else None
    if status is None:
        raise NotFound(f"unknown task {task_id!r}")
    return jsonify(redact.deep(status))


@bp.get("/events")
@api_role("viewer")
def list_events():
    return jsonify(redact.deep(backend.state().events(count=_count(100))))


@bp.get("/usage")
@api_role("viewer")
def get_usage():
    """Seconds per VM and state in [since, until) (default: the last 30 days)."""
    return jsonify(backend.usage_window(request.args))


@bp.get("/audit")
@api_role("admin")
def get_audit():
    """The audit trail in [since, until) (default: the last 7 days)."""
    window = backend.window(request.args, "7d")
    who, on = request.args.get("who"), request.args.get("on")
    return jsonify(audit.trail(backend.state().r, *window, who or None, on or None))


def _count(default: int) -> int:
    return _whole("count", default, 1000)


def _whole(name: str, default: int, most: int) -> int:
    raw = request.args.get(name, str(default))
    # isdecimal, not isdigit: int() refuses superscript digits, which isdigit lets through
    if not (raw.isascii() and raw.isdecimal()) or not 1 <= int(raw) <= most:
        raise InvalidRequest(f"{name} must be a whole number from 1 to {most}")
    return int(raw)
