"""Who is asking: sessions (with CSRF-protected forms) for pages, bearer tokens for the REST API,
and the role each route needs (viewer < operator < admin; a viewer cannot act).

A session names its login's id, kept in the users file: logging out ends it everywhere (a copy
of the cookie is no use), and a new password ends them all. Failed logins are limited per
address and per name."""

from functools import wraps
from urllib.parse import urlsplit

from flask import (Blueprint, abort, current_app, flash, g, redirect, render_template, request,
                   url_for)
from flask_login import LoginManager, UserMixin, current_user, login_user, logout_user
from flask_wtf.csrf import CSRFProtect

from vmmgr import audit
from vmmgr.state import FleetState
from vmmgr.users import User, Users

from . import limits
from .errors import Forbidden, Unauthenticated

bp = Blueprint("auth", __name__)
csrf = CSRFProtect()
login_manager = LoginManager()
login_manager.login_view = "auth.login"
login_manager.login_message = "Log in to see the fleet."


class SessionUser(UserMixin):
    def __init__(self, user: User, sid: str):
        self.user, self.sid = user, sid
        self.id = f"{user.name}:{sid}"  # what the session cookie carries


def users() -> Users:
    return Users(current_app.config["VMMGR_PATHS"].users)


@login_manager.user_loader
def _load(session_id: str) -> SessionUser | None:
    # A removed user's, a logged-out or a replaced password's session ends at the next request.
    name, _, sid = session_id.partition(":")
    user = users().by_session(name, sid) if sid else None
    return SessionUser(user, sid) if user else None


def init_app(app) -> None:
    csrf.init_app(app)
    login_manager.init_app(app)

    @app.context_processor
    def _who():
        user = current_user.user if current_user.is_authenticated else None
        return {"me": user}


def page_role(role: str):
    """A page for logged-in users with at least `role`."""
    def wrap(view):
        @wraps(view)
        def inner(*args, **kwargs):
            if not current_user.is_authenticated:
                return login_manager.unauthorized()
            if not current_user.user.can(role):
                abort(403, f"this needs the {role} role; you are {current_user.user.role}")
            g.user = current_user.user
            return view(*args, **kwargs)
        return inner
    return wrap


def api_role(role: str):
    """An API route for a bearer token whose user has at least `role`."""
    def wrap(view):
        @wraps(view)
        def inner(*args, **kwargs):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            token = token.strip()
            user = users().by_token(token) if scheme.lower() == "bearer" and token else None
            if user is None:
                raise Unauthenticated("a valid API token is needed: Authorization: Bearer <token>")
            if not user.can(role):
                raise Forbidden(f"this needs the {role} role; the token's user is {user.role}")
            g.user, g.token_id = user, users().token_id(token)
            return view(*args, **kwargs)
        return inner
    return wrap


@bp.route("/login", methods=["GET", "POST"])
def login():
    if request.method == "POST":
        name, address = request.form.get("name", ""), request.remote_addr or ""
        wait = limits.attempt(address, name)
        if wait:
            _audit_login(name, address, "refused: too many attempts")
            flash(f"Too many login attempts: try again in {wait} s.", "error")
            return render_template("login.html"), 429, {"Retry-After": str(wait)}
        user = users().authenticate(name, request.form.get("password", ""))
        _audit_login(name, address, "ok" if user else "refused: wrong name or password")
        if user is None:
            flash("Wrong name or password.", "error")
            return render_template("login.html"), 401
        limits.succeeded(address, name)
        login_user(SessionUser(user, users().open_session(user.name)))
        return redirect(_safe_next(request.args.get("next")))
    return render_template("login.html")


def _audit_login(name: str, address: str, outcome: str) -> None:
    url = current_app.config["VMMGR_PATHS"].redis_url()
    if url:
        audit.record(FleetState(url).r, {"who": name[:64], "via": "web", "client": address},
                     "login", name[:64], outcome=outcome)


@bp.route("/logout", methods=["POST"])
def logout():
    if current_user.is_authenticated:
        users().close_session(current_user.user.name, current_user.sid)
    logout_user()
    return redirect(url_for("auth.login"))


def _safe_next(target: str | None) -> str:
    """Only a path on this site: never an open redirect."""
    if target and target.startswith("/") and not target.startswith("//") \
            and not urlsplit(target).netloc:
        return target
    return url_for("pages.fleet")
