"""A redelivered task that a run has already ended answers with that outcome (run_once)."""

import json
from types import SimpleNamespace

import pytest

from tasks import runtime
from vmmgr.errors import Conflict, VmmgrError
from vmmgr.state import FleetState


@pytest.fixture
def fleet_state(redis_url, mocker):
    fleet_state = FleetState(redis_url)
    mocker.patch.object(runtime, "state", return_value=fleet_state)
    return fleet_state


def task(task_id: str):
    return SimpleNamespace(request=SimpleNamespace(id=task_id, delivery_info={}),
                           update_state=lambda **kw: None)


def test_a_redelivered_task_that_ended_is_not_run_again(fleet_state):
    calls = []
    assert runtime.run_once(task("t1"), None, lambda run: calls.append(1) or {"done": 1}) == {"done": 1}
    # its message comes back (the acknowledgement lost with the broker's connection)
    assert runtime.run_once(task("t1"), None, lambda run: calls.append(2) or {"done": 2}) == {"done": 1}
    assert calls == [1]
    assert json.loads(fleet_state.task("t1")["outcome"]) == {"result": {"done": 1}}
    assert "had already ended" in fleet_state.events(10)[-1]["message"]


def test_a_failed_task_answers_with_the_same_kind_of_error(fleet_state):
    def refused(run):
        raise Conflict("VM 'a' is busy")
    with pytest.raises(Conflict):
        runtime.run_once(task("t2"), None, refused)
    with pytest.raises(Conflict, match="VM 'a' is busy") as err:
        runtime.run_once(task("t2"), None, lambda run: pytest.fail("ran again"))
    assert err.value.exit_code == 4


def test_an_unexpected_error_is_recorded_too(fleet_state):
    def broken(run):
        raise ZeroDivisionError("oops")
    with pytest.raises(ZeroDivisionError):
        runtime.run_once(task("t3"), None, broken)
    with pytest.raises(RuntimeError, match="ZeroDivisionError: oops"):
        runtime.run_once(task("t3"), None, lambda run: pytest.fail("ran again"))


def test_a_run_that_died_mid_way_recorded_nothing_and_runs_again(fleet_state):
    fleet_state.task_started("t4", "host1")  # an earlier run, killed before it ended
    assert runtime.run_once(task("t4"), None, lambda run: {"rerun": run.rerun}) == {"rerun": True}


def test_a_class_that_needs_more_than_its_message_comes_back_as_the_base_error(fleet_state):
    outcome = {"error": "PostcopyPaused", "message": "post-copy of a broke"}
    with pytest.raises(VmmgrError, match="post-copy of a broke"):
        runtime.replay(outcome)
