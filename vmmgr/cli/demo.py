"""`vmmgr demo [counter|training]`."""

from pathlib import Path

import click

from .. import admission, demo as demo_mod, display, training_demo
from ..errors import VmmgrError
from ..fleet import Fleet
from ..guest_ssh import lab_prefix
from ..lab import Lab
from ..lab_wan import Wan
from ..migration import MigrationResult
from ..paths import lab_paths
from .base import progress_printer, cli
from .dispatch import run_operation, run_request

@cli.command()
@click.argument("which", type=click.Choice(["counter", "training"]), default="counter")
@click.option("--hosts", default=3, show_default=True, type=click.IntRange(2, 9))
@click.option("--keep-lab", is_flag=True, help="Leave the lab running afterwards.")
@click.option("--moves", default=13, show_default=True, type=click.IntRange(2, 100),
              help="training: how many times the moving pair is moved.")
@click.option("--steps", default=600, show_default=True, type=click.IntRange(10, 1000000),
              help="training: steps of the training run (enough to outlast the moves).")
@click.option("--plot", type=click.Path(path_type=Path), default=Path("training-losses.png"),
              show_default=True, help="training: where the PNG of both loss curves goes.")
@click.option("--sites", default=1, show_default=True, type=click.IntRange(1, 9),
              help="training: the lab's hosts in this many sites, a WAN between them (every "
                   "host its own site when equal to --hosts).")
@click.option("--local-disk", is_flag=True,
              help="training: the VMs' disks on their hosts' own storage: each move copies "
                   "the disk (across the WAN between sites; implied by --sites above 1, as a "
                   "disk on a site's storage stays in that site).")
@click.pass_context
def demo(ctx: click.Context, which: str, hosts: int, keep_lab: bool, moves: int, steps: int,
         plot: Path, sites: int, local_disk: bool) -> None:
    """counter (default): a counter VM moved around the lab while it counts, compared with one
    that stayed. training: two VMs from the debian-12 image training data-parallel, moved MOVES
    times (one move a reclaim that suspends to disk), against a pair that never moved."""
    # The lab's own home unless one was given: never a real fleet's.
    paths = ctx.obj if ctx.find_root().params.get("home") is not None else lab_paths()
    if which == "training":
        return _training(paths, hosts, keep_lab, moves, steps, plot, sites, local_disk)
    if sites > 1 or local_disk:
        raise click.UsageError("--sites and --local-disk are for the training demo")

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


def _training(paths, hosts: int, keep_lab: bool, moves: int, steps: int, plot: Path,
              sites: int = 1, local_disk: bool = False) -> None:
    lab = Lab(paths, log=lambda m: click.echo(f"  {m}"))
    started_lab = not lab.running_hosts()
    hosts = max(hosts, 3)
    if sites > hosts:
        raise click.UsageError(f"--sites {sites} needs at least as many hosts (--hosts {hosts})")
    local_disk = local_disk or sites > 1  # a disk on a site's storage never leaves the site
    click.echo(f"== lab: {hosts} hosts" + (f" in {sites} sites" if sites > 1 else ""))
    records = lab.up(hosts, sites=sites, wan=Wan() if sites > 1 else None)
    click.echo(f"   accelerator: {records[0].accel}")
    try:
        run = training_demo.TrainingDemo(
            paths, lambda req: run_request(paths, req, wait=True, progress=True, events=False),
            echo=click.echo, ssh_prefix=lab_prefix(), local_disk=local_disk)
        report = run.run(moves=moves, steps=steps, plot=plot.resolve())
    finally:
        if started_lab and not keep_lab:
            click.echo("== lab down")
            lab.down()
        elif sites > 1:
            lab.up(hosts, sites=1)  # a lab that stays keeps no WAN of the demo's
    click.echo("\n" + display.table(training_demo.MOVE_HEADERS,
                                    [m.row() for m in report.moves]))
    last = report.moved_losses[-1].split() if report.moved_losses else ["-", "-"]
    click.echo(f"\nSSH session to {training_demo.MOVING[0]}: "
               f"{'held through every move' if report.session_rc == 0 else 'LOST'} "
               f"({len(report.session_lines)} lines, exit {report.session_rc})")
    click.echo(f"losses: {len(report.moved_losses)} steps moved, {len(report.still_losses)} "
               f"never moved; final loss {last[1]} at step {last[0]}")
    click.echo(f"plot: {report.plot}")
    if not report.identical:
        raise VmmgrError("the moved run's losses differ from the run that never moved; first: "
                         + report.first_difference())
    click.echo(f"losses BIT-IDENTICAL after {len(report.moves)} moves")
    if report.session_rc != 0:
        raise VmmgrError("the SSH session to the moving VM did not survive the moves")
