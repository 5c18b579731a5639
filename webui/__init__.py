"""The web console and REST API: a Flask app factory over `vmmgr` (data) and `tasks` (actions).

Lab: `vmmgr web`. Production: `gunicorn -k gthread --threads 32 -b 0.0.0.0:8080 'webui:create_app()'`
(threads, because live progress and consoles are long-lived server-sent event streams).
"""

import os
import secrets

from flask import Flask

from vmmgr.paths import Paths, default_paths

from . import api, auth, pages
from .errors import register_error_handlers
from .fastjson import OrjsonProvider


def create_app(paths: Paths | None = None, **config) -> Flask:
    app = Flask(__name__)
    app.json = OrjsonProvider(app)
    paths = paths or default_paths()
    app.config.update(
        VMMGR_PATHS=paths,
        SECRET_KEY=os.environ.get("VMMGR_WEB_SECRET") or _secret_key(paths),
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        WTF_CSRF_TIME_LIMIT=None,  # a token lives as long as the session
        SSE_MAX_SECONDS=900,  # a stream ends after this; the browser's EventSource reconnects
    )
    app.config.update(config)
    auth.init_app(app)
    app.register_blueprint(auth.bp)
    app.register_blueprint(pages.bp)
    app.register_blueprint(api.bp)
    auth.csrf.exempt(api.bp)  # the REST API authenticates by bearer token, never by cookie
    register_error_handlers(app)
    return app


def _secret_key(paths: Paths) -> str:
    """A per-installation key, made on first start (0600): sessions survive restarts."""
    try:
        return paths.web_secret.read_text().strip()
    except FileNotFoundError:
        pass
    paths.home.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(32)
    try:
        fd = os.open(paths.web_secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another worker made it first
        return paths.web_secret.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return key
