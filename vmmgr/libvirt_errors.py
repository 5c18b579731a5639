"""The one boundary where libvirt's errors become vmmgr's.

Only names from the libvirt module are compared, never numbers, so a fake libvirt with other
codes cannot hide a mistake here.
"""

from contextlib import contextmanager

import libvirt

from .errors import Conflict, HostUnreachable, JobAborted, NotFound, VmmgrError

_NOT_FOUND = {"VIR_ERR_NO_DOMAIN"}
_CONFLICT = {"VIR_ERR_OPERATION_INVALID", "VIR_ERR_DOM_EXIST", "VIR_ERR_OPERATION_UNSUPPORTED"}
_ABORTED = {"VIR_ERR_OPERATION_ABORTED"}
_UNREACHABLE = {"VIR_ERR_NO_CONNECT", "VIR_ERR_INVALID_CONN", "VIR_ERR_RPC", "VIR_ERR_AUTH_FAILED"}


def _code_names(names: set[str]) -> set[int]:
    return {getattr(libvirt, n) for n in names if hasattr(libvirt, n)}


def translate(err: libvirt.libvirtError, what: str) -> VmmgrError:
    code = err.get_error_code()
    detail = err.get_error_message() or str(err)
    message = f"{what}: {detail}"
    if code in _code_names(_NOT_FOUND):
        kind = NotFound
    elif code in _code_names(_ABORTED):
        kind = JobAborted
    elif code in _code_names(_CONFLICT):
        kind = Conflict
    elif code in _code_names(_UNREACHABLE) or (
        # a socket error, or the keepalive giving up on a silent peer ("connection closed due
        # to keepalive timeout", then "client socket is closed"): both internal errors of RPC
        code in (libvirt.VIR_ERR_SYSTEM_ERROR, libvirt.VIR_ERR_INTERNAL_ERROR)
        and err.get_error_domain() == libvirt.VIR_FROM_RPC
    ):
        kind = HostUnreachable
    else:
        kind = VmmgrError
    translated_err = kind(message)
    translated_err.detail = detail
    return translated_err


@contextmanager
def translated(what: str):
    try:
        yield
    except libvirt.libvirtError as err:
        raise translate(err, what) from err


# libvirt prints every error to stderr by default; we report them ourselves.
libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
