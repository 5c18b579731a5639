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
