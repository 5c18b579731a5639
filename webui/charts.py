"""Small SVG charts drawn on the server (no script, nothing loaded from elsewhere): what an
operator without Grafana sees of the metrics. Pure functions from numbers to markup."""

from markupsafe import Markup, escape

W, H, PAD = 600, 140, 28


def bars(values: list[float], labels: list[str], unit: str, title: str) -> Markup:
    """One bar per value (a hop's blackout), tallest scaled to the chart."""
    if not values:
        return Markup("")
    top = max(values) or 1
    step = (W - PAD) / len(values)
    parts = [f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" '
             f'aria-label="{escape(title)}"><title>{escape(title)}</title>',
             f'<text x="2" y="12" class="axis">{_num(top)} {escape(unit)}</text>',
             f'<line x1="{PAD}" y1="{H - PAD}" x2="{W}" y2="{H - PAD}" class="axis"/>']
    for i, (v, label) in enumerate(zip(values, labels)):
        h = (H - 2 * PAD) * v / top
        x = PAD + i * step
        parts.append(f'<rect x="{x + step * 0.1:.1f}" y="{H - PAD - h:.1f}" '
                     f'width="{step * 0.8:.1f}" height="{h:.1f}" class="bar">'
                     f'<title>{escape(label)}: {_num(v)} {escape(unit)}</title></rect>')
    parts.append("</svg>")
    return Markup("".join(parts))


def lines(times: list[float], series: dict[str, list[float]], unit: str, title: str) -> Markup:
    """A line per series over time (capacity used and total), from the first time to the last."""
    if len(times) < 2:
        return Markup("")
    t0, t1 = times[0], times[-1]
    top = max((v for vs in series.values() for v in vs), default=0) or 1
    x = lambda t: PAD + (W - PAD) * (t - t0) / ((t1 - t0) or 1)  # noqa: E731
    y = lambda v: H - PAD - (H - 2 * PAD) * v / top  # noqa: E731
    parts = [f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" '
             f'aria-label="{escape(title)}"><title>{escape(title)}</title>',
             f'<text x="2" y="12" class="axis">{_num(top)} {escape(unit)}</text>',
             f'<line x1="{PAD}" y1="{H - PAD}" x2="{W}" y2="{H - PAD}" class="axis"/>']
    for i, (name, values) in enumerate(series.items()):
        points = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in zip(times, values))
        parts.append(f'<polyline points="{points}" class="line line-{i}">'
                     f'<title>{escape(name)}</title></polyline>')
        parts.append(f'<text x="{W - 150}" y="{14 + 14 * i}" class="legend line-{i}">'
                     f'{escape(name)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _num(v: float) -> str:
    return f"{v:.0f}" if v >= 10 else f"{v:.2g}"
