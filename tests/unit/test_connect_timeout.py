"""A libvirtd that accepts connections and answers nothing (wedged, or stopped) fails a connect
after CONNECT_TIMEOUT_S instead of holding the caller for ever: the real libvirt client against
a socket that never speaks."""

import socket
import time

import pytest

from vmmgr import host as host_mod
from vmmgr.errors import HostUnreachable


def test_a_silent_libvirtd_is_unreachable_not_a_hang(monkeypatch):
    monkeypatch.setattr(host_mod, "CONNECT_TIMEOUT_S", 1.0)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # the kernel accepts; nobody reads or answers
    try:
        t0 = time.monotonic()
        uri = f"qemu+tcp://127.0.0.1:{silent.getsockname()[1]}/system"
        with pytest.raises(HostUnreachable, match="no answer in 1 s"):
            host_mod._open(uri, "host x")
        assert time.monotonic() - t0 < 5
        # while that open still waits, the next caller is told at once: one thread per daemon
        t1 = time.monotonic()
        with pytest.raises(HostUnreachable, match="an earlier connection has had no answer"):
            host_mod._open(uri, "host x")
        assert time.monotonic() - t1 < 0.5
    finally:
        silent.close()


def test_a_refused_connection_is_libvirts_own_error(monkeypatch):
    import libvirt
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    with pytest.raises(libvirt.libvirtError):
        host_mod._open(f"qemu+tcp://127.0.0.1:{port}/system", "host x")


def test_opens_in_flight_run_side_by_side(monkeypatch):
    """CI: a worker's migrate opened host1 while its own heartbeat's open was still in its TLS
    handshake, was refused as if host1 were silent, skipped it and called the VM unknown."""
    import threading

    import libvirt

    class Conn:
        closed = False

        def close(self):
            self.closed = True

    def slow_open(uri):
        time.sleep(0.5)  # a handshake under load: slow, not silent
        return Conn()

    monkeypatch.setattr(libvirt, "open", slow_open)
    results = []
    callers = [threading.Thread(target=lambda: results.append(host_mod._open("qemu://h/system",
                                                                              "host h")))
               for _ in range(3)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(5)
    assert len(results) == 3 and all(isinstance(r, Conn) and not r.closed for r in results)


def test_threads_that_ask_one_host_at_once_share_one_connection(monkeypatch):
    import threading

    import libvirt

    from vmmgr.host import Host
    from vmmgr.inventory import HostRecord

    opened = []

    class Conn:
        def setKeepAlive(self, interval, count):
            pass

    def slow_open(uri):
        time.sleep(0.3)
        opened.append(Conn())
        return opened[-1]

    monkeypatch.setattr(libvirt, "open", slow_open)
    host = Host(HostRecord("h", "qemu+tls://h/system"))
    got = []
    askers = [threading.Thread(target=lambda: got.append(host.conn)) for _ in range(3)]
    for a in askers:
        a.start()
    for a in askers:
        a.join(5)
    assert len(opened) == 1 and got == opened * 3  # none opened and dropped unclosed
