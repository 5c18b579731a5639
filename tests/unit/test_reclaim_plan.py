from vmmgr.host import Capacity
from vmmgr.reclaim import Step, VMSize, plan_evacuation


def cap(used=0, memory=1024, vcpus=4, used_vcpus=0):
    return Capacity(memory, vcpus, used, used_vcpus, ())


def test_largest_first_onto_the_most_room_reserving_as_it_goes():
    vms = [VMSize("a", 128, 1), VMSize("b", 512, 1), VMSize("c", 256, 1)]
    steps = plan_evacuation(vms, {"h2": cap(used=0), "h3": cap(used=256)}, deadline=True)
    assert [(s.vm, s.action, s.target) for s in steps] == [
        ("b", "migrate", "h2"),  # 1024 free beats 768
        ("c", "migrate", "h3"),  # now h3 has 768, h2 512
        ("a", "migrate", "h2"),  # h2 512 vs h3 512: tie goes by name
    ]


def test_what_does_not_fit_is_suspended_under_a_deadline_and_waits_otherwise():
    vms = [VMSize("big", 900, 1), VMSize("small", 100, 1)]
    caps = {"h2": cap(used=824)}  # 200 MiB free
    reclaim = plan_evacuation(vms, caps, deadline=True)
    assert [(s.vm, s.action) for s in reclaim] == [("big", "suspend"), ("small", "migrate")]
    assert reclaim[0].reason == "no room (h2: needs 900 MiB, 200 MiB free of 1024 MiB)"
    drain = plan_evacuation(vms, caps, deadline=False)
    assert [(s.vm, s.action) for s in drain] == [("big", "wait"), ("small", "migrate")]


def test_no_other_host_at_all():
    steps = plan_evacuation([VMSize("a", 128, 1)], {}, deadline=True)
    assert steps == [Step("a", "suspend", None, "no room (no other active host)")]


def test_never_overcommits_across_the_plan():
    vms = [VMSize(f"v{i}", 300, 1) for i in range(7)]
    steps = plan_evacuation(vms, {"h2": cap(), "h3": cap()}, deadline=True)
    placed = [s.target for s in steps if s.action == "migrate"]
    assert placed.count("h2") == 3 and placed.count("h3") == 3  # 900 MiB fits, 1200 does not
    assert [s.vm for s in steps if s.action == "suspend"] == ["v6"]


class _Report:
    rerun = False

    def __init__(self):
        self.events = []

    def event(self, message, vm="", host="", kind="info"):
        self.events.append((vm, message))

    def progress(self, progress):
        pass


def test_under_a_deadline_a_failed_move_is_parked_not_left_behind(mocker):
    from vmmgr import operations, reclaim
    from vmmgr.errors import MigrationFailed

    migrated = mocker.patch.object(operations, "migrate", side_effect=MigrationFailed("link down"))
    parked = mocker.patch.object(operations, "suspend", return_value={"parked": True})
    steps = [Step("a", "migrate", "h2", ""), Step("b", "suspend", None, "no room")]

    outcome = reclaim.EvacuationReport("h1", [], [], {}, 0.0)
    report = _Report()
    fleet = mocker.Mock()
    fleet.find.return_value = mocker.Mock(is_active=lambda: True)  # running: it migrates
    reclaim._carry_out(fleet, steps, outcome, 2, 2, True, report)
    assert sorted(outcome.suspended) == ["a", "b"] and outcome.failed == {}
    # Each step goes through the operation's one body (which takes the lock and keeps records),
    # in the reclaim's report; a VM that could not move is parked, not left behind.
    assert migrated.call_args.args[1:] == (report, "a", "h2", None)  # the default policy
    assert sorted(c.args[2] for c in parked.call_args_list) == ["a", "b"]
    assert all(c.kwargs["parked"] for c in parked.call_args_list)
    assert ("a", "a: suspending, migration failed (link down)") in report.events

    # Without a deadline (drain) nothing is suspended: the failure is reported, the VM stays.
    parked.reset_mock()
    outcome = reclaim.EvacuationReport("h1", [], [], {}, 0.0)
    reclaim._carry_out(fleet, steps[:1], outcome, 2, 2, False, _Report())
    assert outcome.suspended == [] and outcome.failed == {"a": "link down"}
    parked.assert_not_called()


def test_a_stopped_vm_leaves_by_its_definition_or_parks_it_when_there_is_no_room(mocker):
    from vmmgr import operations, reclaim

    migrated = mocker.patch.object(operations, "migrate")
    parked = mocker.patch.object(operations, "suspend")
    relocated = mocker.patch.object(operations, "relocate_stopped")
    kept = mocker.patch.object(operations, "park_stopped")
    fleet = mocker.Mock()
    fleet.find.return_value = mocker.Mock(is_active=lambda: False, host_name="h1")
    outcome = reclaim.EvacuationReport("h1", [], [], {}, 0.0)
    report = _Report()
    reclaim._carry_out(fleet, [Step("a", "migrate", "h2", ""), Step("b", "suspend", None, "")],
                       outcome, 2, 2, True, report)
    # Nothing runs, so nothing migrates or is saved: a stopped VM's definition moves...
    assert relocated.call_args.args[1:] == (report, "a", "h2") and outcome.migrated == ["a"]
    # ...and with no room anywhere it is kept on storage, never booted, never lost with h1.
    assert kept.call_args.args[1:3] == (report, "b") and outcome.suspended == ["b"]
    assert outcome.failed == {}
    migrated.assert_not_called()
    parked.assert_not_called()


def _cap(free_mib: int, gpus: tuple[str, ...] = ()) -> Capacity:
    return Capacity(1024, 8, 1024 - free_mib, 0, (), gpus)


def test_a_vm_with_a_device_hibernates_to_a_host_with_a_free_equivalent_device():
    vms = [VMSize("gpu1", 256, 1, "lab-gpu", 1, live=False), VMSize("plain", 128, 1)]
    caps = {"roomy": _cap(900), "with-gpu": _cap(300, ("lab-gpu",))}
    steps = {s.vm: s for s in plan_evacuation(vms, caps, deadline=True)}
    assert steps["gpu1"].action == "hibernate" and steps["gpu1"].target == "with-gpu"
    assert steps["plain"].action == "migrate" and steps["plain"].target == "roomy"


def test_devices_are_reserved_as_the_plan_goes_and_the_rest_park():
    vms = [VMSize(f"gpu{i}", 128, 1, "lab-gpu", 1, live=False) for i in (1, 2)]
    caps = {"h2": _cap(900, ("lab-gpu", "other-gpu"))}
    steps = plan_evacuation(vms, caps, deadline=True)
    assert [(s.vm, s.action, s.target) for s in steps] == [
        ("gpu1", "hibernate", "h2"), ("gpu2", "suspend", None)]
    assert "needs 1 lab-gpu device, 0 free" in steps[1].reason


def test_a_parked_job_resumes_only_when_all_of_it_fits():
    from vmmgr.reclaim import place_together
    ranks = [VMSize("rank0", 512, 1), VMSize("rank1", 512, 1)]
    # room for one rank, not for both: neither resumes (no rank runs while its peer waits)
    assert place_together({"h2": cap(used=256)}, ranks) is None
    assert place_together({"h2": cap(used=0)}, ranks) == ["h2", "h2"]
    assert place_together({"h2": cap(used=256), "h3": cap(used=256)}, ranks) == ["h2", "h3"]


def test_a_job_with_a_save_still_going_is_not_resumed_in_part(tmp_path, redis_url):
    """rank0's save ended (record), rank1's has begun (intent only): the job waits for both,
    as the store's copy of the folders says."""
    import json
    from types import SimpleNamespace
    from vmmgr.state import FleetState
    from vmmgr.suspend import INTENT, RECORD, saving_groups, sync_record
    from .saves_fleet import SavesFleet
    fleet = SavesFleet(paths=SimpleNamespace(saves=tmp_path), state=FleetState(redis_url))
    for vm, done in (("rank0", True), ("rank1", False), ("solo", False)):
        d = tmp_path / vm
        d.mkdir()
        (d / INTENT).write_text(json.dumps({"vm": vm, "group": "" if vm == "solo" else "job"}))
        if done:
            (d / RECORD).write_text("{}")
        sync_record(fleet, vm)
    assert saving_groups(fleet) == {"job"}
    (tmp_path / "rank1" / RECORD).write_text("{}")
    sync_record(fleet, "rank1")
    assert saving_groups(fleet) == set()


def test_moving_a_stopped_vm_finishes_a_move_cut_short_between_define_and_undefine(mocker):
    """Defined on the target, the worker died before undefining the source: the next run keeps
    the target's copy and undefines the other, so exactly one host holds the VM."""
    from vmmgr.fleet import Fleet

    fleet = Fleet.__new__(Fleet)
    source = mocker.Mock(host_name="h1", is_active=lambda: False)
    source.xml.return_value = "<domain><devices/></domain>"
    target = mocker.Mock(host_name="h2", is_active=lambda: False)
    mocker.patch.object(Fleet, "find_all", return_value=[source, target])
    fleet.state = mocker.Mock()
    mocker.patch.object(Fleet, "publish")
    mocker.patch.object(Fleet, "host")
    assert fleet.relocate_stopped("vm1", "h2") is target
    source.undefine.assert_called_once()
    target.undefine.assert_not_called()
    fleet.host.assert_not_called()  # nothing defined anew
    fleet.state.set_vm.assert_called_once_with("vm1", state="shutoff", host="h2", target="")


def test_an_evacuation_stays_in_its_site_while_it_has_room_and_says_when_it_leaves():
    sites = {"h1": "east", "h2": "east", "h3": "west"}
    steps = plan_evacuation([VMSize("big", 600, 1), VMSize("small", 300, 1)],
                            {"h2": cap(memory=700), "h3": cap(memory=4000)}, deadline=True,
                            site_of=sites, source="h1")
    assert [(s.vm, s.target) for s in steps] == [("big", "h2"), ("small", "h3")]
    assert steps[0].reason == "h2 has the most room in site east"
    assert steps[1].reason == ("h3 has the most room: a cross-site move (east -> west), "
                               "no room left in east")


def test_a_fleet_without_sites_plans_as_before():
    steps = plan_evacuation([VMSize("a", 300, 1)], {"h2": cap(memory=700), "h3": cap(memory=900)},
                            deadline=False, site_of={"h1": "", "h2": "", "h3": ""}, source="h1")
    assert [(s.target, s.reason) for s in steps] == [("h3", "h3 has the most room")]


def test_a_planned_postcopy_move_is_steered_to_post_copy_right_after_its_first_pass(mocker):
    from vmmgr import operations, reclaim
    from vmmgr.policy import EARLY_POSTCOPY

    migrated = mocker.patch.object(operations, "migrate", return_value={})
    fleet = mocker.Mock()
    fleet.find.return_value = mocker.Mock(is_active=lambda: True)
    steps = [Step("busy", "migrate", "h2", "", policy="never-fail", early_postcopy=True),
             Step("calm", "migrate", "h3", "")]
    outcome = reclaim.EvacuationReport("h1", [], [], {}, 0.0)
    reclaim._carry_out(fleet, steps, outcome, 2, 2, True, _Report())
    calls = {c.args[2]: c for c in migrated.call_args_list}
    assert calls["busy"].args[4] == "never-fail" and calls["busy"].kwargs == EARLY_POSTCOPY
    assert calls["calm"].kwargs == {}
