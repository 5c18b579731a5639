"""Errors as the console and the API show them: stable codes for the API, flashes for pages."""

import redis
from flask import Flask, jsonify, render_template, request
from werkzeug.exceptions import HTTPException

from vmmgr.errors import (Conflict, HostUnreachable, InvalidRequest, MigrationFailed, NotFound,
                          VmmgrError)

from . import redact

# (HTTP status, stable code) per kind of failure; the most specific class first.
CODES = [
    (InvalidRequest, 400, "invalid_request"),
    (NotFound, 404, "not_found"),
    (Conflict, 409, "conflict"),
    (HostUnreachable, 503, "host_unreachable"),
    (MigrationFailed, 502, "migration_failed"),
    (VmmgrError, 502, "operation_failed"),
]
HTTP_CODES = {400: "invalid_request", 401: "unauthenticated", 403: "forbidden", 404: "not_found",
              405: "method_not_allowed", 409: "conflict", 413: "invalid_request",
              415: "invalid_request"}


class Unauthenticated(VmmgrError):
    pass


class Forbidden(VmmgrError):
    pass


class BrokerMissing(VmmgrError):
    """No task broker is configured: the console can show the hosts, not act or show records."""


def classify(err: Exception) -> tuple[int, str]:
    if isinstance(err, Unauthenticated):
        return 401, "unauthenticated"
    if isinstance(err, Forbidden):
        return 403, "forbidden"
    if isinstance(err, BrokerMissing):
        return 503, "broker_unavailable"
    for cls, status, code in CODES:
        if isinstance(err, cls):
            return status, code
    return 500, "internal"


def error_body(status: int, code: str, message: str):
    return jsonify({"error": {"code": code, "message": message}}), status


def _is_api() -> bool:
    return request.path.startswith("/api/") or request.path == "/metrics"


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(VmmgrError)
    def vmmgr_error(err: VmmgrError):
        status, code = classify(err)
        message = redact.text(str(err))  # a viewer sees no host URI in an error either
        if not _is_api():
            return render_template("error.html", status=status, message=message), status
        return error_body(status, code, message)

    @app.errorhandler(redis.RedisError)
    def broker_down(err):
        message = redact.text(f"the task broker does not answer: {err}")
        if not _is_api():
            return render_template("error.html", status=503, message=message), 503
        return error_body(503, "broker_unavailable", message)

    @app.errorhandler(HTTPException)
    def http_error(err: HTTPException):
        if not _is_api():
            return err
        body, status = error_body(err.code, HTTP_CODES.get(err.code, "http_error"), err.description)
        # Keep the exception's own headers (a 405's Allow) but not its HTML content type.
        body.headers.extend((k, v) for k, v in err.get_headers() if k.lower() != "content-type")
        return body, status
