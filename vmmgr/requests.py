"""Operator requests, checked and described once for every surface (CLI, web console, REST).

A builder runs the request's admission checks (a bad request raises here and nothing changes) and
returns what the task API needs to run it: the operation, its arguments, the host whose worker
runs it and the lock taken before it is queued. No Celery here: `tasks.client` submits these.
"""

import time
from dataclasses import asdict, dataclass

from . import admission, workloads
from .errors import InvalidRequest
from .fleet import Fleet
from .images import ensure_builtin
from .policy import get_policy
from .suspend import MODES
from .spec import make_spec, validate_gpu, validate_memory, validate_name, validate_vcpus


@dataclass(frozen=True)
class Request:
    op: str
    kwargs: dict
    host: str | None  # whose worker runs it; None: its site's (below), or any worker's
    lock: tuple[str, str, str] | None  # (kind, name, what) taken in the task's name
    # Without a host: the site whose workers run it, because it acts on that site's storage
    # (a save: only its site's workers see it); None or "": any worker, on the control queue.
    site: str | None = None


def create(fleet: Fleet, name: str, *, workload: str = "counter", params: dict | None = None,
           memory_mib: int = 128, vcpus: int = 1, host: str | None = None,
           gpu_model: str = "", gpu_count: int = 0, group: str = "",
           on_event=lambda m: None) -> Request:
    """A VM running a built-in workload. Room is checked before the guest image is built."""
    validate_name(name)
    validate_memory(memory_mib)
    validate_vcpus(vcpus)
    gpu_model, gpu_count = validate_gpu(gpu_model, gpu_count)
    line = workloads.cmdline(workload, params)
    admission.room_for(fleet, name, memory_mib, vcpus, host, gpu_model, gpu_count)
    image = ensure_builtin(fleet.paths.images, on_event)
    spec = make_spec(name, memory_mib=memory_mib, vcpus=vcpus, kernel=image.kernel,
                     initrd=image.initrd, cmdline=line, image_root=fleet.paths.images,
                     workload=workload, gpu_model=gpu_model, gpu_count=gpu_count, group=group)
    return create_spec(spec, host)


def create_from_image(fleet: Fleet, name: str, image: str, *, memory_mib: int = 512,
                      vcpus: int = 1, host: str | None = None, disk_gib: int = 0,
                      ssh_keys=(), user_data: str = "", group: str = "", gpu_model: str = "",
                      gpu_count: int = 0, local_disk: bool = False) -> Request:
    """A disk-backed VM from an OS image; everything is checked before anything is made."""
    gpu_model, gpu_count = validate_gpu(gpu_model, gpu_count)
    spec = make_spec(name, memory_mib=memory_mib, vcpus=vcpus, image_root=fleet.paths.images,
                     image=image, disk_gib=disk_gib, ssh_keys=tuple(ssh_keys),
                     user_data=user_data, group=group, gpu_model=gpu_model, gpu_count=gpu_count,
                     local_disk=local_disk)
    admission.creation(fleet, spec, host)
    return create_spec(spec, host)


def create_spec(spec, host: str | None) -> Request:
    data = asdict(spec) | {"kernel": str(spec.kernel) if spec.kernel else None,
                           "initrd": str(spec.initrd) if spec.initrd else None}
    return Request("create", {"spec": data, "host": host}, host,
                   ("vm", spec.name, f"create {spec.name}"))


def migrate(fleet: Fleet, vm: str, target: str, policy: str | None = None,
            bandwidth: int | None = None) -> Request:
    get_policy(policy, bandwidth)  # InvalidRequest for an unknown policy or a bad bandwidth
    source = admission.migration(fleet, vm, target)
    return Request("migrate", {"vm": vm, "target": target, "policy": policy,
                               "bandwidth": bandwidth},
                   source, ("vm", vm, f"migration of {vm} to {target}"))


def cancel(fleet: Fleet, vm: str) -> Request:
    # No lock: the migration being cancelled holds it.
    return Request("cancel", {"vm": vm}, admission.running_vm(fleet, vm), None)


def suspend(fleet: Fleet, vm: str, mode: str | None = None) -> Request:
    if mode is not None and mode not in MODES:
        raise InvalidRequest(f"suspend mode must be one of {', '.join(MODES)}, not {mode!r}")
    return Request("suspend", {"vm": vm, "mode": mode}, admission.running_vm(fleet, vm),
                   ("vm", vm, f"suspend of {vm}"))


def resume(fleet: Fleet, vm: str, host: str | None = None) -> Request:
    """Run where the save is (its site's workers, a host of any site its target), or, in a
    fleet that names no site, on the target."""
    admission.suspended_vm(fleet, vm, host)
    site = fleet.save_site(fleet.state.save_of(vm))
    return Request("resume", {"vm": vm, "host": host}, None if site else host,
                   ("vm", vm, f"resume of {vm}"), site=site)


def resume_postcopy(vm: str) -> Request:
    """The reconcile's request to resume a migration left paused in post-copy: its own task, so
    one recovery that hangs in libvirt never holds up the fleet's. Any worker runs it (it drives
    both hosts' libvirtd remotely): the source's own may be down with its host."""
    return Request("resume_postcopy", {"vm": vm}, None, ("vm", vm, f"post-copy recovery of {vm}"))


def stop(fleet: Fleet, vm: str, timeout: float | None = None) -> Request:
    if timeout is not None and not 0 < timeout <= 3600:
        raise InvalidRequest(f"stop timeout must be between 0 and 3600 s, not {timeout}")
    host = admission.power_change(fleet, vm, "stop")
    kwargs = {"vm": vm} | ({"timeout": timeout} if timeout is not None else {})
    return Request("stop", kwargs, host, ("vm", vm, f"stop of {vm}"))


def start(fleet: Fleet, vm: str) -> Request:
    host = admission.power_change(fleet, vm, "start")
    return Request("start", {"vm": vm}, host, ("vm", vm, f"start of {vm}"))


def reboot(fleet: Fleet, vm: str) -> Request:
    host = admission.power_change(fleet, vm, "reboot")
    return Request("reboot", {"vm": vm}, host, ("vm", vm, f"reboot of {vm}"))


def destroy(fleet: Fleet, vm: str) -> Request:
    admission.destroyable(fleet, vm)
    return Request("destroy", {"vm": vm}, None, ("vm", vm, f"destroy of {vm}"),
                   site=fleet.save_site(fleet.state.save_of(vm)))  # a save: where it is


def evacuate(fleet: Fleet, host: str, deadline: bool, timeout: float = 600.0,
             deadline_s: float | None = None) -> Request:
    """Reclaim (deadline: migrate what fits, suspend the rest; with `deadline_s`, everything
    safe within that many seconds if it can be) or drain (live migration only)."""
    if not deadline and not 0 < timeout <= 86400:
        raise InvalidRequest(f"drain timeout must be between 0 and 86400 s, not {timeout}")
    if deadline_s is not None and not (deadline and 0 < deadline_s <= 86400):
        raise InvalidRequest(f"a reclaim's deadline must be between 0 and 86400 s, not "
                             f"{deadline_s}")
    admission.known_host(fleet, host)
    verb = "reclaim" if deadline else "drain"
    kwargs = {"host": host} | ({} if deadline else {"timeout": timeout})
    if deadline_s is not None:  # an instant: a rerun races the same clock
        kwargs["deadline_at"] = round(time.time() + deadline_s, 3)
    # on the host's site: the saves either makes (a drain too, hibernating a VM that cannot
    # move live) are written on that site's storage
    return Request(f"{verb}_host", kwargs, None, ("host", host, f"{verb} of {host}"),
                   site=fleet.sites().get(host, ""))


def enable(fleet: Fleet, host: str) -> Request:
    admission.known_host(fleet, host)
    return Request("enable_host", {"host": host}, None, ("host", host, f"enable of {host}"))
