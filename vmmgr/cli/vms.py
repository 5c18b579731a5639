"""`vmmgr vm ...`: create, inspect, log in to, stop, start, reboot, suspend, resume and remove
VMs."""

import os
import sys
import time
from pathlib import Path

import click

from .. import (admission, console, display, guest_ssh, overview, requests, suspend as suspension,
               workloads)
from ..addresses import pool_for
from ..edge import Edge
from ..errors import Conflict, HostUnreachable, InvalidRequest
from ..fleet import Fleet
from ..images import ensure_builtin
from ..paths import Paths
from ..spec import make_spec
from ..state import FleetState
from .base import emit_json, log_line, cli
from .dispatch import run_request, wait_option

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
@click.option("--gpu", metavar="MODEL[:COUNT]",
              help="Passed-through devices of this model (the lab's: lab-gpu). Such a VM moves "
                   "by guest hibernation, never by live migration.")
@click.option("--group", default="", metavar="NAME",
              help="A job of several VMs (a training run's ranks): a reclaim moves them the "
                   "same way, and parked ones resume together.")
@click.option("--image", help="Boot this OS image (`vmmgr image list`): a VM with its own disk.")
@click.option("--disk-size", "disk_gib", type=int, default=0, metavar="GiB",
              help="Disk size for --image (default: the image's).")
@click.option("--ssh-key", "ssh_key", type=click.Path(path_type=Path), metavar="FILE",
              help="Public key for the VM's `vmmgr` user (--image).")
@click.option("--user-data", "user_data", type=click.Path(path_type=Path), metavar="FILE",
              help="cloud-init user-data (#cloud-config or a script) for --image.")
@click.option("--local-disk", is_flag=True,
              help="Keep the disk (--image) on its host's own storage, not shared storage: "
                   "it moves with the VM, copied by each migration.")
@wait_option
@click.pass_obj
def vm_create(paths: Paths, name, host_name, workload, params, kernel, initrd, cmdline,
              memory, vcpus, gpu, group, image, disk_gib, ssh_key, user_data, local_disk,
              wait) -> None:
    """Define and start a VM."""
    gpu_model, _, gpu_count = (gpu or "").partition(":")
    if gpu_count and not gpu_count.isdigit():
        raise InvalidRequest(f"--gpu wants MODEL[:COUNT], not {gpu!r}")
    gpu_count = int(gpu_count or 1) if gpu_model else 0
    if kernel and (workload or params):
        raise InvalidRequest("give either --kernel (with --initrd/--cmdline) or --workload")
    if image and (workload or params or kernel):
        raise InvalidRequest("give either --image or a built-in --workload or --kernel")
    if (disk_gib or ssh_key or user_data or local_disk) and not image:
        raise InvalidRequest("--disk-size, --local-disk, --ssh-key and --user-data go with "
                             "--image")
    if image:
        spec = make_spec(name, memory_mib=memory, vcpus=vcpus, image_root=paths.images,
                         image=image, disk_gib=disk_gib, group=group, gpu_model=gpu_model,
                         gpu_count=gpu_count, local_disk=local_disk,
                         ssh_keys=(_read_text(ssh_key, "SSH key"),) if ssh_key else (),
                         user_data=_read_text(user_data, "user-data") if user_data else "")
    elif kernel:
        spec = make_spec(name, memory_mib=memory, vcpus=vcpus, kernel=kernel, initrd=initrd,
                         cmdline=cmdline, image_root=paths.images, gpu_model=gpu_model,
                         gpu_count=gpu_count, group=group)
    else:
        workload = workload or "counter"
        line = workloads.cmdline(workload, _parse_params(params))
        image = ensure_builtin(paths.images, log_line)
        spec = make_spec(name, memory_mib=memory, vcpus=vcpus, kernel=image.kernel,
                         initrd=image.initrd, cmdline=line, image_root=paths.images,
                         workload=workload, gpu_model=gpu_model, gpu_count=gpu_count,
                         group=group)
    with Fleet(paths) as fleet:
        admission.creation(fleet, spec, host_name)
    result = run_request(paths, requests.create_spec(spec, host_name), wait=wait)
    if result:
        click.echo(f"{result['vm']} running on {result['host']}")


def _read_text(path: Path, what: str) -> str:
    """A file the operator names, read here (the request carries its text): a clear error,
    and nothing created, when it cannot be read."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidRequest(f"cannot read the {what} file {path}: "
                             f"{getattr(err, 'strerror', None) or err}") from None


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
    """Every VM on every host, and the suspended ones (from the fleet's view: no host is asked)."""
    with Fleet(paths) as fleet:
        if as_json:  # the view's rows as they are stored: nothing to decode or encode
            return click.echo(fleet.state.vm_views_json())
        rows = sorted(fleet.state.vm_views(), key=lambda r: r["name"])
    click.echo(display.table(
        ["vm", "host", "state", "memory", "vcpus", "workload"],
        [[r["name"], r["host"], r["state"], f"{r['memory_mib']} MiB", r["vcpus"],
          r["workload"] or "-"] for r in rows]))


@vm.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def vm_show(paths: Paths, name: str, as_json: bool) -> None:
    """One VM: where it runs, its size, its console's hosts, its record and migration attempts."""
    with Fleet(paths) as fleet:
        row = overview.vm_row(fleet, name)  # NotFound for an unknown VM
        console_hosts = console.hosts_seen(fleet.consoles, name)
    info = {k: row[k] for k in ("name", "host", "state", "memory_mib", "vcpus")}
    if row["host"] == "-":
        info["suspended_from"] = row["suspended_from"]
    else:
        info["workload"] = row["workload"] or ""
    info["console_hosts"] = console_hosts
    info |= _network_path(paths, name)
    if row.get("device_count"):
        info["devices"] = f"{row['device_count']} x {row['device_model']}"
    info["moves_by"] = f"{row['moves_by']['mode']}: {row['moves_by']['reason']}"
    migrations = []
    if paths.redis_url():
        fleet_state = FleetState(paths.redis_url())
        holder = fleet_state.holder("vm", name)
        info["operation"] = holder.split(" ", 1)[1] if holder else "-"
        migrations = fleet_state.migrations(name)
    if as_json:
        return emit_json(info | {"migrations": migrations})
    for key, value in info.items():
        click.echo(f"{key:14} {', '.join(value) if isinstance(value, list) else value}")
    if migrations:
        click.echo("migrations:")
        click.echo(display.table(
            ["started", "from", "to", "status", "blackout", "total / error"],
            [[time.strftime("%H:%M:%S", time.localtime(m.get("started_at", 0))), m["source"],
              m["target"], m["status"],
              f"{m['downtime_ms']} ms" if m.get("downtime_ms") is not None else "-",
              f"{m['total_ms']} ms" if m["status"] == "completed" else m.get("error", "")]
             for m in migrations[-10:]]))


def _network_path(paths: Paths, vm: str) -> dict:
    """The VM's stable address and the way traffic reaches it: edge -> the host it is routed to."""
    pool = pool_for(paths)
    address = pool.address_of(vm) if pool else None
    if not address:
        return {"address": "-"}
    edge = Edge.load(paths, None)  # reads only: no lock
    routed = edge.routes().get(address) if edge else None
    return {"address": address, "path": f"edge -> {routed}" if routed else "not routed"}


@vm.command("console")
@click.argument("name")
@click.option("--follow", "-f", is_flag=True, help="Keep printing as the VM writes.")
@click.pass_obj
def vm_console(paths: Paths, name: str, follow: bool) -> int | None:
    """The VM's whole serial output, across every host it ran on (exit 5, after the rest, when
    a part is on a site none of whose hosts answers)."""
    with Fleet(paths) as fleet:
        admission.known_vm(fleet, name)  # a suspended VM's output is on storage too
        out = sys.stdout.buffer
        if not follow:
            unread: list[console.Segment] = []
            out.write(console.read(fleet.consoles, name, unread))
            out.flush()
            for segment in unread:  # the rest is printed: say what is missing, and why
                click.echo(f"warning: what {name} wrote on {segment.host} (segment "
                           f"{segment.seq}) cannot be read now: no host of its site answers",
                           err=True)
            return HostUnreachable.exit_code if unread else 0
        try:
            for chunk in console.follow(fleet.consoles, name):
                out.write(chunk)
                out.flush()
        except KeyboardInterrupt:
            pass


@vm.command("ssh", context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.option("-i", "identity", type=click.Path(path_type=Path), metavar="FILE",
              help="The private key of the --ssh-key given at create (default: ssh's own).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_obj
def vm_ssh(paths: Paths, name: str, identity: Path | None, command: tuple[str, ...]) -> None:
    """Log in to a VM from an image (or run COMMAND there, after --, as ssh would) at its
    stable address, through the edge, with the VM's host keys pinned from its console."""
    with Fleet(paths) as fleet:
        admission.known_vm(fleet, name)
        guest = fleet.find(name)
        if guest is None or not guest.is_active():
            raise Conflict(f"{name} is not running (vm list shows its state)")
        lab = fleet.host(guest.host_name).record.lab
        printed = console.read(fleet.consoles, name).decode(errors="replace")
    address = pool_for(paths).address_of(name) if pool_for(paths) else None
    if address is None:
        raise Conflict(f"{name} has no stable address")
    keys = guest_ssh.host_keys(printed)
    if not keys:
        raise Conflict(f"{name} printed no SSH host keys on its console (cloud-init prints them "
                       f"when the VM first boots an image: is it up yet?)")
    if identity is not None and not identity.is_file():
        raise InvalidRequest(f"cannot read the key file {identity}")
    known = paths.home / "known_hosts" / name
    known.parent.mkdir(mode=0o700, exist_ok=True)
    known.write_text(guest_ssh.known_hosts(address, keys))
    argv = guest_ssh.argv(identity, address, " ".join(command),
                          guest_ssh.lab_prefix() if lab else [], known_hosts_file=known,
                          tty=not command and sys.stdin.isatty())
    os.execvp(argv[0], argv)


@vm.command("suspend")
@click.argument("name")
@click.option("--mode", type=click.Choice(suspension.MODES),
              help="save: the host saves memory and device state; guest: the guest hibernates "
                   "itself through its agent (VMs with passed-through devices). Default: save, "
                   "or guest when a device blocks a save.")
@click.option("--json", "as_json", is_flag=True)
@wait_option
@click.pass_obj
def vm_suspend(paths: Paths, name: str, mode: str | None, as_json: bool, wait: bool) -> None:
    """Suspend a running VM to shared storage and free its host; `resume` continues it anywhere."""
    with Fleet(paths) as fleet:
        req = requests.suspend(fleet, name, mode)
    record = run_request(paths, req, wait=wait, events=not as_json)
    if record is None:
        return
    if as_json:
        return emit_json(record)
    how = "hibernated by its guest" if record.get("mode") == "guest" else "suspended"
    click.echo(f"{name} {how} from {record['from_host']}: "
               f"{record['image_bytes'] / display.MiB:.0f} MiB image in {record['save_ms']} ms")


@vm.command("resume")
@click.argument("name")
@click.option("--host", "host_name", help="Where to resume it (default: the host with most room).")
@click.option("--json", "as_json", is_flag=True)
@wait_option
@click.pass_obj
def vm_resume(paths: Paths, name: str, host_name: str | None, as_json: bool, wait: bool) -> None:
    """Restore a suspended VM, exactly where it stopped."""
    with Fleet(paths) as fleet:
        req = requests.resume(fleet, name, host_name)
    result = run_request(paths, req, wait=wait, events=not as_json)
    if result is None:
        return
    if as_json:
        return emit_json(result)
    if result.get("restored") is False:
        raise click.ClickException(
            f"{name} runs on {result['host']}, but its hibernation image did not restore: the "
            f"guest booted afresh and what it had in memory is lost")
    click.echo(f"{name} resumed on {result['host']} in {result['restore_ms']} ms "
               f"(suspended for {result['suspended_for_s']:.1f} s)")


@vm.command("destroy")
@click.argument("name")
@wait_option
@click.pass_obj
def vm_destroy(paths: Paths, name: str, wait: bool) -> None:
    """Power a VM off and remove it (and its console log); a suspended VM loses its image."""
    with Fleet(paths) as fleet:
        req = requests.destroy(fleet, name)
    result = run_request(paths, req, wait=wait)
    if result:
        click.echo(f"{name} destroyed on {result['host']}")


@vm.command("stop")
@click.argument("name")
@click.option("--timeout", type=float, default=None, metavar="SECONDS",
              help="How long its OS gets to shut down (default 120).")
@wait_option
@click.pass_obj
def vm_stop(paths: Paths, name: str, timeout: float | None, wait: bool) -> None:
    """Shut a VM down cleanly; it keeps its host, disk and address until `vm start`."""
    with Fleet(paths) as fleet:
        req = requests.stop(fleet, name, timeout)
    result = run_request(paths, req, wait=wait)
    if result:
        click.echo(f"{name} stopped on {result['host']}")


@vm.command("start")
@click.argument("name")
@wait_option
@click.pass_obj
def vm_start(paths: Paths, name: str, wait: bool) -> None:
    """Boot a stopped VM again."""
    with Fleet(paths) as fleet:
        req = requests.start(fleet, name)
    result = run_request(paths, req, wait=wait)
    if result:
        click.echo(f"{name} running on {result['host']}")


@vm.command("reboot")
@click.argument("name")
@wait_option
@click.pass_obj
def vm_reboot(paths: Paths, name: str, wait: bool) -> None:
    """Ask a VM's OS to reboot (it stays on its host, with everything it wrote)."""
    with Fleet(paths) as fleet:
        req = requests.reboot(fleet, name)
    result = run_request(paths, req, wait=wait)
    if result:
        click.echo(f"{name} rebooting on {result['host']}")
