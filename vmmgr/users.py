"""The web console's users: names, roles, salted scrypt password hashes and API tokens.

Stored in one JSON file (mode 0600) that only the admin CLI and the console touch. Tokens are kept
as SHA-256 hashes: a stolen file gives away neither passwords nor usable tokens.
"""

import fcntl
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from .errors import Conflict, InvalidRequest, NotFound
from .spec import validate_name

ROLES = ("viewer", "operator", "admin")  # each can do what the one before it can
MIN_PASSWORD = 8
SCRYPT = {"n": 2**14, "r": 8, "p": 1}


@dataclass(frozen=True)
class User:
    name: str
    role: str

    def can(self, role: str) -> bool:
        return ROLES.index(self.role) >= ROLES.index(role)


def hash_password(password: str, salt: bytes | None = None) -> str:
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, **SCRYPT)
    return f"scrypt${salt.hex()}${digest.hex()}"


def check_password(password: str, stored: str) -> bool:
    scheme, salt, _ = stored.split("$")
    return scheme == "scrypt" and hmac.compare_digest(
        hash_password(password, bytes.fromhex(salt)), stored)


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Users:
    def __init__(self, path: Path):
        self.path = path

    def _load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}

    def _update(self, change) -> None:
        """Read, change and write the file under an exclusive lock, atomically."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self._load()
            change(data)
            tmp = self.path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=2)
            os.replace(tmp, self.path)

    def add(self, name: str, password: str, role: str, replace: bool = False) -> User:
        validate_name(name, "user")
        if role not in ROLES:
            raise InvalidRequest(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
        if len(password) < MIN_PASSWORD:
            raise InvalidRequest(f"a password needs at least {MIN_PASSWORD} characters")

        def change(data):
            if name in data and not replace:
                raise Conflict(f"user {name!r} already exists")
            data[name] = {"role": role, "password": hash_password(password),
                          "tokens": data.get(name, {}).get("tokens", {})}
        self._update(change)
        return User(name, role)

    def remove(self, name: str) -> None:
        def change(data):
            if data.pop(name, None) is None:
                raise NotFound(f"unknown user {name!r}")
        self._update(change)

    def list(self) -> list[User]:
        return [User(n, u["role"]) for n, u in sorted(self._load().items())]

    def get(self, name: str) -> User | None:
        u = self._load().get(name)
        return User(name, u["role"]) if u else None

    def authenticate(self, name: str, password: str) -> User | None:
        u = self._load().get(name)
        if u is None:
            check_password(password, hash_password("timing"))  # same work for unknown names
            return None
        return User(name, u["role"]) if check_password(password, u["password"]) else None

    def new_token(self, name: str, label: str = "api") -> str:
        """A fresh API token for `name`; only its hash is kept, so it is shown once."""
        token = "vmmgr_" + secrets.token_urlsafe(32)

        def change(data):
            if name not in data:
                raise NotFound(f"unknown user {name!r}")
            data[name]["tokens"][_token_hash(token)] = label
        self._update(change)
        return token

    def by_token(self, token: str) -> User | None:
        digest = _token_hash(token)
        for name, u in self._load().items():
            if digest in u.get("tokens", {}):
                return User(name, u["role"])
        return None
