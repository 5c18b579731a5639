"""The fleet's counters, kept in its store (Redis) as things happen, so that every node counts
into one place and a counter never goes back when a process restarts (what Prometheus expects);
the gauges (VMs by state, room, queues) are read from the fleet when scraped.

Histograms are kept as one count per bucket (the first bucket the value fits), made cumulative
when read: `histogram` is pure, tested without a store.
"""

KEY = "vmmgr:metrics"
# Blackouts are tens to hundreds of milliseconds; a move's total time seconds to minutes.
BLACKOUT_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
TOTAL_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
SEP = "|"


def field(*parts: str) -> str:
    return SEP.join(parts)


def migration(pipe, status: str, details: dict) -> None:
    """Count one migration's outcome (into a pipeline: it lands with the record)."""
    pipe.hincrby(KEY, field("migrations", status, details.get("policy") or "-"), 1)
    if status != "completed":
        return
    if details.get("downtime_ms") is not None:
        observe(pipe, "blackout_seconds", BLACKOUT_S, details["downtime_ms"] / 1000)
    if details.get("total_ms") is not None:
        observe(pipe, "duration_seconds", TOTAL_S, details["total_ms"] / 1000)
    pipe.hincrby(KEY, field("bytes_sent"), int(details.get("bytes_transferred") or 0))


def observe(pipe, name: str, buckets: tuple[float, ...], value: float) -> None:
    le = next((b for b in buckets if value <= b), None)
    pipe.hincrby(KEY, field(name, "bucket", "+Inf" if le is None else repr(le)), 1)
    pipe.hincrbyfloat(KEY, field(name, "sum"), value)


def count(r, name: str, *labels: str, by: int = 1) -> None:
    if by:
        r.hincrby(KEY, field(name, *labels), by)


def read(r) -> dict[tuple[str, ...], float]:
    return {tuple(k.split(SEP)): float(v) for k, v in r.hgetall(KEY).items()}


def histogram(counters: dict[tuple[str, ...], float], name: str,
              buckets: tuple[float, ...]) -> tuple[list[tuple[str, float]], float]:
    """([(le, cumulative count), ..., ("+Inf", total)], sum) of one histogram: pure."""
    out, total = [], 0.0
    for le in [repr(b) for b in buckets] + ["+Inf"]:
        total += counters.get((name, "bucket", le), 0.0)
        out.append((le, total))
    return out, counters.get((name, "sum"), 0.0)


def labelled(counters: dict[tuple[str, ...], float], name: str) -> dict[tuple[str, ...], float]:
    """A counter's values by their labels."""
    return {k[1:]: v for k, v in counters.items() if k[0] == name and len(k) > 1}
