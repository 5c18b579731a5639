"""The CLI's lazily loaded commands: every command module's commands are in the map, and a
command runs without its siblings' modules imported."""

import importlib
import subprocess
import sys

from click.testing import CliRunner

from vmmgr.cli import base, cli


def test_every_registered_command_is_in_the_map():
    for module in set(base.COMMAND_MODULES.values()):
        importlib.import_module(f"vmmgr.cli.{module}")
    registered = set(cli.commands)
    assert registered == set(base.COMMAND_MODULES), registered ^ set(base.COMMAND_MODULES)
    for name, module in base.COMMAND_MODULES.items():
        assert cli.commands[name].callback.__module__ == f"vmmgr.cli.{module}", name


def test_help_lists_every_command():
    out = CliRunner().invoke(cli, ["--help"]).output
    for name in base.COMMAND_MODULES:
        assert f"  {name} " in out or f"  {name}\n" in out, name


def test_a_command_imports_only_its_own_module():
    code = ("import sys\n"
            "from vmmgr.cli import cli\n"
            "cli.main(['migrate', 'policies'], standalone_mode=False)\n"
            "print(sorted(m for m in sys.modules if m.startswith('vmmgr.cli.')))\n"
            "print('vmmgr.lab' in sys.modules, 'jinja2' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert any(line.startswith("safe") for line in out[:-2])  # the command ran
    modules, heavy = out[-2], out[-1]
    assert eval(modules) == ["vmmgr.cli.base", "vmmgr.cli.dispatch", "vmmgr.cli.migrate"]
    assert heavy == "False False"  # the lab's modules and Jinja2 are not imported for a migration


def test_the_cli_exits_with_its_output_flushed():
    # main() leaves without Python's teardown (os._exit): what it printed must still arrive,
    # and the exit code be the command's.
    vmmgr = [sys.executable, "-c", "from vmmgr.cli import main; main()"]
    listed = subprocess.run([*vmmgr, "migrate", "policies"], capture_output=True, text=True)
    assert listed.returncode == 0 and listed.stdout.startswith("safe")
    assert "(default)" in listed.stdout and listed.stdout.endswith("\n")
    refused = subprocess.run([*vmmgr, "migrate", "start", "vm1", "--to", "h2", "--policy", "nosuch"],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "nosuch" in refused.stderr


def test_an_unknown_command_is_refused():
    result = CliRunner().invoke(cli, ["nosuch"])
    assert result.exit_code == 2 and "No such command" in result.output


def test_a_reader_that_went_away_is_no_error():
    # `vmmgr migrate policies | head -1`: the pipe closes before the CLI's last flush.
    proc = subprocess.Popen([sys.executable, "-c", "from vmmgr.cli import main; main()",
                             "migrate", "policies"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # before it writes: its writes and its flush meet a closed pipe
    err = proc.stderr.read().decode()
    # click answers a broken pipe with exit code 1; nothing is printed about it.
    assert proc.wait(timeout=30) == 1
    assert "Traceback" not in err and "Exception ignored" not in err, err
