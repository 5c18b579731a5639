"""`vmmgr user tokens` and `vmmgr user revoke-token`: one token revoked, the others kept."""

from click.testing import CliRunner

from vmmgr import users as users_mod
from vmmgr.cli import cli
from vmmgr.errors import InvalidRequest, NotFound
from vmmgr.users import Users


def test_tokens_are_listed_and_one_is_revoked(tmp_path, monkeypatch):
    monkeypatch.setitem(users_mod.SCRYPT, "n", 2**10)
    users = Users(tmp_path / "users.json")
    users.add("ann", "a long password", "operator")
    ci, laptop = users.new_token("ann", "ci"), users.new_token("ann", "laptop")
    run = CliRunner()
    listed = run.invoke(cli, ["--home", str(tmp_path), "user", "tokens", "ann"])
    assert listed.exit_code == 0 and "ci" in listed.output and "laptop" in listed.output
    assert users.token_id(ci) in listed.output and ci not in listed.output  # never the token
    done = run.invoke(cli, ["--home", str(tmp_path), "user", "revoke-token", "ann",
                            users.token_id(ci)])
    assert done.exit_code == 0, done.output
    assert users.by_token(ci) is None and users.by_token(laptop).name == "ann"
    gone = run.invoke(cli, ["--home", str(tmp_path), "user", "revoke-token", "ann",
                            users.token_id(ci)])
    assert isinstance(gone.exception, NotFound) and "no token" in str(gone.exception)
    short = run.invoke(cli, ["--home", str(tmp_path), "user", "revoke-token", "ann", "ab"])
    assert isinstance(short.exception, InvalidRequest)
