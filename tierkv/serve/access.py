"""Which tenants a connection to the node service may use: by the peer's user, as the
kernel reports it (``SO_PEERCRED``), never by anything the client says.

``[serve] tenants`` maps users (names or uids) to tenant names ("" the default tenant,
"*" all). With no map every connection may use every tenant, as every caller of an
in-process store may. The daemon's tiers are never mapped by a client, so a tenant's
pages reach a client only through the calls checked here.
"""

from __future__ import annotations

import pwd
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from tierkv.errors import AccessDeniedError, ConfigError
from tierkv.keys import tenant_salt

_UCRED = struct.Struct("3i")   # pid, uid, gid


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid, gid


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@dataclass(frozen=True)
class Grant:
    """What one connection may use: ``salts`` None is every tenant."""

    pid: int
    uid: int
    salts: frozenset[bytes] | None

    def check(self, salt: bytes) -> None:
        if self.salts is not None and salt not in self.salts:
            shown = salt.decode(errors="backslashreplace")
            raise AccessDeniedError(f"user {_user_name(self.uid)} (uid {self.uid}) may not use tenant {shown!r} of "
                                    "this store ([serve] tenants)")


class Access:
    """The ``[serve] tenants`` map, with user names resolved to uids at start."""

    def __init__(self, tenants: Mapping[str, tuple[str, ...]]) -> None:
        self._by_uid: dict[int, frozenset[bytes] | None] = {}
        for user, names in tenants.items():
            if user.isdigit():
                uid = int(user)
            else:
                try:
                    uid = pwd.getpwnam(user).pw_uid
                except KeyError:
                    raise ConfigError(f"serve.tenants names user {user!r}, which this system does not have") from None
            if uid in self._by_uid:
                raise ConfigError(f"serve.tenants names uid {uid} twice (as {user!r} and before)")
            self._by_uid[uid] = None if "*" in names else frozenset(tenant_salt(n) for n in names)
        self.open = not tenants

    def grant(self, conn: socket.socket) -> Grant:
        """The connection's grant; AccessDeniedError for a user the map does not name."""
        pid, uid, _gid = peer_credentials(conn)
        if self.open:
            return Grant(pid, uid, None)
        if uid not in self._by_uid:
            raise AccessDeniedError(f"user {_user_name(uid)} (uid {uid}) may use no tenant of this store; "
                                    "[serve] tenants names the users that may")
        return Grant(pid, uid, self._by_uid[uid])
