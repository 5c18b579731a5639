"""`vmmgr user ...` (the web console's users and API tokens) and `vmmgr web` (the console)."""

import time

import click

from .. import display
from ..paths import Paths
from ..users import ROLES, Users
from .base import audit_cli, cli


@cli.group()
def user() -> None:
    """Web console users and their API tokens."""


@user.command("add")
@click.argument("name")
@click.option("--role", type=click.Choice(ROLES), default="viewer", show_default=True)
@click.option("--password", prompt=True, hide_input=True, confirmation_prompt=True,
              envvar="VMMGR_PASSWORD", help="Prompted for when not given (or $VMMGR_PASSWORD).")
@click.option("--replace", is_flag=True, help="Overwrite an existing user's password and role; "
              "this ends every session and API token the user had.")
@click.pass_obj
def user_add(paths: Paths, name: str, role: str, password: str, replace: bool) -> None:
    """Add a user (e.g. the first admin: `vmmgr user add admin --role admin`)."""
    u = Users(paths.users).add(name, password, role, replace=replace)
    audit_cli(paths, "user add", name, "ok", {"role": role, "replace": replace})
    click.echo(f"user {u.name} ({u.role}) saved")


@user.command("list")
@click.pass_obj
def user_list(paths: Paths) -> None:
    click.echo(display.table(["user", "role"], [[u.name, u.role] for u in
                                                Users(paths.users).list()]))


@user.command("remove")
@click.argument("name")
@click.pass_obj
def user_remove(paths: Paths, name: str) -> None:
    Users(paths.users).remove(name)
    audit_cli(paths, "user remove", name, "ok")
    click.echo(f"user {name} removed")


@user.command("token")
@click.argument("name")
@click.option("--label", default="api", show_default=True)
@click.pass_obj
def user_token(paths: Paths, name: str, label: str) -> None:
    """Issue an API token for NAME (REST: `Authorization: Bearer <token>`); shown only once."""
    users = Users(paths.users)
    token = users.new_token(name, label)
    audit_cli(paths, "user token", name, "ok", {"label": label, "token": users.token_id(token)})
    click.echo(token)


@user.command("tokens")
@click.argument("name")
@click.pass_obj
def user_tokens(paths: Paths, name: str) -> None:
    """List NAME's API tokens (their ids and labels; the tokens themselves are never kept)."""
    def made(t):
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(t["created"])) if t["created"] else "-"
    rows = [[t["id"], t["label"], made(t)] for t in Users(paths.users).tokens(name)]
    click.echo(display.table(["id", "label", "created"], rows))


@user.command("revoke-token")
@click.argument("name")
@click.argument("token_id")
@click.pass_obj
def user_revoke_token(paths: Paths, name: str, token_id: str) -> None:
    """Revoke one of NAME's API tokens by its id (`vmmgr user tokens NAME`); the others work on."""
    Users(paths.users).revoke_token(name, token_id)
    audit_cli(paths, "user revoke-token", name, "ok", {"token": token_id})
    click.echo(f"token {token_id} of {name} revoked")


@cli.command()
@click.option("--bind", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True)
@click.pass_obj
def web(paths: Paths, bind: str, port: int) -> None:
    """Serve the web console over plain HTTP (lab and development; production: gunicorn behind
    TLS, see README)."""
    from webui import create_app

    # Plain HTTP: a Secure session cookie would never come back.
    create_app(paths, SESSION_COOKIE_SECURE=False).run(host=bind, port=port, threaded=True)
