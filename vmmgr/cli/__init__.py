"""The admin CLI, `vmmgr`. Each command is a few lines over the core.

Exit codes: 0 success, 1 failure, 2 bad request or usage, 3 not found, 4 conflict (busy, no room,
exists), 5 host unreachable, 6 migration failed or cancelled (the VM still runs on its source).
"""

# The command modules register their commands on the root group when first asked for
# (`base.COMMAND_MODULES`).
from .base import cli, main  # noqa: F401

if __name__ == "__main__":
    main()
