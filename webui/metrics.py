"""`GET /metrics`: the fleet in Prometheus's text format (the `prometheus_client` library renders
it). Counters and histograms come from the store, where every node counts as things happen
(`vmmgr.metrics`); gauges are read from the fleet at scrape time. Scrape it with a viewer's API
token (`authorization: {credentials: <token>}` in the scrape config)."""

import time

from flask import Blueprint, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from tasks.app import CONTROL_QUEUE, host_queue, site_queue
from vmmgr import metrics, overview, suspend

from . import backend
from .auth import api_role

bp = Blueprint("metrics", __name__)
# kombu's Redis transport keeps a queue's messages of priority 3, 6 and 9 in lists of their own
PRIORITY_SEP, PRIORITIES = "\x06\x16", (3, 6, 9)
RECENT_TASKS = 500


@bp.get("/metrics")
@api_role("viewer")
def scrape():
    registry = CollectorRegistry(auto_describe=False)
    with backend.fleet() as fleet:
        registry.register(FleetCollector(list(collect(fleet))))
        return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST)


class FleetCollector:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return iter(self.families)


def collect(fleet):
    now = time.time()
    counters = metrics.read(fleet.state.r)

    migrations = CounterMetricFamily("vmmgr_migrations", "Migrations ended, by outcome and policy",
                                     labels=["outcome", "policy"])
    for (outcome, policy), value in sorted(metrics.labelled(counters, "migrations").items()):
        migrations.add_metric([outcome, policy], value)
    yield migrations
    for name, doc, buckets in (
            ("blackout_seconds", "Blackout of each completed pre-copy migration",
             metrics.BLACKOUT_S),
            ("duration_seconds", "QEMU's time for each completed migration", metrics.TOTAL_S)):
        cumulative, total = metrics.histogram(counters, name, buckets)
        yield HistogramMetricFamily(f"vmmgr_migration_{name}", doc, buckets=cumulative,
                                    sum_value=total)
    yield CounterMetricFamily("vmmgr_migration_sent_bytes", "Bytes sent by completed migrations",
                              value=counters.get(("bytes_sent",), 0.0))
    evacuated = CounterMetricFamily("vmmgr_evacuated_vms", "VMs taken off reclaimed or drained "
                                    "hosts, by how", labels=["kind", "outcome"])
    for (kind, outcome), value in sorted(metrics.labelled(counters, "evacuated_vms").items()):
        evacuated.add_metric([kind, outcome], value)
    yield evacuated
    evacuations = CounterMetricFamily("vmmgr_evacuations", "Reclaims and drains", labels=["kind"])
    for (kind,), value in sorted(metrics.labelled(counters, "evacuations").items()):
        evacuations.add_metric([kind], value)
    yield evacuations
    notices = CounterMetricFamily("vmmgr_notices", "Preemption notices acted on, by source",
                                  labels=["source"])
    for (source,), value in sorted(metrics.labelled(counters, "notices").items()):
        notices.add_metric([source], value)
    yield notices
    met = CounterMetricFamily("vmmgr_deadline_vms", "VMs of reclaims with a deadline: safe "
                              "within it (met) or not (missed)", labels=["outcome"])
    for (outcome,), value in sorted(metrics.labelled(counters, "deadline_vms").items()):
        met.add_metric([outcome], value)
    yield met
    yield CounterMetricFamily("vmmgr_reconcile_repairs", "Records and routes the reconcile "
                              "repaired", value=counters.get(("reconcile_repairs",), 0.0))
    yield CounterMetricFamily("vmmgr_reconcile_recoveries", "Operations cut short that the "
                              "reconcile finished or undid",
                              value=counters.get(("reconcile_recoveries",), 0.0))

    by_state: dict[str, int] = {}
    for record in fleet.state.vms().values():
        by_state[record.get("state") or "unknown"] = by_state.get(record.get("state") or "unknown", 0) + 1
    vms = GaugeMetricFamily("vmmgr_vms", "VMs by state (their records)", labels=["state"])
    for state, n in sorted(by_state.items()):
        vms.add_metric([state], n)
    yield vms

    parked = [s for s in suspend.suspended(fleet) if s.parked]
    yield GaugeMetricFamily("vmmgr_parked_vms", "VMs suspended for want of room",
                            value=len(parked))
    yield GaugeMetricFamily("vmmgr_parked_longest_wait_seconds", "How long the longest-parked "
                            "VM has waited", value=max((now - s.suspended_at for s in parked),
                                                       default=0.0))

    hosts = overview.host_rows(fleet)
    memory = GaugeMetricFamily("vmmgr_host_memory_mib", "Host memory for VMs",
                               labels=["host", "kind"])
    vcpus = GaugeMetricFamily("vmmgr_host_vcpus", "Host vCPUs for VMs", labels=["host", "kind"])
    up = GaugeMetricFamily("vmmgr_host_reachable", "1 if the host's libvirtd answered the last "
                           "reconcile", labels=["host", "state"])
    for h in hosts:
        up.add_metric([h["name"], h["state"]], 1 if h["reachable"] else 0)
        if h["reachable"]:
            for kind in ("used", "free"):
                memory.add_metric([h["name"], kind], h[f"{kind}_memory_mib"])
                vcpus.add_metric([h["name"], kind], h[f"{kind}_vcpus"])
            memory.add_metric([h["name"], "total"], h["memory_mib"])
            vcpus.add_metric([h["name"], "total"], h["vcpus"])
    yield from (memory, vcpus, up)

    depth = GaugeMetricFamily("vmmgr_task_queue_depth", "Tasks waiting in each queue",
                              labels=["queue"])
    r = fleet.state.r
    sites = sorted({site_queue(s) for s in fleet.sites().values()} - {CONTROL_QUEUE})
    for queue in [CONTROL_QUEUE, *sites] + [host_queue(h["name"]) for h in hosts]:
        pipe = r.pipeline(transaction=False)
        for name in [queue] + [f"{queue}{PRIORITY_SEP}{p}" for p in PRIORITIES]:
            pipe.llen(name)
        depth.add_metric([queue], sum(pipe.execute()))
    yield depth
    waiting = [now - float(t.get("submitted") or now) for t in
               fleet.state.recent_tasks(RECENT_TASKS) if not t.get("started")]
    yield GaugeMetricFamily("vmmgr_task_oldest_waiting_seconds", "Age of the oldest task not "
                            "started yet", value=max(waiting, default=0.0))
