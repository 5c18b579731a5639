"""Following a task: each state a task can end in ends the wait."""

import pytest

from tasks import client
from vmmgr.errors import Conflict, VmmgrError


def _states(mocker, *metas, stores=None):
    mocker.patch.object(client.app.backend, "get_task_meta", side_effect=list(metas))
    mocker.patch.object(client, "_stores_of", return_value=stores)


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


class _Stores:
    """A subscription whose next message comes at once, as when the task's state is stored."""

    def __init__(self):
        self.waits, self.closed = [], False

    def get_message(self, timeout):
        self.waits.append(timeout)
        return {"type": "message"}

    def close(self):
        self.closed = True


def test_each_stored_state_wakes_the_wait_instead_of_a_sleep(mocker):
    stores = _Stores()
    _states(mocker, {"status": "PENDING", "result": None}, {"status": "STARTED", "result": None},
            {"status": "SUCCESS", "result": {"vm": "a"}}, stores=stores)
    sleep = mocker.patch.object(client.time, "sleep")
    assert client.wait("t4", poll=5) == {"vm": "a"}
    assert stores.waits == [5, 5]  # waited on the channel (at most a poll each), never slept
    sleep.assert_not_called()
    assert stores.closed


def test_a_broken_subscription_falls_back_to_polling(mocker):
    stores = _Stores()
    stores.get_message = mocker.Mock(side_effect=ConnectionError("redis went away"))
    _states(mocker, {"status": "PENDING", "result": None},
            {"status": "SUCCESS", "result": {"vm": "a"}}, stores=stores)
    sleep = mocker.patch.object(client.time, "sleep")
    assert client.wait("t5", poll=0.25) == {"vm": "a"}
    sleep.assert_called_once_with(0.25)
