"""The lab a benchmark runs on: its first hosts as a ring. A lab that was down is brought up for
the run and taken down after it; a running one is used and left as it was."""

from contextlib import contextmanager

from vmmgr.lab import Lab
from vmmgr.paths import lab_paths


@contextmanager
def lab_ring(hosts: int = 3):
    """(paths, host records, ring of host names) while the lab runs."""
    paths = lab_paths()
    lab = Lab(paths, log=lambda m: print(f"  {m}", flush=True))
    started = not lab.running_hosts()
    records = lab.up(hosts)
    try:
        yield paths, records, [r.name for r in records[:hosts]]
    finally:
        if started:
            lab.down()
