"""The web console's users: names, roles, salted scrypt password hashes, API tokens and
console sessions.

Stored in one JSON file (mode 0600) that only the admin CLI and the console touch. Tokens are kept
as SHA-256 hashes: a stolen file gives away neither passwords nor usable tokens. Each login is a
session id kept here too, so logging out ends that session for good (not just in one browser),
and a new password ends every session and token the user had.
"""

import fcntl
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .errors import Conflict, InvalidRequest, NotFound
from .spec import validate_name

ROLES = ("viewer", "operator", "admin")  # each can do what the one before it can
MIN_PASSWORD = 8
# OWASP's Password Storage Cheat Sheet: N=2^17, r=8, p=1 (128 MiB, about 0.3 s here). The
# parameters are kept in each hash, so older hashes still verify and are redone at next login.
SCRYPT = {"n": 2**17, "r": 8, "p": 1}
# Hashes at once in one process: each takes 128 MiB, and a burst of logins must not take the
# console's memory (the others wait their turn).
_HASHING = threading.BoundedSemaphore(2)
SESSIONS_KEPT = 20  # per user: the oldest login is ended past this
SESSION_DAYS = 14


@dataclass(frozen=True)
class User:
    name: str
    role: str

    def can(self, role: str) -> bool:
        return ROLES.index(self.role) >= ROLES.index(role)


def hash_password(password: str, salt: bytes | None = None, n: int | None = None,
                  r: int | None = None, p: int | None = None) -> str:
    n, r, p = n or SCRYPT["n"], r or SCRYPT["r"], p or SCRYPT["p"]
    salt = salt or secrets.token_bytes(16)
    with _HASHING:
        digest = hashlib.scrypt(password.encode(), salt=salt, n=n, r=r, p=p,
                                maxmem=256 * r * n + (1 << 20))  # 128 r N bytes, and some room
    return f"scrypt${n}${r}${p}${salt.hex()}${digest.hex()}"


def _params(stored: str) -> tuple[int, int, int, str]:
    """(n, r, p, salt) of a stored hash; hashes made before the parameters were kept in them
    ("scrypt$salt$digest") used N=2^14."""
    parts = stored.split("$")
    if len(parts) == 3:
        return 2**14, 8, 1, parts[1]
    return int(parts[1]), int(parts[2]), int(parts[3]), parts[4]


def check_password(password: str, stored: str) -> bool:
    if not stored.startswith("scrypt$"):
        return False
    n, r, p, salt = _params(stored)
    made = hash_password(password, bytes.fromhex(salt), n, r, p)
    return hmac.compare_digest(made.rsplit("$", 1)[1], stored.rsplit("$", 1)[1])


def needs_rehash(stored: str) -> bool:
    return _params(stored)[:3] != (SCRYPT["n"], SCRYPT["r"], SCRYPT["p"])


@cache
def _decoy(n: int, r: int, p: int) -> str:
    """A hash checked for unknown names, so they take as long as known ones (one scrypt)."""
    return hash_password(secrets.token_hex(16), n=n, r=r, p=p)


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
        """A new user; with `replace`, a new password and role for an existing one, which ends
        every session and token it had (a password is changed when it may be known)."""
        validate_name(name, "user")
        if role not in ROLES:
            raise InvalidRequest(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
        if len(password) < MIN_PASSWORD:
            raise InvalidRequest(f"a password needs at least {MIN_PASSWORD} characters")
        hashed = hash_password(password)

        def change(data):
            if name in data and not replace:
                raise Conflict(f"user {name!r} already exists")
            data[name] = {"role": role, "password": hashed, "tokens": {}, "sessions": {}}
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
            check_password(password, _decoy(SCRYPT["n"], SCRYPT["r"], SCRYPT["p"]))
            return None
        if not check_password(password, u["password"]):
            return None
        if needs_rehash(u["password"]):
            old, hashed = u["password"], hash_password(password)

            def rehash(data):  # unless the password was replaced meanwhile
                if data.get(name, {}).get("password") == old:
                    data[name]["password"] = hashed
            self._update(rehash)
        return User(name, u["role"])

    # ---- sessions (the web console's logins) ------------------------------------------------

    def open_session(self, name: str) -> str:
        """A new session id for a login; the oldest past SESSIONS_KEPT is ended."""
        sid = secrets.token_urlsafe(24)

        def change(data):
            if name not in data:
                raise NotFound(f"unknown user {name!r}")
            sessions = data[name].setdefault("sessions", {})
            sessions[_token_hash(sid)] = time.time()
            for old in sorted(sessions, key=sessions.get)[:-SESSIONS_KEPT]:
                del sessions[old]
        self._update(change)
        return sid

    def by_session(self, name: str, sid: str) -> User | None:
        u = self._load().get(name)
        opened = (u or {}).get("sessions", {}).get(_token_hash(sid))
        if opened is None or time.time() - opened > SESSION_DAYS * 86400:
            return None
        return User(name, u["role"])

    def close_session(self, name: str, sid: str) -> None:
        self._update(lambda data: data.get(name, {}).get("sessions", {}).pop(
            _token_hash(sid), None))

    # ---- API tokens -------------------------------------------------------------------------

    def new_token(self, name: str, label: str = "api") -> str:
        """A fresh API token for `name`; only its hash is kept, so it is shown once. Its id (the
        hash's first 12 digits) names it in `tokens` and `revoke_token`."""
        token = "vmmgr_" + secrets.token_urlsafe(32)

        def change(data):
            if name not in data:
                raise NotFound(f"unknown user {name!r}")
            data[name]["tokens"][_token_hash(token)] = {"label": label, "created": time.time()}
        self._update(change)
        return token

    def tokens(self, name: str) -> "list[dict]":
        u = self._load().get(name)
        if u is None:
            raise NotFound(f"unknown user {name!r}")
        return [{"id": digest[:TOKEN_ID], **_token_info(info)}
                for digest, info in u.get("tokens", {}).items()]

    def revoke_token(self, name: str, token_id: str) -> None:
        if len(token_id) < 6:
            raise InvalidRequest("a token id is at least 6 of its digits (`vmmgr user tokens`)")

        def change(data):
            if name not in data:
                raise NotFound(f"unknown user {name!r}")
            tokens = data[name]["tokens"]
            found = [d for d in tokens if d.startswith(token_id)]
            if len(found) != 1:
                raise NotFound(f"user {name!r} has no token {token_id!r}" if not found else
                               f"{token_id!r} names more than one token: give more digits")
            del tokens[found[0]]
        self._update(change)

    def by_token(self, token: str) -> User | None:
        digest = _token_hash(token)
        for name, u in self._load().items():
            if digest in u.get("tokens", {}):
                return User(name, u["role"])
        return None

    def token_id(self, token: str) -> str:
        return _token_hash(token)[:TOKEN_ID]


TOKEN_ID = 12


def _token_info(info) -> dict:
    # tokens made before they had a creation time were kept as their label alone
    return info if isinstance(info, dict) else {"label": info, "created": None}
