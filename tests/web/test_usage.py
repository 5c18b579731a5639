"""Usage in the API, on its page and in the CLI, from the store's usage stream."""

import csv
import io
import time

import pytest
from click.testing import CliRunner

from vmmgr.cli import cli
from vmmgr.state import USAGE, FleetState


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def history(redis_url):
    """vm1 ran 100 s, was parked 50 s, then ran again; vm2 hibernated 30 s ago."""
    r, now = FleetState(redis_url).r, time.time()
    for t, vm, state in ((now - 200, "vm1", "running"), (now - 100, "vm1", "parked"),
                         (now - 50, "vm1", "running"), (now - 30, "vm2", "hibernated")):
        r.xadd(USAGE, {"time": f"{t:.3f}", "vm": vm, "state": state})
    return now


def test_the_api_reports_seconds_per_state(app, tokens, history):
    now = history
    r = app.test_client().get(f"/api/v1/usage?since={now - 300:.3f}&until={now:.3f}",
                              headers=auth(tokens["viewer"]))
    assert r.status_code == 200
    vm1, vm2 = r.json["vms"]
    assert (vm1["vm"], vm1["running"], vm1["parked"]) == ("vm1", pytest.approx(150, abs=0.01),
                                                          pytest.approx(50, abs=0.01))
    assert vm2["hibernated"] == pytest.approx(30, abs=0.01)


@pytest.mark.parametrize("query", ["since=yesterday", "since=", "until=\u00b2", "since=5m&until=10m",
                                   "window=1h"])
def test_a_bad_window_is_refused(app, tokens, query):
    r = app.test_client().get(f"/api/v1/usage?{query}", headers=auth(tokens["viewer"]))
    assert r.status_code == 400 and r.json["error"]["code"] == "invalid_request"


def test_the_usage_page_draws_a_bar_per_vm(as_role, history):
    page = as_role("viewer").get("/usage?since=1h").get_data(as_text=True)
    assert "vm1" in page and "vm2" in page
    assert page.count('class="u-running"') >= 1 and 'class="u-parked"' in page
    bad = as_role("viewer").get("/usage?since=yesterday").get_data(as_text=True)
    assert "refused: " in bad and "not a time" in bad


def test_the_cli_prints_a_table_json_or_csv(home, history):
    run = CliRunner()
    args = ["--home", str(home.home), "usage", "--since", "1h"]
    table = run.invoke(cli, args)
    assert table.exit_code == 0 and "parked s" in table.output and "vm1" in table.output
    rows = list(csv.DictReader(io.StringIO(run.invoke(cli, args + ["--csv"]).output)))
    assert [r["vm"] for r in rows] == ["vm1", "vm2"]
    assert float(rows[0]["parked"]) == pytest.approx(50, abs=0.01)
    bad = run.invoke(cli, ["--home", str(home.home), "usage", "--since", "soon"])
    assert bad.exception is not None and "not a time" in str(bad.exception)
