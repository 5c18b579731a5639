"""The store's copy of the save folders (`suspend.folder_save`, `sync_record`, `sync_records`):
what listings, the web console and the reclaim read, on a node that does not see the storage."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from vmmgr import suspend
from vmmgr.locks import Lease
from vmmgr.state import FleetState
from vmmgr.view import suspended_row

from .saves_fleet import SavesFleet

DOMAIN = ("<domain><name>a</name><metadata><vmmgr:vm xmlns:vmmgr='https://vmmgr.dev/xmlns/vm/1'>"
          "<vmmgr:address>10.78.0.5</vmmgr:address></vmmgr:vm></metadata></domain>")
RECORD = {"vm": "a", "from_host": "h1", "memory_mib": 128, "vcpus": 1, "suspended_at": 5.0,
          "save_ms": 10, "image_bytes": 4096, "parked": True}


@pytest.fixture
def fleet(tmp_path, redis_url):
    state = FleetState(redis_url)
    return SavesFleet(paths=SimpleNamespace(saves=tmp_path / "saves"), state=state,
                      lock_vm=lambda vm, what: Lease(state, "vm", vm, "test", what))


def folder(fleet, vm="a", **files) -> Path:
    d = fleet.paths.saves / vm
    d.mkdir(parents=True, exist_ok=True)
    (d / "domain.xml").write_text(DOMAIN)
    for name, content in files.items():
        (d / f"{name}.json").write_text(json.dumps(content))
    return d


def test_each_step_of_a_folder_has_its_state(fleet):
    d = folder(fleet, intent={"vm": "a", "group": "job"})
    assert suspend.folder_save(d) == {"state": "saving", "intent": {"vm": "a", "group": "job"},
                                      "record": None, "address": "10.78.0.5", "disk": False}
    (d / "record.json").write_text(json.dumps(RECORD))  # cut short after its record
    assert suspend.folder_save(d)["state"] == "saving" and suspend.folder_save(d)["record"]
    (d / "intent.json").unlink()
    (d / "disk.json").write_text("{}")
    assert suspend.folder_save(d) | {"record": None} == {
        "state": "saved", "intent": {}, "record": None, "address": "10.78.0.5", "disk": True}
    (d / "record.json").rename(d / "claim.json")
    assert suspend.folder_save(d)["state"] == "claimed"
    assert suspend.folder_save(d)["record"] == RECORD
    (d / "claim.json").unlink()
    assert suspend.folder_save(d) is None  # half removed: no save
    assert suspend.folder_save(d.parent / "none") is None


def test_lists_read_the_store_not_the_folder(fleet):
    d = folder(fleet, record=RECORD)
    assert suspend.suspended(fleet) == []  # not copied yet
    suspend.sync_record(fleet, "a")
    assert suspend.suspended(fleet) == [suspend.Suspended(**RECORD)]
    row = suspended_row(fleet.state.save_of("a"))
    assert row["state"] == "parked" and row["address"] == "10.78.0.5"
    assert row["suspended_from"] == "h1"
    (d / "record.json").rename(d / "claim.json")
    suspend.sync_record(fleet, "a")
    assert suspend.suspended(fleet) == [] and suspended_row(fleet.state.save_of("a")) is None
    (d / "claim.json").unlink()
    suspend.sync_record(fleet, "a")
    assert fleet.state.save_of("a") is None


def test_the_reconciles_pass_copies_what_differs_and_leaves_a_held_vm_to_its_operation(fleet):
    folder(fleet, "a", record=RECORD)  # never copied (a store restored from an old copy)
    folder(fleet, "b", record=dict(RECORD, vm="b"))
    suspend.sync_record(fleet, "b")
    fleet.state.put_save("gone", {"state": "saved", "intent": {}, "record": RECORD,
                                  "address": "", "disk": False})  # its folder is gone
    folder(fleet, "held", intent={"vm": "held"})
    with Lease(fleet.state, "vm", "held", "suspend-task", "suspend of held"):
        assert suspend.sync_records(fleet) == ["a", "gone"]
    assert set(fleet.state.saves()) == {"a", "b"}
    assert suspend.sync_records(fleet) == ["held"]  # once its operation let go
    assert suspend.sync_records(fleet) == []


def test_a_node_that_does_not_see_the_storage_forgets_nothing(fleet):
    fleet.state.put_save("a", {"state": "saved", "intent": {}, "record": RECORD, "address": "",
                               "disk": False})
    assert not fleet.paths.saves.exists()
    suspend.sync_record(fleet, "a")
    assert suspend.sync_records(fleet) == [] and fleet.state.save_of("a") is not None


def test_a_folder_that_cannot_be_read_is_not_forgotten(fleet):
    d = folder(fleet, record=RECORD)
    suspend.sync_record(fleet, "a")
    (d / "record.json").write_text("{half")  # storage answering garbage
    with pytest.raises(ValueError):
        suspend.sync_record(fleet, "a")
    assert suspend.sync_records(fleet) == [] and fleet.state.save_of("a")["record"] == RECORD


def test_a_save_begun_whose_copy_is_not_written_still_holds_its_job(fleet):
    folder(fleet, "rank0", record=dict(RECORD, vm="rank0", group="job"))
    suspend.sync_record(fleet, "rank0")
    folder(fleet, "rank1", intent={"vm": "rank1", "group": "job"})  # no copy (Redis blinked)
    assert suspend.saving_groups(fleet) == {"job"}


def test_a_save_the_store_will_not_take_ends_before_it_starts(fleet, mocker):
    d = folder(fleet, intent={"vm": "a"})
    mocker.patch.object(fleet.state, "put_save", side_effect=RuntimeError("store gone"))
    with pytest.raises(RuntimeError):
        suspend._sync_begun(fleet, "a", d)
    assert not d.exists() and fleet.state.save_of("a") is None


def test_one_folder_that_cannot_be_parsed_does_not_end_the_pass(fleet, mocker):
    d = folder(fleet, "a", record=RECORD)
    (d / "domain.xml").write_text("<domain><meta")  # cut short as it wrote its definition
    folder(fleet, "b", record=dict(RECORD, vm="b"))
    real = suspend.folder_save
    mocker.patch.object(suspend, "folder_save",
                        side_effect=lambda d: real(d) if d.name != "b" else 1 / 0)
    report = mocker.Mock()
    assert suspend.sync_records(fleet, report) == ["a"]
    assert fleet.state.save_of("a")["address"] == ""
    said = [c.args[0] for c in report.event.call_args_list]
    assert said == ["a: the store's copy of its save written again from storage",
                    "b: its save not copied to the store: division by zero"]


def test_a_stale_copy_never_shows_a_running_vm_as_suspended(redis_url, mocker):
    """b: a save cut short after its record, its host's copy shut off: the save's row stands.
    a: resumed and running, the store's copy left behind (its last write failed): the host's."""
    from vmmgr.fleet import Fleet
    fleet = Fleet.__new__(Fleet)
    fleet.state = FleetState(redis_url)
    for vm in ("a", "b"):
        fleet.state.put_save(vm, {"state": "saved", "intent": {}, "record": dict(RECORD, vm=vm),
                                  "address": "", "disk": False})
    mocker.patch("vmmgr.view.guest_row", side_effect=lambda row: row)
    mocker.patch.object(Fleet, "vms", return_value=[
        {"name": "a", "host": "h2", "state": "running"},
        {"name": "b", "host": "h1", "state": "shutoff"}])
    rows = {r["name"]: r for r in fleet.refresh_view()}
    assert rows["a"]["state"] == "running" and rows["b"]["state"] == "parked"
    assert {v["name"]: v["state"] for v in fleet.state.vm_views()} == {"a": "running",
                                                                       "b": "parked"}
