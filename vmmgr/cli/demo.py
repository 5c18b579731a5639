"""`vmmgr demo`."""

import click

from .. import admission, demo as demo_mod
from ..errors import VmmgrError
from ..fleet import Fleet
from ..migration import MigrationResult
from ..paths import lab_paths
from .base import progress_printer, cli
from .dispatch import run_operation

@cli.command()
@click.option("--hosts", default=3, show_default=True, type=click.IntRange(2, 9))
@click.option("--keep-lab", is_flag=True, help="Leave the lab running afterwards.")
@click.pass_context
def demo(ctx: click.Context, hosts: int, keep_lab: bool) -> None:
    """Boot a counter VM, move it around the lab while it counts, compare with one that stayed."""
    # The lab's own home unless one was given: never a real fleet's.
    paths = ctx.obj if ctx.find_root().params.get("home") is not None else lab_paths()

    def through_task_api(vm: str, target: str) -> MigrationResult:
        # `lab up` (inside the demo) has started Redis and the workers by the time this runs.
        with Fleet(paths) as fleet:
            source = admission.migration(fleet, vm, target)
        r = run_operation(paths, "migrate", {"vm": vm, "target": target}, host=source,
                          lock=("vm", vm, f"migration of {vm} to {target}"), wait=True,
                          progress=True, events=False)
        return MigrationResult(**r)

    report = demo_mod.run(paths, hosts=hosts, keep_lab=keep_lab, echo=click.echo,
                          on_progress=progress_printer(enabled=True), mover=through_task_api)
    if not report.identical:
        raise VmmgrError("the moved VM's output differs from the reference run")

