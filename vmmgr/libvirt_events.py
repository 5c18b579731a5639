"""libvirt's event loop, run in a thread, so connections can deliver domain events.

It must be registered before a connection is opened for that connection to get events: `Host`
calls `ensure_loop` before opening any.
"""

import threading

import libvirt

_lock = threading.Lock()
_running = False


def ensure_loop() -> None:
    global _running
    with _lock:
        if _running:
            return
        libvirt.virEventRegisterDefaultImpl()
        threading.Thread(target=_run, name="libvirt-events", daemon=True).start()
        _running = True


def _run() -> None:
    while True:
        libvirt.virEventRunDefaultImpl()
