"""The audit trail: who asked for what, on what, when, and how it ended.

One stream in the store (`vmmgr:audit`). A request is recorded where it enters — the CLI (the OS
user and host), the console or the API (the user, the token's id, the client's address) — with
its outcome there (`queued` as task T, or `refused: why`); a queued task's run adds its own
outcome, which `trail` joins to the request. Entries older than VMMGR_AUDIT_DAYS (default 400)
are trimmed as new ones are added.
"""

import json
import os
import pwd
import socket
import time

STREAM = "vmmgr:audit"
DEFAULT_DAYS = 400


def keep_days() -> float:
    return float(os.environ.get("VMMGR_AUDIT_DAYS") or DEFAULT_DAYS)


def cli_actor() -> dict:
    """The OS account running the CLI (from the process, not $USER, which anyone sets), and
    who it was before sudo."""
    who = pwd.getpwuid(os.getuid()).pw_name
    if os.environ.get("SUDO_USER") and os.getuid() == 0:
        who = f"{os.environ['SUDO_USER']} (sudo {who})"
    return {"who": who, "via": "cli", "client": socket.gethostname()}


def redacted(args: dict | None) -> dict:
    """Arguments as records keep them: a VM's user-data may hold secrets, so only its size."""
    args = dict(args or {})
    spec = args.get("spec")
    if isinstance(spec, dict) and spec.get("user_data"):
        args["spec"] = spec | {"user_data": f"({len(str(spec['user_data']).encode())} bytes)"}
    return args


def record(r, actor: dict, action: str, target: str = "", args: dict | None = None,
           outcome: str = "", task: str = "") -> None:
    args = redacted(args)
    now = time.time()
    oldest = int((now - keep_days() * 86400) * 1000)
    r.xadd(STREAM, {"time": f"{now:.3f}", "who": actor.get("who", ""),
                    "via": actor.get("via", ""), "client": actor.get("client", ""),
                    "token": actor.get("token", ""), "action": action, "target": target,
                    "args": json.dumps(args or {}, default=str)[:2000], "outcome": outcome[:500],
                    "task": task}, minid=oldest, approximate=False)  # exact: the promise is a time


def ended(r, task: str, action: str, outcome: str) -> None:
    """A queued task's outcome, joined to its request by `trail`."""
    record(r, {"via": "task"}, action, outcome=outcome, task=task)


def target_of(args: dict) -> str:
    """What an action is on: its VM or host, by the name its arguments give."""
    spec = args.get("spec") if isinstance(args.get("spec"), dict) else {}
    record_ = args.get("record") if isinstance(args.get("record"), dict) else {}
    return str(args.get("vm") or args.get("host") or spec.get("name") or record_.get("name") or "")


def trail(r, since: float, until: float, who: str | None = None,
          target: str | None = None) -> list[dict]:
    """Requests in [since, until), oldest first, each with its task's outcome when it ended."""
    rows = [fields for _, fields in r.xrange(STREAM, min=int(since * 1000),
                                              max=f"({int(until * 1000)}")]  # until: exclusive
    # a task may end after `until`: look for its outcome up to now
    outcomes = {f["task"]: f["outcome"] for _, f in r.xrange(STREAM, min=int(since * 1000))
                if f.get("via") == "task" and f.get("task")}
    out = []
    for f in rows:
        if f.get("via") == "task":
            continue
        if who and f.get("who") != who or target and f.get("target") != target:
            continue
        out.append(f | {"args": json.loads(f.get("args") or "{}"),
                        "result": outcomes.get(f.get("task"), "") if f.get("task") else ""})
    return out
