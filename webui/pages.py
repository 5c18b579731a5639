"""The console's pages: fleet, VMs, one VM (live progress, history, console, actions), events.

Actions are CSRF-protected form posts that queue a task and come back to the page, with the
refusal (nothing changed) or the queued task flashed at the top.
"""

import itertools
import json
import time

from flask import (Blueprint, Response, flash, g, redirect, render_template, request,
                   stream_with_context, url_for)

from markupsafe import Markup, escape

from vmmgr import os_images, overview, requests, usage
from vmmgr.deadline import parse_duration
from vmmgr.errors import InvalidRequest, NotFound, VmmgrError
from vmmgr.policy import DEFAULT_POLICY, POLICIES
from vmmgr.spec import validate_name
from vmmgr.workloads import WORKLOADS

from . import backend, charts, redact
from .auth import page_role

bp = Blueprint("pages", __name__)
VM_PAGE = 500  # rows on the VMs page; the rest a link away


@bp.get("/")
@page_role("viewer")
def fleet():
    with backend.fleet() as f:
        views = f.state.vm_views()
        hosts = redact.hosts(overview.host_rows(f, views))
        # The page lists each host's VMs by name; only the parked ones need a full row.
        parked = overview.vm_rows(f, hosts, [v for v in views if v["host"] == "-"])
        history = f.state.capacity_history(time.time() - 86400)
    images = os_images.list_images(backend.paths().images)
    return render_template("fleet.html", hosts=hosts, vms=parked, vm_links=_vm_links(hosts),
                           images=images,
                           capacity_chart=charts.lines(
                               [float(h["time"]) for h in history],
                               {"used MiB": [float(h["used"]) for h in history],
                                "total MiB": [float(h["total"]) for h in history]},
                               "MiB", "Fleet memory used and total, last 24 hours"))


@bp.app_template_global()
def blackout_chart(migrations: list[dict]):
    """Each completed hop's blackout, oldest first (the history lists newest first)."""
    hops = [m for m in reversed(migrations)
            if m.get("status") == "completed" and m.get("downtime_ms") is not None]
    return charts.bars([float(m["downtime_ms"]) for m in hops],
                       [f"{m.get('source')} -> {m.get('target')}" for m in hops],
                       "ms", "Blackout per hop")


def _vm_links(hosts: list[dict]) -> dict[str, Markup]:
    """Each host's VMs as list items linking to their pages: built here, each name escaped once,
    because a thousand hosts hold twenty thousand of them (the template took 4x as long)."""
    prefix = url_for("pages.vms") + "/"
    links = {}
    for h in hosts:
        items = []
        for name in h.get("vms", ()):
            safe = escape(name)
            items.append(f'<li><a href="{prefix}{safe}">{safe}</a></li>')
        links[h["name"]] = Markup("".join(items))
    return links


@bp.get("/vms")
@page_role("viewer")
def vms():
    after = request.args.get("after")
    if after is not None:
        validate_name(after)
    with backend.fleet() as f:
        views = f.state.vm_views()
        hosts = overview.host_rows(f, views)
        rows, last = overview.vm_page(f, hosts, views, after=after or "", limit=VM_PAGE)
    return render_template("vms.html", vms=rows, hosts=hosts, workloads=WORKLOADS,
                           images=os_images.list_images(backend.paths().images),
                           next_page=url_for("pages.vms", after=last) if last else None,
                           paged=after is not None)


@bp.get("/vms/<name>")
@page_role("viewer")
def vm(name):
    with backend.fleet() as f:
        row = overview.vm_row(f, name)
        targets = overview.targets(f, name) if row["host"] != "-" else []
        hosts = [h["name"] for h in overview.host_rows(f)]
    st = backend.state()
    return render_template("vm.html", vm=row, targets=targets, hosts=hosts,
                           migrations=redact.deep(list(reversed(st.migrations(name)))),
                           operation=backend.operation(name),
                           events=redact.deep(st.events(200, vm=name)[-20:]),
                           policies=POLICIES, default_policy=DEFAULT_POLICY,
                           host_keys=backend.ssh_host_keys(name))


@bp.get("/vms/<name>/summary")
@page_role("viewer")
def vm_summary(name):
    """The facts and history part of the VM page, refreshed after an operation ends."""
    with backend.fleet() as f:
        row = overview.vm_row(f, name)
    return render_template("vm_summary.html", vm=row,
                           migrations=redact.deep(
                               list(reversed(backend.state().migrations(name)))))


@bp.get("/usage")
@page_role("viewer")
def usage_page():
    try:
        # the form sends its empty fields: "not given" (the API takes none empty)
        report = backend.usage_window({k: v for k, v in request.args.items() if v})
    except InvalidRequest as err:
        flash(f"refused: {err}", "error")
        report = backend.usage_window({})
    return render_template("usage.html", report=report, categories=usage.CATEGORIES,
                           window=max(report["until"] - report["since"], 1e-9),
                           since_text=request.args.get("since", "30d"),
                           until_text=request.args.get("until", ""))


@bp.get("/events")
@page_role("viewer")
def events():
    return render_template("events.html",
                           events=redact.deep(list(reversed(backend.state().events(300)))))


# ---- live streams (server-sent events) -------------------------------------------------------

def _sse(chunks) -> Response:
    def gen():
        yield "retry: 1000\n\n"
        for data in chunks:
            yield f"data: {json.dumps(data)}\n\n"
    return Response(stream_with_context(gen()), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@bp.get("/vms/<name>/progress")
@page_role("viewer")
def vm_progress(name):
    # Only for a VM that exists or has an operation (one being created): a stream held open
    # for any name would let a few viewers tie up the server's threads.
    if not (backend.operation(name) or backend.last_operation(name)):
        with backend.fleet() as f:
            if f.find(name) is None and not f.is_suspended(name):
                raise NotFound(f"unknown VM {name!r}")
    return _sse(redact.deep(snap) for snap in backend.progress_stream(name))


@bp.get("/vms/<name>/console")
@page_role("viewer")
def vm_console(name):
    with backend.fleet() as f:
        if f.find(name) is None and not f.is_suspended(name):
            raise NotFound(f"unknown VM {name!r}")
    return _sse(itertools.chain([None], backend.console_stream(name)))  # None: clear the screen


# ---- actions ---------------------------------------------------------------------------------

def _act(build, back: str):
    """Check and queue a request built from the fleet; flash the outcome and go back."""
    try:
        with backend.fleet() as f:
            try:
                req = build(f)
            except VmmgrError as err:
                args = request.view_args or {}
                backend.refused(args.get("action") or request.endpoint.rsplit("_", 1)[-1],
                                args.get("name") or request.form.get("name", ""),
                                {k: v for k, v in request.form.items() if k != "csrf_token"},
                                err)
                raise
        task = backend.submit(req)
        backend.state().event(f"{req.op} submitted by {g.user.name} (web console)",
                              task=task["task"])
        flash(f"{req.op.replace('_', ' ')} queued (task {task['task']})", "ok")
    except VmmgrError as err:
        flash(f"refused: {err}", "error")
    return redirect(back, code=303)


def _int(field: str, default: int | None) -> int | None:
    raw = request.form.get(field, "").strip()
    if not raw:
        return default
    # ASCII digits only: isdigit() lets a superscript two through, which int() then refuses
    if not (raw.isascii() and raw.isdecimal()) or len(raw) > 9:
        raise InvalidRequest(f"{field} must be a whole number, not {raw[:20]!r}")
    return int(raw)


@bp.post("/vms")
@page_role("operator")
def vm_create():
    def build(f):
        if request.form.get("image"):  # a VM from an OS image, with its own disk
            keys = [line for line in request.form.get("ssh_key", "").splitlines() if line.strip()]
            return requests.create_from_image(
                f, request.form.get("name", "").strip(), request.form["image"],
                memory_mib=_int("memory_mib", 512), vcpus=_int("vcpus", 1),
                host=request.form.get("host") or None, disk_gib=_int("disk_gib", 0),
                ssh_keys=keys, user_data=request.form.get("user_data", "").replace("\r\n", "\n"),
                gpu_model=request.form.get("gpu_model", ""),
                gpu_count=1 if request.form.get("gpu_model") else 0,
                local_disk=request.form.get("local_disk") == "on")
        params = {}
        for word in request.form.get("params", "").split():
            key, sep, value = word.partition("=")
            if not sep or not key:
                raise InvalidRequest(f"parameters are KEY=VALUE words, not {word!r}")
            params[key] = value
        return requests.create(f, request.form.get("name", "").strip(),
                               workload=request.form.get("workload") or "counter", params=params,
                               memory_mib=_int("memory_mib", 128), vcpus=_int("vcpus", 1),
                               host=request.form.get("host") or None,
                               gpu_model=request.form.get("gpu_model", ""),
                               gpu_count=1 if request.form.get("gpu_model") else 0)
    return _act(build, url_for("pages.vms"))


@bp.post("/vms/<name>/migrate")
@page_role("operator")
def vm_migrate(name):
    return _act(lambda f: requests.migrate(f, name, request.form.get("target", ""),
                                           request.form.get("policy") or None,
                                           _int("bandwidth_mibps", None)),
                url_for("pages.vm", name=name))


@bp.post("/vms/<name>/<action>")
@page_role("operator")
def vm_action(name, action):
    builders = {"cancel": lambda f: requests.cancel(f, name),
                "suspend": lambda f: requests.suspend(f, name),
                "resume": lambda f: requests.resume(f, name, request.form.get("host") or None),
                "stop": lambda f: requests.stop(f, name),
                "start": lambda f: requests.start(f, name),
                "reboot": lambda f: requests.reboot(f, name),
                "destroy": lambda f: requests.destroy(f, name)}
    if action not in builders:
        raise NotFound(f"no action {action!r}")
    back = url_for("pages.vms") if action == "destroy" else url_for("pages.vm", name=name)
    return _act(builders[action], back)


def _deadline() -> float | None:
    raw = (request.form.get("deadline") or "").strip()
    return parse_duration(raw) if raw else None


@bp.post("/hosts/<name>/<action>")
@page_role("operator")
def host_action(name, action):
    builders = {"drain": lambda f: requests.evacuate(f, name, deadline=False),
                "reclaim": lambda f: requests.evacuate(f, name, deadline=True,
                                                       deadline_s=_deadline()),
                "enable": lambda f: requests.enable(f, name)}
    if action not in builders:
        raise NotFound(f"no action {action!r}")
    return _act(builders[action], url_for("pages.fleet"))
