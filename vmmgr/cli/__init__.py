"""The admin CLI, `vmmgr`. Each command is a few lines over the core.

Exit codes: 0 success, 1 failure, 2 bad request or usage, 3 not found, 4 conflict (busy, no room,
exists), 5 host unreachable, 6 migration failed or cancelled (the VM still runs on its source).
"""

# Importing the command modules registers their commands on the root group.
from . import (activity, demo, hosts, images, lab, migrate, net, notices, usage,  # noqa: E402,F401
               users, vms)
from .base import cli, main  # noqa: E402,F401

if __name__ == "__main__":
    main()
