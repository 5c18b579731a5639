"""`vmmgr demo`."""

import click

from .. import demo as demo_mod
from ..errors import VmmgrError
from ..paths import Paths
from .base import progress_printer, cli

@cli.command()
@click.option("--hosts", default=3, show_default=True, type=click.IntRange(2, 9))
@click.option("--keep-lab", is_flag=True, help="Leave the lab running afterwards.")
@click.pass_obj
def demo(paths: Paths, hosts: int, keep_lab: bool) -> None:
    """Boot a counter VM, move it around the lab while it counts, compare with one that stayed."""
    report = demo_mod.run(paths, hosts=hosts, keep_lab=keep_lab, echo=click.echo,
                          on_progress=progress_printer(enabled=True))
    if not report.identical:
        raise VmmgrError("the moved VM's output differs from the reference run")
