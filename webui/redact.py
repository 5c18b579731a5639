"""What a viewer is shown: the fleet's state without its internals. Host URIs (addresses and
key paths) and the text a hypervisor or libvirt put in an error are for operators; a viewer sees
that a host does not answer or a move failed, and the host's name."""

import re

from flask import g

URI = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>]+", re.IGNORECASE)
HIDDEN = "<host>"


def viewer() -> bool:
    user = getattr(g, "user", None)
    return user is None or not user.can("operator")


def text(message: str) -> str:
    return URI.sub(HIDDEN, message) if viewer() and message else message


def hosts(rows: list[dict]) -> list[dict]:
    if not viewer():
        return rows
    return [{k: v for k, v in r.items() if k != "uri"}
            | ({"error": "does not answer"} if "error" in r else {}) for r in rows]


def deep(value):
    """Anything shown (task arguments and results, events, progress): URIs out of every string
    and `uri` fields dropped, for a viewer; as it is for an operator."""
    if not viewer():
        return value
    return _deep(value)


def _deep(value):
    if isinstance(value, str):
        return URI.sub(HIDDEN, value)
    if isinstance(value, dict):
        return {k: _deep(v) for k, v in value.items() if k != "uri"}
    if isinstance(value, (list, tuple)):
        return [_deep(v) for v in value]
    return value
