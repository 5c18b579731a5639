"""What PID 1 is to a real host's QEMUs, for one lab host: `python -m vmmgr.lab_reaper CMD...`.

libvirtd daemonizes each QEMU, so a QEMU's parent is the init process, and libvirt, stopping a
VM, polls until the exited QEMU is reaped. On a real host systemd reaps at once. This machine's
init reaps late (a destroy or a migration's confirm phase waited 1.8 s for it, measured with
strace), so the lab host's libvirtd runs under this reaper instead: a child subreaper, which
adopts the QEMUs and reaps them as they exit. It runs CMD (libvirtd) as its child and lives on
while any descendant does, as QEMUs outlive a restarted libvirtd.
"""

import ctypes
import os
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m vmmgr.lab_reaper CMD [ARGS...]", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    if os.fork() == 0:
        try:
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # as a shell would hand them on
                signal.signal(sig, signal.SIG_DFL)
            os.execvp(argv[0], argv)
        except OSError as err:  # said where the lab looks: the host's libvirtd.stderr
            print(f"lab_reaper: {argv[0]}: {err}", file=sys.stderr, flush=True)
        os._exit(127)
    while True:
        try:
            os.wait()
        except ChildProcessError:  # no child or adopted descendant left
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
