"""The one boundary where libvirt's errors become vmmgr's.

Only names from the libvirt module are compared, never numbers, so a fake libvirt with other
codes cannot hide a mistake here.
"""

from contextlib import contextmanager

import libvirt

from .errors import Conflict, HostUnreachable, NotFound, VmmgrError

_NOT_FOUND = {"VIR_ERR_NO_DOMAIN"}
_CONFLICT = {"VIR_ERR_OPERATION_INVALID", "VIR_ERR_DOM_EXIST", "VIR_ERR_OPERATION_UNSUPPORTED"}
_UNREACHABLE = {"VIR_ERR_NO_CONNECT", "VIR_ERR_INVALID_CONN", "VIR_ERR_RPC", "VIR_ERR_AUTH_FAILED"}


def _code_names(names: set[str]) -> set[int]:
    return {getattr(libvirt, n) for n in names if hasattr(libvirt, n)}


def translate(err: libvirt.libvirtError, what: str) -> VmmgrError:
    code = err.get_error_code()
    message = f"{what}: {err.get_error_message() or err}"
    if code in _code_names(_NOT_FOUND):
        return NotFound(message)
    if code in _code_names(_CONFLICT):
        return Conflict(message)
    if code in _code_names(_UNREACHABLE) or (
        code == libvirt.VIR_ERR_SYSTEM_ERROR and err.get_error_domain() == libvirt.VIR_FROM_RPC
    ):
        return HostUnreachable(message)
    return VmmgrError(message)


@contextmanager
def translated(what: str):
    try:
        yield
    except libvirt.libvirtError as err:
        raise translate(err, what) from err


# libvirt prints every error to stderr by default; we report them ourselves.
libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
