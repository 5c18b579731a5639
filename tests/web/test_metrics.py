"""`/metrics` in Prometheus's format: counters kept in the store as outcomes are recorded, gauges
read from the fleet (against a real private Redis; the lab test sees them move for real)."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vmmgr import metrics
from vmmgr.state import FleetState


def scrape(app, token: str) -> dict:
    r = app.test_client().get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200 and r.mimetype == "text/plain", r.get_data(as_text=True)
    return {s.name + str(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(r.get_data(as_text=True)) for s in f.samples}


def sample(samples: dict, name: str, **labels) -> float:
    return samples[name + str(sorted(labels.items()))]


def test_metrics_need_a_token(app):
    r = app.test_client().get("/metrics")
    assert r.status_code == 401 and r.json["error"]["code"] == "unauthenticated"


def test_migrations_are_counted_with_their_blackout_and_time(app, tokens, redis_url):
    state = FleetState(redis_url)
    before = scrape(app, tokens["viewer"])
    assert sample(before, "vmmgr_migration_blackout_seconds_count") == 0
    for ms in (40, 90, 700):
        state.record("migrated", "vm1", {"source": "h1", "target": "h2", "policy": "never-fail",
                                         "downtime_ms": ms, "total_ms": 1500,
                                         "bytes_transferred": 1000})
    state.record("migration_failed", "vm1", {"source": "h2", "target": "h3", "error": "x",
                                             "policy": "never-fail"})
    state.set_vm("vm2", state="running", host="h1")
    after = scrape(app, tokens["viewer"])
    assert sample(after, "vmmgr_migrations_total", outcome="completed", policy="never-fail") == 3
    assert sample(after, "vmmgr_migrations_total", outcome="failed", policy="never-fail") == 1
    assert sample(after, "vmmgr_migration_blackout_seconds_bucket", le="0.05") == 1
    assert sample(after, "vmmgr_migration_blackout_seconds_bucket", le="0.1") == 2
    assert sample(after, "vmmgr_migration_blackout_seconds_bucket", le="+Inf") == 3
    assert sample(after, "vmmgr_migration_blackout_seconds_sum") == pytest.approx(0.83)
    assert sample(after, "vmmgr_migration_duration_seconds_bucket", le="2.0") == 3
    assert sample(after, "vmmgr_migration_sent_bytes_total") == 3000
    assert sample(after, "vmmgr_vms", state="running") == 2
    assert sample(after, "vmmgr_parked_vms") == 0


def test_queued_tasks_show_as_depth_and_age(app, tokens, redis_url):
    state = FleetState(redis_url)
    state.add_task("t1", "reconcile", {}, "control")
    state.r.rpush("control", "a message")
    state.r.rpush("control\x06\x163", "a priority message")
    state.r.hset("vmmgr:task:t1", "submitted", "1")  # queued long ago, never started
    samples = scrape(app, tokens["viewer"])
    assert sample(samples, "vmmgr_task_queue_depth", queue="control") == 2
    assert sample(samples, "vmmgr_task_oldest_waiting_seconds") > 10**9


def test_histogram_is_cumulative():
    counters = {("b", "bucket", "0.1"): 2.0, ("b", "bucket", "+Inf"): 1.0, ("b", "sum"): 9.5,
                ("b", "bucket", "1.0"): 3.0}
    assert metrics.histogram(counters, "b", (0.1, 0.5, 1.0)) == (
        [("0.1", 2.0), ("0.5", 2.0), ("1.0", 5.0), ("+Inf", 6.0)], 9.5)


def test_the_grafana_dashboard_asks_only_for_metrics_that_exist(app, tokens):
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" /
                            "grafana-vmmgr.json").read_text())
    asked = {name for p in dashboard["panels"] for t in p["targets"]
             for name in re.findall(r"vmmgr_[a-z_]+", t["expr"])}
    families = list(text_string_to_metric_families(app.test_client().get(
        "/metrics", headers={"Authorization": f"Bearer {tokens['viewer']}"}).get_data(as_text=True)))
    # an empty fleet has families without samples: their names, as a sample would be named
    served = {s.name for f in families for s in f.samples} | {
        f.name + ("_total" if f.type == "counter" else "") for f in families}
    assert asked and asked <= served, asked - served
