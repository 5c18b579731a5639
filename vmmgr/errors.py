"""The project's own exceptions.

Callers never see libvirt's error codes: `libvirt_errors.translate` turns them into these at one
boundary. Each class carries the CLI exit code for its kind of failure.
"""


class VmmgrError(Exception):
    """Something went wrong; the message is meant for the operator, on one line."""

    exit_code = 1
    detail = ""  # a hypervisor's own words, where they came from one


class InvalidRequest(VmmgrError):
    """The request itself is malformed (bad name, bad path, impossible size). Nothing was changed."""

    exit_code = 2


class NotFound(VmmgrError):
    """An unknown host or VM."""

    exit_code = 3


class Conflict(VmmgrError):
    """The request is well formed but clashes with the current state (busy VM, no room, exists)."""

    exit_code = 4


class HostUnreachable(VmmgrError):
    """A host's libvirtd did not answer."""

    exit_code = 5


class MigrationFailed(VmmgrError):
    """A migration did not complete. The VM is still running on its source."""

    exit_code = 6


class PostcopyPaused(MigrationFailed):
    """Post-copy broke and could not be resumed: the VM's memory is split between the hosts and
    it is paused on both until the link is back and the same migration is resumed."""

    def __init__(self, message: str, source: str, target: str):
        super().__init__(message)
        self.source, self.target = source, target


class HibernationFailed(MigrationFailed):
    """The guest did not hibernate (its agent did not answer, or it did not power off in time).
    The VM is still running where it was."""


class JobAborted(VmmgrError):
    """A hypervisor job (a migration, a save) was aborted before it completed."""
