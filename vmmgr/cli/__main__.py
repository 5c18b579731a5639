"""`python -m vmmgr.cli`: the same as the `vmmgr` console script (the lab starts its host-side
processes this way, with the interpreter of the running vmmgr)."""

from . import main

main()
