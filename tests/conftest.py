import contextlib
import os
import shutil
import socket
import subprocess
import time

import pytest


def pytest_addoption(parser):
    parser.addoption("--regen-golden", action="store_true",
                     help="rewrite tests/golden/* from the current templates (then review the diff)")


_config = []


def pytest_configure(config):
    _config.append(config)


def pytest_runtest_logreport(report):
    """A failure is printed when it happens, not only in the closing summary: a later test that
    hits its time limit ends the whole run (the thread method exits) before any summary."""
    terminal = _config[0].pluginmanager.get_plugin("terminalreporter") if _config else None
    if report.failed and terminal is not None:
        terminal.write_line(f"\n{report.nodeid} ({report.when}) FAILED:")
        terminal.write_line(report.longreprtext[-6000:])
        for section, content in report.sections:
            if "stdout" in section:
                terminal.write_line(f"--- {section} (its end) ---\n{content[-3000:]}")


@pytest.fixture
def regen_golden(request) -> bool:
    return request.config.getoption("--regen-golden") or os.environ.get("VMMGR_REGEN_GOLDEN") == "1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(proc: subprocess.Popen, port: int, timeout: float, what: str) -> None:
    """Until `proc` listens on loopback `port`; fails early if it exits."""
    deadline = time.monotonic() + timeout
    while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
        assert proc.poll() is None and time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.05)


@contextlib.contextmanager
def private_redis(folder):
    """A throwaway Redis server on a free loopback port: real Redis, nothing shared."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is missing: `./run setup` installs it")
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(folder)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(proc, port, 10, "redis-server")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def redis_url(tmp_path):
    with private_redis(tmp_path) as url:
        yield url
