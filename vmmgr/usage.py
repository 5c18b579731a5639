"""Per-second usage: how long each VM ran, moved (its blackouts apart), waited suspended or
parked, and slept hibernated, in a window of time.

Every change of a VM's state is appended to a stream in the store (`FleetState.set_vm`), with the
time it happened, and every completed move's blackout with it; `account` turns those entries into
seconds. It is pure: tests drive it with made-up times.
"""

from dataclasses import asdict, dataclass

# What each recorded state counts as. `suspended` is an operator's suspend; `parked` one made for
# want of room; a VM being suspended or resumed counts as what it is while saved.
CATEGORIES = ("running", "migrating", "blackout", "suspended", "parked", "hibernated", "stopped")
COUNTS_AS = {"running": "running", "migrating": "migrating", "postcopy-paused": "migrating",
             "suspending": "suspended", "suspended": "suspended", "parked": "parked",
             "hibernated": "hibernated"}
GONE = "gone"  # destroyed: nothing is counted after it


@dataclass
class Usage:
    vm: str
    running: float = 0.0
    migrating: float = 0.0  # moving, its blackouts apart
    blackout: float = 0.0  # paused between hosts
    suspended: float = 0.0
    parked: float = 0.0
    hibernated: float = 0.0
    stopped: float = 0.0  # shut off, paused or crashed: billed by nobody, shown for the record

    def as_dict(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def category(state: str) -> str | None:
    return None if state == GONE else COUNTS_AS.get(state, "stopped")


def account(entries: list[dict], since: float, until: float) -> list[Usage]:
    """Seconds per VM and category within [since, until), from the entries in time order:
    `{"time", "vm", "state"}` (a state change) or `{"time", "vm", "blackout_ms"}`."""
    out: dict[str, Usage] = {}
    current: dict[str, tuple[str | None, float]] = {}  # vm -> (category, since when)

    def close(vm: str, upto: float) -> None:
        kind, start = current.get(vm, (None, upto))
        lo, hi = max(start, since), min(upto, until)
        if kind and hi > lo:
            usage = out.setdefault(vm, Usage(vm))
            setattr(usage, kind, getattr(usage, kind) + hi - lo)

    for e in sorted(entries, key=lambda e: float(e["time"])):
        vm, t = e["vm"], float(e["time"])
        if "blackout_ms" in e:
            kind, start = current.get(vm, (None, t))
            if kind == "migrating" and e["blackout_ms"] not in (None, "", "None"):
                # the blackout ended the move: counted apart from the move's own time, as far
                # as that time falls in the window
                seconds = min(float(e["blackout_ms"]) / 1000,
                              max(0.0, min(t, until) - max(start, since)))
                if seconds > 0:
                    usage = out.setdefault(vm, Usage(vm))
                    usage.blackout += seconds
                    usage.migrating -= seconds
            continue
        close(vm, t)
        current[vm] = (category(e["state"]), t)
    for vm in current:
        close(vm, until)
    return sorted((u for u in out.values()), key=lambda u: u.vm)


def parse_time(text: str, now: float) -> float:
    """A point in time: unix seconds, ISO 8601 (UTC unless it says), or a span before now
    (`90s`, `15m`, `6h`, `7d`); never before 1970."""
    return max(0.0, _parse_time(text, now))


def _parse_time(text: str, now: float) -> float:
    from datetime import datetime, timezone

    text = text.strip()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if len(text) > 40:
        raise ValueError(f"{text[:40]!r} is not a time")
    if len(text) > 1 and text[-1] in units and text[:-1].isascii() and text[:-1].isdecimal():
        return now - int(text[:-1]) * units[text[-1]]
    if text.isascii() and text.replace(".", "", 1).isdecimal():
        return float(text)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text[:40]!r} is not a time (unix seconds, ISO 8601, or 30m/6h/7d "
                         "before now)") from None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


def report(fleet_state, since: float, until: float) -> dict:
    """The usage of every VM in [since, until), with the window it covers."""
    rows = account(fleet_state.usage_entries(since, until), since, until)
    return {"since": since, "until": until, "vms": [u.as_dict() for u in rows]}
