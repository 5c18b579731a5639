"""The web console and REST API: a Flask app factory over `vmmgr` (data) and `tasks` (actions).

Lab: `vmmgr web`. Production: `gunicorn -k gthread --threads 32 -b 0.0.0.0:8080 'webui:create_app()'`
(threads, because live progress and consoles are long-lived server-sent event streams).
"""

import os
import secrets
import tempfile

from flask import Flask, request
from werkzeug.middleware.proxy_fix import ProxyFix

from vmmgr.paths import Paths, default_paths

from . import api, auth, metrics, pages
from .errors import register_error_handlers
from .fastjson import OrjsonProvider


def create_app(paths: Paths | None = None, **config) -> Flask:
    app = Flask(__name__)
    app.json = OrjsonProvider(app)
    paths = paths or default_paths()
    app.config.update(
        VMMGR_PATHS=paths,
        SECRET_KEY=_checked(os.environ.get("VMMGR_WEB_SECRET") or None) or _secret_key(paths),
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        # Served behind TLS: the cookie never goes out in clear. `vmmgr web` (plain HTTP, for the
        # lab and development) turns it off; so does VMMGR_WEB_SECURE_COOKIES=0.
        SESSION_COOKIE_SECURE=os.environ.get("VMMGR_WEB_SECURE_COOKIES", "1") != "0",
        MAX_CONTENT_LENGTH=1 << 20,  # every body is a small form or JSON document
        WTF_CSRF_TIME_LIMIT=None,  # a token lives as long as the session
        SSE_MAX_SECONDS=900,  # a stream ends after this; the browser's EventSource reconnects
    )
    app.config.update(config)
    auth.init_app(app)
    app.register_blueprint(auth.bp)
    app.register_blueprint(pages.bp)
    app.register_blueprint(api.bp)
    app.register_blueprint(metrics.bp)
    auth.csrf.exempt(api.bp)  # the REST API authenticates by bearer token, never by cookie
    register_error_handlers(app)
    app.after_request(_security_headers)
    proxies = int(os.environ.get("VMMGR_WEB_PROXIES") or 0)
    if proxies:
        # Behind that many proxies (TLS ends there): the client's address, scheme and host come
        # from their X-Forwarded-* headers; the limiter, the audit trail and HSTS need them.
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=proxies, x_proto=proxies, x_host=proxies)
    return app


MIN_SECRET = 32


def _checked(secret: str | None, where: str = "VMMGR_WEB_SECRET") -> str | None:
    if secret is not None and len(secret) < MIN_SECRET:
        raise RuntimeError(f"{where} is too weak: it signs every session, and needs at "
                           f"least {MIN_SECRET} random characters (e.g. `openssl rand -hex 32`)")
    return secret


def _security_headers(response):
    h = response.headers
    # Scripts only from this site (the console has no inline script); styles may be inline
    # (the capacity bars, xterm.js); never framed (clickjacking).
    h.setdefault("Content-Security-Policy",
                 "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                 "img-src 'self' data:; object-src 'none'; base-uri 'self'; form-action 'self'; "
                 "frame-ancestors 'none'")
    h.setdefault("X-Content-Type-Options", "nosniff")
    h.setdefault("X-Frame-Options", "DENY")
    h.setdefault("Referrer-Policy", "same-origin")
    if request.is_secure:
        h.setdefault("Strict-Transport-Security", "max-age=31536000")
    return response


def _secret_key(paths: Paths) -> str:
    """A per-installation key, made on first start (0600): sessions survive restarts. It is
    written whole to a private file, then linked into place, so a worker starting at the same
    moment reads either nothing or the whole key, never an empty file."""
    try:
        return _checked(paths.web_secret.read_text().strip(), str(paths.web_secret))
    except FileNotFoundError:
        pass
    paths.home.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=paths.home, prefix=".web-secret.")  # 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, paths.web_secret)
        except FileExistsError:  # another worker made it first: theirs is the key
            pass
    finally:
        os.unlink(tmp)
    return _checked(paths.web_secret.read_text().strip(), str(paths.web_secret))
