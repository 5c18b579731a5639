"""Login attempts, counted per client address and per user name in the fleet's store (Redis), so
every console process sees the same counts; in this process alone when no store is configured."""

import time

import redis
from flask import current_app

FAILURES = 10  # failed logins allowed per window, per address and per name
WINDOW = 300  # seconds

_local: dict[str, list[float]] = {}


def _keys(address: str, name: str) -> list[str]:
    return [f"vmmgr:login-failures:addr:{address}", f"vmmgr:login-failures:user:{name[:64]}"]


def _store() -> redis.Redis | None:
    url = current_app.config["VMMGR_PATHS"].redis_url()
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=5) if url else None


def blocked_for(address: str, name: str) -> int:
    """Seconds until another attempt is allowed; 0 if it is allowed now."""
    r, keys = _store(), _keys(address, name)
    if r is None:
        now = time.time()
        waits = [int(WINDOW - (now - seen[0])) + 1 for seen in
                 ([t for t in _local.get(k, []) if now - t < WINDOW] for k in keys)
                 if len(seen) >= FAILURES]
        return max(waits, default=0)
    pipe = r.pipeline()
    for k in keys:
        pipe.get(k)
        pipe.ttl(k)
    replies = pipe.execute()
    waits = [max(ttl, 1) for count, ttl in zip(replies[::2], replies[1::2])
             if count and int(count) >= FAILURES]
    return max(waits, default=0)


def failed(address: str, name: str) -> None:
    r, keys = _store(), _keys(address, name)
    if r is None:
        now = time.time()
        for k in keys:
            _local[k] = [t for t in _local.get(k, []) if now - t < WINDOW] + [now]
        return
    pipe = r.pipeline()
    for k in keys:
        pipe.incr(k)
        pipe.expire(k, WINDOW, nx=True)  # the window starts at the first failure
    pipe.execute()
