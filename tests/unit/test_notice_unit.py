"""The notice watcher's systemd unit (the vmmgr_worker role's template): a source is one quoted
word whatever it holds, so a URL's %-escapes and quotes reach the watcher as written."""

import shlex
from pathlib import Path

import jinja2

TEMPLATE = (Path(__file__).parents[2] / "ansible/roles/vmmgr_worker/templates"
            / "vmmgr-notice.service.j2")


def _unit(source: str) -> str:
    return jinja2.Template(TEMPLATE.read_text()).render(
        ansible_managed="managed", inventory_hostname="host1", vmmgr_worker_venv="/opt/v",
        vmmgr_worker_notice_source=source)


def _exec_start(unit: str) -> list[str]:
    [line] = [row for row in unit.splitlines() if row.startswith("ExecStart=")]
    # systemd: %% is one %, $$ one $, then C-style quoting, which shlex matches for \\ and \"
    return shlex.split(line.removeprefix("ExecStart=").replace("%%", "%").replace("$$", "$"))


def test_a_source_reaches_the_watcher_as_written():
    for source in ("file:/var/lib/vmmgr/notice.json", "gce",
                   'http://sched.example/notice?host=a%20b&q="x"&$filter=${HOME}', "file:/srv/with space/n.json"):
        args = _exec_start(_unit(source))
        assert args[args.index("--source") + 1] == source, args


def test_the_watcher_is_restarted_for_ever():
    unit = _unit("gce")
    assert "Restart=always" in unit and "RestartSec=2" in unit
    assert "StartLimitIntervalSec=0" in unit  # in [Unit]: systemd never gives up on it
    assert unit.index("StartLimitIntervalSec=0") < unit.index("[Service]")
