"""The training demo's decisions (pure) and its plot; the run itself is a lab test."""

import pytest

from vmmgr import training_demo as td
from vmmgr.errors import VmmgrError


def test_moves_go_to_the_least_visited_host_with_room():
    where = {"train-a": "host3", "train-b": "host3"}
    free = {"host1": 768, "host2": 768, "host3": 512}
    assert td.next_target("train-a", where, free, 256, {}) == "host1"  # by name among equals
    assert td.next_target("train-a", where, free, 256, {"host1": 1}) == "host2"
    assert td.next_target("train-a", where, {"host1": 100, "host2": 255, "host3": 900}, 256,
                          {}) is None  # never its own host, never one without room


def test_a_simulated_run_of_13_moves_visits_every_host_and_always_fits():
    hosts = ["host1", "host2", "host3"]
    start = td.placements(hosts)
    used = {h: 0 for h in hosts}
    for vm, h in start.items():
        used[h] += td.MEMORY_MIB
    where, visits, seen = {vm: start[vm] for vm in td.MOVING}, {}, set()
    for i in range(13):
        vm = td.MOVING[i % 2]
        free = {h: 1024 - used[h] for h in hosts}
        target = td.next_target(vm, where, free, td.MEMORY_MIB, visits)
        assert target is not None and free[target] >= td.MEMORY_MIB
        used[where[vm]] -= td.MEMORY_MIB
        used[target] += td.MEMORY_MIB
        where[vm], visits[target] = target, visits.get(target, 0) + 1
        seen.add(target)
    assert seen == set(hosts)
    assert where.keys() == set(td.MOVING) and start[td.STILL[0]] == "host1"


def test_fillers_leave_no_other_host_room_for_a_training_vm():
    free = {"host1": 768, "host2": 200, "host3": 1024}
    sizes = td.filler_sizes(free, "host3", 256)
    assert sizes == {"host1": 768 - td.FILLER_SLACK_MIB}  # host2 has no room already
    assert all(free[h] - mib < 256 for h, mib in sizes.items())


def test_the_still_pair_never_shares_the_reclaimed_host():
    start = td.placements(["host1", "host2", "host3", "host4"])
    assert start[td.MOVING[0]] == start[td.MOVING[1]] == "host4"
    assert {start[v] for v in td.STILL} == {"host1", "host2"}
    with pytest.raises(VmmgrError, match="at least 3 hosts"):
        td.placements(["host1", "host2"])


def test_identical_means_every_loss_the_same_and_some_losses():
    assert not td.TrainingReport().identical
    r = td.TrainingReport(moved_losses=["1 0.5", "2 0.25"], still_losses=["1 0.5", "2 0.25"])
    assert r.identical
    r.moved_losses[1] = "2 0.25000000000000006"  # one bit off
    assert not r.identical


def test_the_first_difference_names_its_step_and_the_moves_before_it():
    r = td.TrainingReport(moves=[td.Move("train-a", "live", "host3", "host1", 1),
                                 td.Move("train-b", "live", "host3", "host2", 5)],
                          moved_losses=["1 0.5", "2 0.25000000000000006", "3 0.125"],
                          still_losses=["1 0.5", "2 0.25", "3 0.125"])
    assert r.first_difference() == (
        "step 2: moved '2 0.25000000000000006', never moved '2 0.25'; moves before it: "
        "train-a live host3->host1 at step 1")
    r.moved_losses = ["1 0.5", ""]  # a torn line: still an answer, not an exception
    assert r.first_difference().startswith("step 0: moved '', never moved '2 0.25'")
    r.moved_losses = r.still_losses[:2]
    assert r.first_difference() == "2 lines moved, 3 never moved"


def test_the_plot_is_a_png_with_both_curves(tmp_path):
    losses = [f"{i} {1 / i!r}" for i in range(1, 101)]
    report = td.TrainingReport(
        moves=[td.Move("train-a", "live", "host3", "host1", 10, blackout_ms=40),
               td.Move("train-b", "reclaim", "host3", "host2", 50, suspended_s=20.5)],
        moved_losses=losses, still_losses=list(losses))
    path = td.write_plot(report, tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert report.moves[1].row()[-1] == "suspended 20.5 s"
    assert report.moves[0].row()[-1] == "blackout 40 ms"


def test_the_script_is_shipped_with_the_package():
    text = td.script_text().decode()
    assert "def all_reduce" in text and "OPENBLAS_NUM_THREADS" in text
