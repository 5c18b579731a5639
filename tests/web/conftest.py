"""The web console against a real (private) Redis and an empty inventory: every refusal is real;
success paths of actions stub only the fleet-side request builder (the lab test does them for real)."""

import re

import pytest

from vmmgr.paths import Paths
from vmmgr import users as users_mod
from vmmgr.users import Users
from webui import create_app

PASSWORD = "correct horse battery"


@pytest.fixture(autouse=True)
def cheap_hashes(monkeypatch):
    """Production's scrypt costs 128 MiB and ~0.3 s a hash; these tests make hundreds."""
    monkeypatch.setitem(users_mod.SCRYPT, "n", 2**10)


@pytest.fixture
def home(tmp_path, redis_url) -> Paths:
    paths = Paths(tmp_path / "home")
    paths.home.mkdir()
    paths.redis_url_file.write_text(redis_url)
    users = Users(paths.users)
    for role in ("viewer", "operator", "admin"):
        users.add(role, PASSWORD, role)
    return paths


@pytest.fixture
def app(home):
    return create_app(home, TESTING=True, SSE_MAX_SECONDS=1)


@pytest.fixture
def tokens(home) -> dict[str, str]:
    users = Users(home.users)
    return {role: users.new_token(role) for role in ("viewer", "operator", "admin")}


def csrf_of(html: str) -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert match, "page has no CSRF token"
    return match.group(1)


def login(client, role: str):
    page = client.get("/login").get_data(as_text=True)
    r = client.post("/login", data={"name": role, "password": PASSWORD,
                                    "csrf_token": csrf_of(page)})
    assert r.status_code == 302, r.get_data(as_text=True)
    return client


@pytest.fixture
def as_role(app):
    def make(role: str):
        return login(app.test_client(), role)
    return make


@pytest.fixture
def consoles(home, mocker):
    """The fleet's consoles as a folder of the test's: what the console reads through the hosts'
    libvirt on a fleet, written here directly."""
    from vmmgr.console import LocalConsoles
    from vmmgr.fleet import Fleet

    local = LocalConsoles(home.consoles)
    mocker.patch.object(Fleet, "consoles", property(lambda self: local))
    return local
