"""Text for people: tables and the one-line migration progress bar. Pure functions."""

from .migration import JobProgress, MigrationResult

MiB = 1024 * 1024


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def progress_line(p: JobProgress, width: int = 24) -> str:
    if not p.total_bytes:
        return f"[{'.' * width}] preparing the destination  {p.elapsed_ms / 1000:.1f}s"
    filled = round(p.fraction * width)
    bar = "#" * filled + "." * (width - filled)
    if p.phase == "base":  # a site that lacks the base image receives it before the disk
        return (f"[{bar}] {p.fraction:4.0%}  base image {p.disk_processed_bytes / MiB:.0f}/"
                f"{p.disk_total_bytes / MiB:.0f} MiB  (disk and memory next)  "
                f"{p.elapsed_ms / 1000:.1f}s")
    if p.phase == "disk":  # the local disks go first; the memory after them
        return (f"[{bar}] {p.fraction:4.0%}  disk {p.disk_processed_bytes / MiB:.0f}/"
                f"{p.disk_total_bytes / MiB:.0f} MiB  (memory next)  {p.elapsed_ms / 1000:.1f}s")
    limit = f"  limit {p.downtime_limit_ms} ms" if p.downtime_limit_ms is not None else ""
    throttle = f"  throttle {p.throttle_pct}%" if p.throttle_pct else ""
    phase = "  POST-COPY" if p.phase == "postcopy" else ""
    return (
        f"[{bar}] {p.fraction:4.0%}  {p.processed_bytes / MiB:.0f}/{p.total_bytes / MiB:.0f} MiB"
        f"  {p.remaining_bytes / MiB:.0f} MiB left  {p.speed_bps / MiB:.0f} MiB/s"
        f"  dirty {p.dirty_rate_bps / MiB:.1f} MiB/s  iter {p.iteration}{limit}{throttle}{phase}"
        f"  {p.elapsed_ms / 1000:.1f}s"
    )


def hop_rows(results: list[MigrationResult]) -> list[list]:
    return [
        [r.source, r.target, f"{r.total_ms} ms",
         "post-copy" if r.downtime_ms is None else f"{r.downtime_ms} ms",
         f"{r.bytes_transferred / MiB:.1f} MiB", r.memory_iterations, f"{r.wall_ms} ms"]
        for r in results
    ]


HOP_HEADERS = ["from", "to", "total", "blackout", "sent", "iterations", "wall"]


def progress_notes(p: JobProgress, warned: set[str]) -> list[str]:
    """Lines worth printing once, above the bar: what the engine did, a warning not yet given."""
    notes = [f"* {p.event}"] if p.event else []
    if p.warning and p.warning not in warned:
        notes.append(f"! {p.warning}")
    return notes
