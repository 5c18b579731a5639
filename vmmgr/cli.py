"""The admin CLI, `vmmgr`. Each command is a few lines over the core.

Exit codes: 0 success, 1 failure, 2 bad request or usage, 3 not found, 4 conflict (busy, no room,
exists), 5 host unreachable, 6 migration failed or cancelled (the VM still runs on its source).
"""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import click

from . import console, demo as demo_mod, display, workloads
from .errors import InvalidRequest, VmmgrError
from .fleet import Fleet, VMInfo
from .images import ensure_builtin
from .lab import Lab, status_dicts
from .migration import cancel as cancel_migration, migrate as run_migration
from .paths import Paths, default_paths
from .placement import choose_host
from .policy import DEFAULT_POLICY, POLICIES, get_policy
from .spec import make_spec
from . import reclaim, suspend as suspension


def main() -> None:
    try:
        cli(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except VmmgrError as err:
        click.echo(f"vmmgr: error: {err}", err=True)
        sys.exit(err.exit_code)


def _log(msg: str) -> None:
    click.echo(f"  {msg}", err=True)


def _emit_json(data) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@click.group()
@click.option("--home", type=click.Path(file_okay=False, path_type=Path), envvar="VMMGR_HOME",
              help="State directory (default /var/lib/vmmgr, or $VMMGR_HOME).")
@click.pass_context
def cli(ctx: click.Context, home: Path | None) -> None:
    """vmmgr: resumable compute on QEMU/KVM."""
    ctx.obj = Paths(home) if home else default_paths()


# ---- lab -----------------------------------------------------------------------------------

@cli.group()
def lab() -> None:
    """The local lab: several hosts on this machine."""


@lab.command("up")
@click.option("--hosts", default=3, show_default=True, type=click.IntRange(1, 9))
@click.option("--accel", type=click.Choice(["kvm", "tcg"]), help="Skip detection and use this.")
@click.pass_obj
def lab_up(paths: Paths, hosts: int, accel: str | None) -> None:
    """Start (or repair) a lab of N hosts."""
    records = Lab(paths, log=_log).up(hosts, accel)
    click.echo(display.table(["host", "uri", "accel"], [[r.name, r.uri, r.accel] for r in records]))


@lab.command("status")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def lab_status(paths: Paths, as_json: bool) -> None:
    """The lab's hosts and whether their daemons answer."""
    statuses = Lab(paths).status()
    if as_json:
        return _emit_json({"accel": Lab(paths).accel(), "hosts": status_dicts(statuses)})
    if not statuses:
        click.echo("the lab is down")
        return
    rows = [[s.name, s.ip, s.libvirtd_pid or "-", "yes" if s.reachable else "NO", s.vms]
            for s in statuses]
    click.echo(display.table(["host", "address", "libvirtd", "answers", "vms"], rows))


@lab.command("down")
@click.pass_obj
def lab_down(paths: Paths) -> None:
    """Remove every namespace, daemon, VM and link of the lab."""
    removed = Lab(paths, log=_log).down()
    click.echo(f"removed {len(removed)} namespaces and links" if removed else "nothing to remove")


# ---- hosts -------------------------------------------------------------------------------

@cli.group()
def host() -> None:
    """Hosts in the inventory."""


@host.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def host_list(paths: Paths, as_json: bool) -> None:
    """Hosts with their capacity, free memory and VMs."""
    rows = []
    with Fleet(paths) as fleet:
        for h in fleet.hosts():
            try:
                cap = h.capacity()
                rows.append({"name": h.name, "uri": h.uri, "accel": h.accel, "reachable": True,
                             "state": h.record.state,
                             **asdict(cap), "free_memory_mib": cap.free_memory_mib,
                             "free_vcpus": cap.free_vcpus})
            except VmmgrError as err:
                rows.append({"name": h.name, "uri": h.uri, "accel": h.accel, "reachable": False,
                             "state": h.record.state, "error": str(err)})
    if as_json:
        return _emit_json(rows)
    click.echo(display.table(
        ["host", "state", "accel", "memory (free/total MiB)", "vCPUs (free/total)", "vms"],
        [[r["name"], r["state"], r["accel"],
          f"{r['free_memory_mib']}/{r['memory_mib']}" if r["reachable"] else "unreachable",
          f"{r['free_vcpus']}/{r['vcpus']}" if r["reachable"] else "-",
          ",".join(r.get("vms", ())) or "-"] for r in rows]))


@host.command("reclaim")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def host_reclaim(paths: Paths, name: str, as_json: bool) -> None:
    """Empty a host now: live-migrate what fits elsewhere, suspend the rest to disk."""
    _evacuate(paths, name, deadline=True, as_json=as_json)


@host.command("drain")
@click.argument("name")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for room.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def host_drain(paths: Paths, name: str, timeout: float, as_json: bool) -> None:
    """Empty a host by live migration only, waiting for room where there is none yet."""
    _evacuate(paths, name, deadline=False, as_json=as_json, wait_timeout=timeout)


def _evacuate(paths: Paths, name: str, deadline: bool, as_json: bool, **kw) -> None:
    with Fleet(paths) as fleet:
        report = reclaim.evacuate(fleet, name, deadline,
                                  on_event=(lambda m: None) if as_json else _log, **kw)
    if as_json:
        return _emit_json(asdict(report))
    click.echo(f"{name}: {len(report.migrated)} migrated, {len(report.suspended)} suspended, "
               f"{len(report.failed)} failed in {report.seconds} s")
    if report.failed:
        raise VmmgrError(f"{len(report.failed)} VMs could not be moved: "
                         + "; ".join(f"{vm}: {e}" for vm, e in report.failed.items()))


@host.command("enable")
@click.argument("name")
@click.pass_obj
def host_enable(paths: Paths, name: str) -> None:
    """Put a host back in service; parked VMs resume on it (or anywhere with room)."""
    with Fleet(paths) as fleet:
        resumed = reclaim.enable(fleet, name, on_event=_log)
    click.echo(f"{name} active; {len(resumed)} parked VMs resumed")


@cli.command()
@click.pass_obj
def reconcile(paths: Paths) -> None:
    """Resume parked (suspended) VMs, oldest first, wherever there is room."""
    with Fleet(paths) as fleet:
        resumed = reclaim.resume_parked(fleet, on_event=_log)
        left = len(suspension.suspended(fleet))
    click.echo(f"{len(resumed)} parked VMs resumed, {left} still parked")


# ---- VMs -----------------------------------------------------------------------------------

@cli.group()
def vm() -> None:
    """Create, inspect and remove VMs."""


@vm.command("create")
@click.argument("name")
@click.option("--host", "host_name", help="Where to start it (default: the host with most room).")
@click.option("--workload", help="Built-in guest workload (default counter, unless --kernel).")
@click.option("--param", "params", multiple=True, metavar="KEY=VALUE",
              help="Workload parameter, e.g. --param interval=0.5 --param count=100.")
@click.option("--kernel", help="Kernel image (inside the image directory).")
@click.option("--initrd", help="Initrd image (inside the image directory).")
@click.option("--cmdline", default="console=ttyS0", show_default=True,
              help="Kernel command line for --kernel.")
@click.option("--memory", default=128, show_default=True, help="MiB.")
@click.option("--vcpus", default=1, show_default=True)
@click.pass_obj
def vm_create(paths: Paths, name, host_name, workload, params, kernel, initrd, cmdline,
              memory, vcpus) -> None:
    """Define and start a VM."""
    if kernel and (workload or params):
        raise InvalidRequest("give either --kernel (with --initrd/--cmdline) or --workload")
    if kernel:
        spec = make_spec(name, memory_mib=memory, vcpus=vcpus, kernel=kernel, initrd=initrd,
                         cmdline=cmdline, image_root=paths.images)
    else:
        workload = workload or "counter"
        line = workloads.cmdline(workload, _parse_params(params))
        image = ensure_builtin(paths.images, _log)
        spec = make_spec(name, memory_mib=memory, vcpus=vcpus, kernel=image.kernel,
                         initrd=image.initrd, cmdline=line, image_root=paths.images,
                         workload=workload)
    with Fleet(paths) as fleet:
        if not host_name:
            host_name, refused = choose_host(fleet.active_capacities(), spec.memory_mib, spec.vcpus)
            if host_name is None:
                why = "; ".join(f"{h}: {r}" for h, r in refused.items()) or "no hosts"
                raise VmmgrError(f"no host has room for {name}: {why}")
        guest = fleet.create(spec, host_name)
        click.echo(f"{guest.name} running on {guest.host_name}")


def _parse_params(params: tuple[str, ...]) -> dict[str, str]:
    parsed = {}
    for p in params:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"--param wants KEY=VALUE, not {p!r}")
        parsed[key] = value
    return parsed


@vm.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def vm_list(paths: Paths, as_json: bool) -> None:
    """Every VM on every host."""
    with Fleet(paths) as fleet:
        infos = fleet.vms()
        infos += [VMInfo(r.vm, "-", "suspended", r.memory_mib, r.vcpus, "")
                  for r in suspension.suspended(fleet)]
    if as_json:
        return _emit_json([asdict(i) for i in infos])
    click.echo(display.table(
        ["vm", "host", "state", "memory", "vcpus", "workload"],
        [[i.name, i.host, i.state, f"{i.memory_mib} MiB", i.vcpus, i.workload or "-"]
         for i in infos]))


@vm.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def vm_show(paths: Paths, name: str, as_json: bool) -> None:
    """One VM: where it runs, its size, and the hosts its console came from."""
    with Fleet(paths) as fleet:
        g = fleet.locate(name)
        info = {
            "name": g.name, "uuid": g.uuid, "host": g.host_name, "state": g.state(),
            "memory_mib": g.memory_mib(), "vcpus": g.vcpus(), "workload": g.workload(),
            "console_hosts": console.hosts_seen(paths.consoles, name),
        }
    if as_json:
        return _emit_json(info)
    for key, value in info.items():
        click.echo(f"{key:14} {', '.join(value) if isinstance(value, list) else value}")


@vm.command("console")
@click.argument("name")
@click.option("--follow", "-f", is_flag=True, help="Keep printing as the VM writes.")
@click.pass_obj
def vm_console(paths: Paths, name: str, follow: bool) -> None:
    """The VM's whole serial output, across every host it ran on."""
    with Fleet(paths) as fleet:
        fleet.locate(name)  # NotFound for an unknown VM
    out = sys.stdout.buffer
    if not follow:
        out.write(console.read(paths.consoles, name))
        out.flush()
        return
    try:
        for chunk in console.follow(paths.consoles, name):
            out.write(chunk)
            out.flush()
    except KeyboardInterrupt:
        pass


@vm.command("suspend")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def vm_suspend(paths: Paths, name: str, as_json: bool) -> None:
    """Save a running VM to shared storage and free its host; `resume` continues it anywhere."""
    with Fleet(paths) as fleet:
        record = suspension.suspend(fleet, name)
    if as_json:
        return _emit_json(asdict(record))
    click.echo(f"{name} suspended from {record.from_host}: {record.image_bytes / display.MiB:.0f} MiB "
               f"image in {record.save_ms} ms")


@vm.command("resume")
@click.argument("name")
@click.option("--host", "host_name", help="Where to resume it (default: the host with most room).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def vm_resume(paths: Paths, name: str, host_name: str | None, as_json: bool) -> None:
    """Restore a suspended VM, exactly where it stopped."""
    with Fleet(paths) as fleet:
        result = suspension.resume(fleet, name, host_name)
    if as_json:
        return _emit_json(asdict(result))
    click.echo(f"{name} resumed on {result.host} in {result.restore_ms} ms "
               f"(suspended for {result.suspended_for_s:.1f} s)")


@vm.command("destroy")
@click.argument("name")
@click.pass_obj
def vm_destroy(paths: Paths, name: str) -> None:
    """Power a VM off and remove it (and its console log); a suspended VM loses its image."""
    with Fleet(paths) as fleet:
        where = fleet.destroy(name)
    click.echo(f"{name} destroyed on {where}")


# ---- migration -----------------------------------------------------------------------------

class _StartByDefault(click.Group):
    """`vmmgr migrate NAME --to HOST` means `vmmgr migrate start NAME --to HOST`."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["start", *args]
        return super().parse_args(ctx, args)


@cli.group(cls=_StartByDefault)
def migrate() -> None:
    """Live-migrate VMs: `migrate NAME --to HOST`, `migrate cancel NAME`, `migrate policies`."""


@migrate.command("start")
@click.argument("name")
@click.option("--to", "target", required=True, help="Destination host.")
@click.option("--policy", "policy_name", help=f"Migration policy (default {DEFAULT_POLICY}).")
@click.option("--bandwidth", type=int, help="Cap in MiB/s (default: unlimited).")
@click.option("--json", "as_json", is_flag=True, help="Print the result record as JSON.")
@click.pass_obj
def migrate_start(paths: Paths, name: str, target: str, policy_name: str | None,
                  bandwidth: int | None, as_json: bool) -> None:
    """Live-migrate a VM to another host, with a progress bar."""
    policy = get_policy(policy_name, bandwidth)
    show = _progress_printer(enabled=not as_json)
    with Fleet(paths) as fleet:
        try:
            result = run_migration(fleet, name, target, policy=policy, on_progress=show)
        finally:
            show(None)
    if as_json:
        return _emit_json(result.as_dict())
    click.echo(f"{name}: {result.source} -> {result.target}  total {result.total_ms} ms  "
               f"blackout {'n/a' if result.downtime_ms is None else f'{result.downtime_ms} ms'}  sent {result.bytes_transferred / display.MiB:.1f} MiB"
               f"  iterations {result.memory_iterations}"
               + ("  (post-copy)" if result.postcopy else ""))


@migrate.command("cancel")
@click.argument("name")
@click.pass_obj
def migrate_cancel(paths: Paths, name: str) -> None:
    """Abort a VM's running migration; it keeps running where it was."""
    with Fleet(paths) as fleet:
        source = cancel_migration(fleet, name)
    click.echo(f"cancelled the migration of {name}; it keeps running on {source}")


@migrate.command("policies")
@click.option("--json", "as_json", is_flag=True)
def migrate_policies(as_json: bool) -> None:
    """The named migration policies and what each guarantees."""
    if as_json:
        return _emit_json([asdict(p) for p in POLICIES.values()])
    for p in POLICIES.values():
        default = " (default)" if p.name == DEFAULT_POLICY else ""
        click.echo(f"{p.name}{default}\n  {p.description}\n")


def _progress_printer(enabled: bool):
    """A callback that redraws one progress line on a terminal (one line per update otherwise),
    with the engine's actions and warnings printed once above it."""
    tty = sys.stderr.isatty()
    state = {"drawn": False, "warned": set()}

    def show(progress) -> None:
        if not enabled:
            return
        if progress is None:
            if state["drawn"] and tty:
                click.echo("", err=True)
            state["drawn"] = False
            return
        for note in display.progress_notes(progress, state["warned"]):
            click.echo(("\r\033[K" + note) if tty else note, err=True)
        if progress.warning:
            state["warned"].add(progress.warning)
        line = display.progress_line(progress)
        click.echo(("\r\033[K" + line) if tty else line, err=True, nl=not tty)
        state["drawn"] = True

    return show


# ---- demo ----------------------------------------------------------------------------------

@cli.command()
@click.option("--hosts", default=3, show_default=True, type=click.IntRange(2, 9))
@click.option("--keep-lab", is_flag=True, help="Leave the lab running afterwards.")
@click.pass_obj
def demo(paths: Paths, hosts: int, keep_lab: bool) -> None:
    """Boot a counter VM, move it around the lab while it counts, compare with one that stayed."""
    report = demo_mod.run(paths, hosts=hosts, keep_lab=keep_lab, echo=click.echo,
                          on_progress=_progress_printer(enabled=True))
    if not report.identical:
        raise VmmgrError("the moved VM's output differs from the reference run")


if __name__ == "__main__":
    main()
