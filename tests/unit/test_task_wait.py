"""Following a task: each state a task can end in ends the wait."""

import pytest

from tasks import client
from vmmgr.errors import Conflict, VmmgrError


def _states(mocker, *metas):
    mocker.patch.object(client.app.backend, "get_task_meta", side_effect=list(metas))


def test_a_task_revoked_in_its_queue_ends_the_wait_with_a_clear_error(mocker):
    _states(mocker, {"status": "PENDING", "result": None},
            {"status": "REVOKED", "result": None})
    with pytest.raises(VmmgrError, match="revoked: it did not run"):
        client.wait("t1", poll=0)


def test_progress_then_the_result(mocker):
    seen = []
    _states(mocker, {"status": "PROGRESS", "result": {"events": ["moving"], "event_count": 1}},
            {"status": "SUCCESS", "result": {"vm": "a"}})
    assert client.wait("t2", on_event=seen.append, poll=0) == {"vm": "a"}
    assert seen == ["moving"]


def test_the_operations_own_error_is_raised_as_it_was(mocker):
    _states(mocker, {"status": "FAILURE", "result": Conflict("VM 'a' is busy")})
    with pytest.raises(Conflict, match="busy"):
        client.wait("t3", poll=0)
