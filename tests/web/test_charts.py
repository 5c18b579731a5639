"""The console's own charts (for those without Grafana): blackout per hop, memory over time."""

import time

from vmmgr.state import FleetState
from webui import charts


def test_bars_scale_to_the_tallest_and_escape_labels():
    svg = str(charts.bars([50, 100], ["h1 -> h2", "<h2> -> h3"], "ms", "Blackout per hop"))
    assert svg.count("<rect") == 2 and 'height="84.0"' in svg and 'height="42.0"' in svg
    assert "&lt;h2&gt; -&gt; h3: 100 ms" in svg and "<h2>" not in svg
    assert str(charts.bars([], [], "ms", "x")) == ""


def test_lines_span_the_time_and_need_two_points():
    svg = str(charts.lines([0, 30, 60], {"used": [0, 5, 10], "total": [20, 20, 20]}, "MiB", "t"))
    assert svg.count("<polyline") == 2 and 'points="28.0,112.0 314.0,91.0 600.0,70.0"' in svg
    assert str(charts.lines([0], {"used": [1]}, "MiB", "t")) == ""


def test_the_fleet_page_draws_memory_over_time(as_role, redis_url):
    state, r = FleetState(redis_url), FleetState(redis_url).r
    assert state.sample_capacity(100, 1000) and not state.sample_capacity(200, 1000)  # once a minute
    r.xadd("vmmgr:capacity", {"time": f"{time.time():.3f}", "used": 300, "total": 1000})
    page = as_role("viewer").get("/").get_data(as_text=True)
    assert "Memory over the last day" in page and page.count("<polyline") == 2


def test_the_vm_page_draws_each_hops_blackout(app, as_role, redis_url):
    from flask import render_template_string
    with app.test_request_context():
        html = render_template_string("{{ blackout_chart(m) }}", m=[
            {"status": "completed", "downtime_ms": 80, "source": "h2", "target": "h1"},
            {"status": "failed", "source": "h1", "target": "h3"},
            {"status": "completed", "downtime_ms": 40, "source": "h1", "target": "h2"}])
    assert html.count("<rect") == 2 and html.index("h1 -&gt; h2") < html.index("h2 -&gt; h1")
