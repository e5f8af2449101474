"""The nvmeof exception hierarchy, rooted at :class:`NvmeofError`.

Every module of the package raises only these. ``ConfigError`` is bad input (a JSON
file, a TOML spec, a secret); ``ApplyError`` is a failed change to a configfs tree
and carries every failure seen. Host-side code adds its own subclass (``HostError``)
next to these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class NvmeofError(Exception):
    """Root of every error raised by the nvmeof package."""


class ConfigError(NvmeofError):
    """A configuration (nvmetcli JSON, TOML spec, DH-HMAC-CHAP secret) is malformed or
    inconsistent. The message names the offending object and what was expected; it
    never contains secret key material."""


@dataclass(frozen=True)
class ApplyFailure:
    """One failed configfs operation.

    ``path`` is the file, directory or link acted on; ``value`` what was written (or
    the link target; ``None`` for mkdir/rmdir/unlink); ``error`` the errno text or the
    tool's message. Secrets written to ``dhchap_*`` files are shown as ``"<secret>"``.
    """

    path: str
    value: str | None
    error: str

    def __str__(self) -> str:
        shown = "" if self.value is None else " = %r" % self.value
        return "%s%s: %s" % (self.path, shown, self.error)


class ApplyError(NvmeofError):
    """Applying, tearing down or reading back a target configuration failed.

    ``failures`` lists every failed operation (at least one). When raised by an
    aborting apply, what that call had created has already been rolled back.
    """

    def __init__(self, message: str, failures: Sequence[ApplyFailure]) -> None:
        self.failures: tuple[ApplyFailure, ...] = tuple(failures)
        detail = "; ".join(str(f) for f in self.failures[:3])
        more = " (+%d more)" % (len(self.failures) - 3) if len(self.failures) > 3 else ""
        super().__init__("%s: %s%s" % (message, detail, more) if detail else message)
