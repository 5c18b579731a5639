from vmmgr.display import progress_line
from vmmgr.migration import JobProgress, MigrationResult

MiB = 1024 * 1024

# Shapes of libvirt's jobStats() dicts as seen on the lab (keys libvirt 9.0 reports).
RUNNING = {
    "type": 2, "time_elapsed": 812, "data_total": 140 * MiB, "data_processed": 60 * MiB,
    "data_remaining": 80 * MiB, "memory_bps": 400 * MiB, "memory_dirty_rate": 2560,
    "memory_page_size": 4096, "memory_iteration": 1,
}
COMPLETED = {
    "type": 3, "time_elapsed": 502, "downtime": 20, "data_processed": 93_200_000,
    "memory_processed": 93_000_000, "memory_iteration": 2, "setup_time": 4,
}


def test_progress_from_stats():
    p = JobProgress.from_stats(RUNNING, downtime_limit_ms=300)
    assert p.processed_bytes == 60 * MiB and p.remaining_bytes == 80 * MiB
    assert p.total_bytes == 140 * MiB and p.speed_bps == 400 * MiB
    assert p.dirty_rate_bps == 2560 * 4096  # pages/s times the page size
    assert p.iteration == 1 and p.downtime_limit_ms == 300
    assert abs(p.fraction - 60 / 140) < 1e-9
    assert p.as_dict()["fraction"] == round(60 / 140, 4)


def test_progress_before_the_job_has_numbers():
    p = JobProgress.from_stats({"type": 2, "time_elapsed": 30})
    assert p.fraction == 0.0
    assert "preparing" in progress_line(p)


def test_progress_line_shows_every_field():
    line = progress_line(JobProgress.from_stats(RUNNING, downtime_limit_ms=300))
    for part in ("43%", "60/140 MiB", "80 MiB left", "400 MiB/s", "dirty 10.0 MiB/s", "iter 1",
                 "limit 300 ms"):
        assert part in line, part


def test_result_from_completed_stats():
    r = MigrationResult.from_completed_stats("vm1", "host1", "host2", COMPLETED, 1900, 1.5e9)
    assert (r.total_ms, r.downtime_ms, r.bytes_transferred, r.memory_iterations) == (
        502, 20, 93_200_000, 2)
    assert r.as_dict()["source"] == "host1" and r.as_dict()["wall_ms"] == 1900


def test_result_falls_back_when_stats_lack_fields():
    r = MigrationResult.from_completed_stats("vm1", "a", "b", {"memory_processed": 7}, 1234, 0)
    assert r.total_ms == 1234 and r.bytes_transferred == 7 and r.downtime_ms is None


def test_flags_and_params_follow_the_policy():
    import libvirt
    from dataclasses import replace
    from vmmgr.migration import BASE_FLAGS, flags_and_params
    from vmmgr.policy import get_policy

    flags, params = flags_and_params(get_policy("balanced", 32))
    assert flags & BASE_FLAGS == BASE_FLAGS
    assert flags & libvirt.VIR_MIGRATE_AUTO_CONVERGE and flags & libvirt.VIR_MIGRATE_POSTCOPY
    assert params[libvirt.VIR_MIGRATE_PARAM_BANDWIDTH] == 32
    assert params[libvirt.VIR_MIGRATE_PARAM_BANDWIDTH_POSTCOPY] == 32
    assert params[libvirt.VIR_MIGRATE_PARAM_AUTO_CONVERGE_INITIAL] == 60

    flags, params = flags_and_params(replace(get_policy("safe"), auto_converge=False,
                                             parallel_connections=4, compression="xbzrle"))
    assert not flags & libvirt.VIR_MIGRATE_POSTCOPY and not flags & libvirt.VIR_MIGRATE_AUTO_CONVERGE
    assert flags & libvirt.VIR_MIGRATE_PARALLEL and flags & libvirt.VIR_MIGRATE_COMPRESSED
    assert params[libvirt.VIR_MIGRATE_PARAM_PARALLEL_CONNECTIONS] == 4
    assert libvirt.VIR_MIGRATE_PARAM_BANDWIDTH not in params
