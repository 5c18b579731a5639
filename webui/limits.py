"""Login attempts, counted in the fleet's store (Redis) so every console process sees the same
counts (in this process alone when no store is configured).

An attempt is counted before its password is hashed, so a burst in parallel is held to the limit
too. The limits are per client address and name together (guessing one account), and per
address (guessing many); never per name alone, which would let anyone lock a user out. A correct
password clears its address-and-name count. Behind a proxy, set VMMGR_WEB_PROXIES so the
address is the client's, not the proxy's.
"""

import time

import redis
from flask import current_app

PER_NAME = 10  # attempts per window from one address at one name
PER_ADDRESS = 100  # attempts per window from one address, whatever the names
WINDOW = 300  # seconds

_local: dict[str, list[float]] = {}


def _keys(address: str, name: str) -> list[tuple[str, int]]:
    return [(f"vmmgr:login-attempts:{address}:{name[:64]}", PER_NAME),
            (f"vmmgr:login-attempts:{address}", PER_ADDRESS)]


def _store() -> redis.Redis | None:
    url = current_app.config["VMMGR_PATHS"].redis_url()
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=5) if url else None


def attempt(address: str, name: str) -> int:
    """Count an attempt; 0 if it may go ahead, else the seconds until one may."""
    r, keys = _store(), _keys(address, name)
    if r is None:
        now, waits = time.time(), []
        for key, limit in keys:
            seen = [t for t in _local.get(key, []) if now - t < WINDOW] + [now]
            _local[key] = seen
            if len(seen) > limit:
                waits.append(int(WINDOW - (now - seen[0])) + 1)
        return max(waits, default=0)
    pipe = r.pipeline()
    for key, _ in keys:
        pipe.incr(key)
        pipe.expire(key, WINDOW, nx=True)  # the window starts at the first attempt
        pipe.ttl(key)
    replies = pipe.execute()
    return max((max(ttl, 1) for (key, limit), count, ttl in
                zip(keys, replies[0::3], replies[2::3]) if count > limit), default=0)


def succeeded(address: str, name: str) -> None:
    key = _keys(address, name)[0][0]
    r = _store()
    if r is None:
        _local.pop(key, None)
    else:
        r.delete(key)
