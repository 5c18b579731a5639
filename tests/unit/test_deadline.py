"""The deadline planner, without a hypervisor: made-up sizes, dirty rates and bandwidths."""

from dataclasses import replace

import pytest

from vmmgr.deadline import Candidate, Rates, plan
from vmmgr.errors import VmmgrError

RATES = Rates(link_mibps=100, link_total_mibps=200, storage_mibps=200, save_streams=2,
              overhead_s=1.5, hibernate_overhead_s=10)


def hows(p):
    return {m.vm: m.how for m in p.moves}


def test_everything_migrates_when_the_link_makes_it_in_time():
    vms = [Candidate(f"v{i}", 128, target="h2") for i in range(3)]
    p = plan(vms, 30, RATES)
    assert p.feasible and set(hows(p).values()) == {"migrate"}
    assert p.end_s < 30 and "all safe" in p.summary()
    # a 128 MiB move copies for 1.3 s and sets up and switches over for 1.5 s: four streams at
    # once fill the 200 MiB/s that two would fill only while they copy
    assert p.link_streams == 4 and [m.start_s for m in p.moves] == [0, 0, 0]


def test_two_streams_that_fill_the_link_leave_a_third_move_waiting():
    rates = Rates(link_mibps=100, link_total_mibps=200, storage_mibps=200, overhead_s=0.0)
    p = plan([Candidate(f"v{i}", 128, target="h2") for i in range(3)], 30, rates)
    assert p.link_streams == 2
    assert sorted(m.start_s for m in p.moves) == [0, 0, p.moves[0].end_s]


def test_a_short_deadline_sends_some_to_storage_and_keeps_the_rest_running():
    vms = [Candidate(f"v{i}", 1024, target="h2") for i in range(6)]
    everything_migrates = 3 * (1024 / 100 + 1.5)
    assert everything_migrates > 30
    p = plan(vms, 30, RATES)
    assert p.feasible, p.summary()
    kinds = list(hows(p).values())
    assert kinds.count("suspend") == 2 and kinds.count("migrate") == 4
    assert max(m.end_s for m in p.moves) <= 30


def test_a_guest_that_dirties_faster_than_pre_copy_can_chase_moves_by_post_copy():
    p = plan([Candidate("busy", 512, dirty_mibps=80, target="h2"),
              Candidate("calm", 512, dirty_mibps=5, target="h2")], 60, RATES)
    assert hows(p) == {"busy": "postcopy", "calm": "migrate"}
    busy = next(m for m in p.moves if m.vm == "busy")
    # one pass at its share of the link, bounded whatever it dirties
    assert busy.end_s - busy.start_s == 512 / min(100, 200 / p.link_streams) + 1.5


def test_no_room_means_a_save_and_a_device_means_a_hibernation():
    p = plan([Candidate("big", 256, target=None), Candidate("gpu", 256, live=False, target="h3"),
              Candidate("gpu2", 256, live=False, target=None)], 60, RATES)
    assert hows(p) == {"big": "suspend", "gpu": "hibernate", "gpu2": "hibernate"}
    assert {m.vm: m.target for m in p.moves} == {"big": None, "gpu": "h3", "gpu2": None}
    assert "no host has room" in next(m.reason for m in p.moves if m.vm == "big")


def test_a_job_goes_one_way_whole():
    """Two ranks of one training run: one has no room elsewhere, so both are parked (and will
    resume together) rather than one running on while its peer waits."""
    p = plan([Candidate("rank0", 256, target="h2", group="train"),
              Candidate("rank1", 256, target=None, group="train"),
              Candidate("solo", 256, target="h2")], 60, RATES)
    assert hows(p) == {"rank0": "suspend", "rank1": "suspend", "solo": "migrate"}
    assert "moves as one" in next(m.reason for m in p.moves if m.vm == "rank0")
    # ...and when both have room, both migrate
    p = plan([Candidate("rank0", 256, target="h2", group="train"),
              Candidate("rank1", 256, target="h3", group="train")], 60, RATES)
    assert set(hows(p).values()) == {"migrate"}


def test_when_not_everything_can_be_saved_it_says_so_first_and_saves_the_most():
    vms = [Candidate("huge", 8192, target="h2"), Candidate("a", 256, target="h2"),
           Candidate("b", 256, target=None)]
    p = plan(vms, 10, RATES)
    assert not p.feasible and p.late == ["huge"]
    assert "cannot save everything in time" in p.summary() and "huge" in p.summary()
    # the small ones are not held up behind the large one
    assert all(m.end_s <= 10 for m in p.moves if m.vm != "huge")


def test_durations():
    import pytest
    from vmmgr.deadline import parse_duration
    from vmmgr.errors import InvalidRequest
    assert [parse_duration(t) for t in ("30", "30s", "2m", "1h", "1.5m")] == [30, 30, 120, 3600, 90]
    for bad in ("", "soon", "-5s", "0", "2d", "25h", "\u00b2s", "nan"):
        with pytest.raises(InvalidRequest):
            parse_duration(bad)


def test_the_naive_strategies_it_is_measured_against():
    from vmmgr.deadline import naive
    vms = [Candidate(f"v{i}", 512, target="h2") for i in range(3)] + [Candidate("nr", 128)]
    p, r = naive(vms, "all-at-once", 30, RATES)
    assert r.link_streams == 4 and hows(p) == {"v0": "migrate", "v1": "migrate",
                                                "v2": "migrate", "nr": "suspend"}
    p, r = naive(vms, "one-at-a-time", 30, RATES)
    assert r.link_streams == 1 and sorted(m.start_s for m in p.moves if m.how == "migrate")[1] > 0
    p, r = naive(vms, "suspend-all", 30, RATES)
    assert set(hows(p).values()) == {"suspend"} and r.save_streams == 4


def test_no_more_streams_than_run_however_slow_one_is():
    """A measured 20 MiB/s stream on a 220 MiB/s link would promise 11 at once; the executor
    runs at most four, and the plan must not count on more."""
    from vmmgr.deadline import MAX_STREAMS
    slow = Rates(link_mibps=20, link_total_mibps=220, storage_mibps=200)
    p = plan([Candidate(f"v{i}", 128, target="h2") for i in range(8)], 600, slow)
    assert max(sum(1 for m in p.moves if m.start_s <= t < m.end_s)
               for t in [m.start_s for m in p.moves]) == MAX_STREAMS


def test_a_move_over_a_slow_wan_is_costed_at_the_rate_it_measured():
    # 1024 MiB: 12 s over the LAN's 100 MiB/s stream, 44 s over a 24 MiB/s WAN
    near = plan([Candidate("a", 1024, target="h2")], 30, RATES)
    assert hows(near) == {"a": "migrate"} and near.end_s < 15
    far = plan([Candidate("a", 1024, target="h3", link_mibps=24)], 30, RATES)
    assert hows(far) == {"a": "suspend"}  # the WAN would miss the deadline: saved instead
    assert far.feasible
    roomy = plan([Candidate("a", 1024, target="h3", link_mibps=24)], 120, RATES)
    [move] = roomy.moves
    assert move.how == "migrate" and 40 < move.end_s < 50
    assert move.reason == "h3 has room, over a link measured at 24 MiB/s"


def test_a_stream_that_fills_most_of_what_is_left_pays():
    """A migration measured at 25 MiB/s on a 47 MiB/s link leaves 22 idle at one stream: two
    run at once. One that leaves less than half a stream's worth does not add one."""
    from vmmgr.deadline import streams_that_pay
    assert streams_that_pay(47, 25) == 2
    assert streams_that_pay(47, 40) == 1
    assert streams_that_pay(220, 110) == 2
    assert streams_that_pay(10, 50) == 1
    two = plan([Candidate(f"v{i}", 128, target="h2") for i in range(4)], 600,
               Rates(link_mibps=25, link_total_mibps=47, storage_mibps=200))
    assert sorted(m.start_s for m in two.moves)[:2] == [0.0, 0.0]


def test_on_the_link_the_longest_move_starts_first_so_it_has_the_most_slack():
    rates = Rates(link_mibps=100, link_total_mibps=100, storage_mibps=200, overhead_s=0.0)
    p = plan([Candidate("small", 100, target="h2"), Candidate("big", 1000, target="h2"),
              Candidate("mid", 300, target="h2")], 60, rates)
    assert [m.vm for m in sorted(p.moves, key=lambda m: m.start_s)] == ["big", "mid", "small"]


def test_a_deadline_not_all_can_meet_keeps_shortest_first_to_save_the_most():
    slow_storage = Rates(link_mibps=100, link_total_mibps=100, storage_mibps=1, overhead_s=0.0)
    p = plan([Candidate("a", 100, target="h2"), Candidate("b", 100, target="h2"),
              Candidate("big", 1000, target="h2")], 10.5, slow_storage)
    # longest first would leave both small ones late; shortest first, only the big one
    assert p.late == ["big"] and "cannot save everything" in p.summary()


def test_a_local_disk_is_in_the_estimate_and_keeps_a_dirtier_off_post_copy():
    from vmmgr.deadline import migration_seconds, save_seconds
    rates = Rates(link_mibps=100, link_total_mibps=100, storage_mibps=200, overhead_s=1.0,
                  sent_fraction=1.0)
    plain, disk = Candidate("a", 512, target="h2"), Candidate("b", 512, target="h2",
                                                              disk_mib=300)
    assert migration_seconds(disk, 100, rates)[1] - migration_seconds(plain, 100, rates)[1] == (
        pytest.approx(3.0))
    assert save_seconds(disk, 200, rates)[1] - save_seconds(plain, 200, rates)[1] == (
        pytest.approx(1.5))
    hot = Candidate("c", 512, dirty_mibps=80, target="h2")
    assert migration_seconds(hot, 100, rates)[0] == "postcopy"
    how, seconds = migration_seconds(Candidate("d", 512, dirty_mibps=80, target="h2",
                                               disk_mib=300), 100, rates)
    assert how == "migrate" and seconds == pytest.approx(3.0 + 512 / 50 + 1.0)
    # a deadline the disk's copy would miss: the disk VM is parked, the other migrates
    p = plan([plain, disk], 9, rates)
    assert hows(p) == {"a": "migrate", "b": "suspend"}, p.moves


def test_a_base_image_the_target_site_lacks_is_in_a_migrations_estimate_only():
    from vmmgr.deadline import migration_seconds, save_seconds
    rates = Rates(link_mibps=100, link_total_mibps=100, storage_mibps=200, overhead_s=1.0,
                  sent_fraction=1.0)
    near = Candidate("a", 512, target="h2", disk_mib=300)
    far = Candidate("a", 512, target="h3", disk_mib=300, base_mib=800)
    assert migration_seconds(far, 100, rates)[1] - migration_seconds(near, 100, rates)[1] == (
        pytest.approx(8.0))
    assert save_seconds(far, 200, rates) == save_seconds(near, 200, rates)  # the disk alone
    # 8 s more would miss a 12 s deadline: parked instead (its disk kept beside its save)
    assert hows(plan([near], 12, rates)) == {"a": "migrate"}
    assert hows(plan([far], 12, rates)) == {"a": "suspend"}


def test_the_base_a_move_must_send_is_asked_of_its_target_once(mocker, tmp_path):
    from vmmgr import deadline_run, os_images, site_images
    base = str(tmp_path / "os" / "debian-12" / "disk.qcow2")
    mocker.patch("vmmgr.local_disks.overlay_of", return_value=(2**30, base))
    held = mocker.patch.object(site_images, "held", return_value=False)
    image = mocker.patch.object(os_images, "get",
                                return_value=mocker.Mock(size=800 * 2**20))
    fleet, known = mocker.Mock(), {}
    guest = mocker.Mock()
    assert deadline_run._base_mib(fleet, guest, "h3", known) == 800
    assert deadline_run._base_mib(fleet, guest, "h3", known) == 800
    assert held.call_count == 1 and image.call_args.args[1] == "debian-12"
    held.return_value = True
    assert deadline_run._base_mib(fleet, guest, "h2", known) == 0.0
    assert deadline_run._base_mib(fleet, guest, None, known) == 0.0
    mocker.patch("vmmgr.local_disks.overlay_of", side_effect=VmmgrError("pool gone"))
    assert deadline_run._base_mib(fleet, guest, "h4", known) == 0.0  # the estimate pays


def test_a_move_between_sites_is_costed_with_its_links_time_outside_the_copy():
    # 512 MiB at 100 MiB/s: 5.1 s of copy on either link; the WAN's round trips add 6 s a move
    rates = Rates(link_mibps=100, link_total_mibps=100, storage_mibps=200, save_streams=1,
                  overhead_s=1.0, sent_fraction=1.0)
    near = plan([Candidate("a", 512, target="h2")], 9, rates)
    assert hows(near) == {"a": "migrate"} and near.moves[0].end_s == pytest.approx(6.12)
    far = Candidate("a", 512, target="h3", overhead_s=7.0)
    roomy = plan([far], 60, rates)
    [move] = roomy.moves
    assert move.how == "migrate" and move.end_s == pytest.approx(12.12)
    assert move.reason == "h3 has room, over a link measured at 7 s a move outside its copy"
    tight = plan([far], 9, rates)  # the WAN's move would end at 12 s: saved instead (3.6 s)
    assert hows(tight) == {"a": "suspend"} and tight.feasible


def test_a_base_image_sent_first_is_not_learnt_as_time_outside_the_copy():
    from vmmgr.migration import MigrationResult

    moved = MigrationResult("a", "h1", "h3", total_ms=5000, downtime_ms=250,
                            bytes_transferred=0, memory_iterations=1, wall_ms=98000,
                            started_at=0.0, base_ms=90000)  # 90 s sending a 2 GiB base
    assert moved.outside_copy_s == pytest.approx(3.0)
    assert replace(moved, base_ms=0).outside_copy_s == pytest.approx(93.0)
