"""Peer authentication: a shared-secret challenge-response per connection, and tenant scopes.

Every connection to a peer server that has credentials proves, both ways, that each
side holds the secret of one *principal* before anything else is answered:

1. client -> server ``HELLO``: its principal's name and a fresh 32-byte nonce;
2. server -> client ``CHALLENGE``: its own nonce and
   ``HMAC-SHA256(secret, "tierkv-peer-server" | principal | client nonce | server nonce)``;
   the client checks it (a server without the secret cannot make it);
3. client -> server ``AUTH``: ``HMAC-SHA256(secret, "tierkv-peer-client" | principal |
   server nonce | client nonce)``; the server checks it and answers ``WELCOME``.

The two MACs are labelled apart, so neither side's answer can be replayed as the other's,
and both nonces are fresh, so no recorded answer is good for another connection. A
principal the server does not know is answered with a challenge under a random secret
(the client then fails to verify it), so a scan does not learn which names exist. What
this gives: only holders of a secret are served. What it does not: the connection is not
encrypted and later frames carry no MAC (their checksums catch damage, not an attacker on
the path); across an untrusted network, run peers over a VPN or IPsec.

A principal is either the cluster's (``tenant`` None: it may read every tenant's pages and
open RDMA one-sided access) or one tenant's (it may look up and read only pages that a
request of that tenant placed; see :func:`tenant_tag`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from tierkv.errors import ConfigError

NONCE_BYTES = 32
MAC_BYTES = 32
MIN_SECRET_BYTES = 16
MAX_PRINCIPAL_BYTES = 255
CLUSTER = ""  # the cluster principal's name
_SERVER_LABEL = b"tierkv-peer-server"
_CLIENT_LABEL = b"tierkv-peer-client"

#: A connection's scope: None for every tenant (the cluster principal), else one tenant's tag.
Scope = int | None
UNKNOWN_TENANT = 0  # the tag of a page whose tenant the server does not know: cluster-only


def tenant_tag(salt: bytes) -> int:
    """The non-zero 64-bit tag a server keeps per served page for the tenant whose request
    placed it (the tenant's salt bytes, as :func:`tierkv.keys.tenant_salt` makes them)."""
    return xxhash.xxh3_64_intdigest(b"tierkv-tenant\0" + salt) | 1


@dataclass(frozen=True)
class Credential:
    """One principal's name and secret (the secret is never shown in ``repr``)."""

    principal: str
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.principal, str) or len(self.principal.encode()) > MAX_PRINCIPAL_BYTES:
            raise ConfigError(f"a peer principal is text of at most {MAX_PRINCIPAL_BYTES} bytes, "
                              f"got {self.principal!r}")
        if not isinstance(self.secret, bytes) or len(self.secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"a peer secret must be at least {MIN_SECRET_BYTES} bytes")


@dataclass(frozen=True)
class ServerAuth:
    """The principals a server accepts: name -> (secret, scope)."""

    principals: dict[str, tuple[bytes, Scope]] = field(repr=False)

    def lookup(self, principal: str) -> tuple[bytes, Scope] | None:
        return self.principals.get(principal)


def load_secret(path: str | os.PathLike[str], what: str) -> bytes:
    """The secret in the file at ``path``: its bytes, surrounding whitespace stripped. The
    file must be a regular file readable by its owner only (mode 0600 or 0400) and hold at
    least 16 bytes; ConfigError naming the file and the fix otherwise."""
    p = Path(path)
    make = (f"make one with: head -c 32 /dev/urandom | base64 > {p} && chmod 600 {p} "
            "(the same file on every node that may read this one's pages)")
    try:
        st = p.stat()
    except OSError as e:
        raise ConfigError(f"{what}: cannot read the secret file {p}: {e.strerror}; {make}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what}: the secret file {p} is not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(f"{what}: the secret file {p} has mode {stat.S_IMODE(st.st_mode):04o}; others may "
                          f"read it: chmod 600 {p}")
    try:
        secret = p.read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"{what}: cannot read the secret file {p}: {e.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{what}: the secret file {p} holds {len(secret)} bytes; at least {MIN_SECRET_BYTES} "
                          f"are needed: {make}")
    return secret


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def server_proof(secret: bytes, principal: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return _mac(secret, _SERVER_LABEL, principal, client_nonce, server_nonce)


def client_proof(secret: bytes, principal: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return _mac(secret, _CLIENT_LABEL, principal, server_nonce, client_nonce)


def same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def _mac(secret: bytes, label: bytes, principal: str, first: bytes, second: bytes) -> bytes:
    name = principal.encode()
    msg = label + len(name).to_bytes(2, "little") + name + first + second
    return hmac.new(secret, msg, hashlib.sha256).digest()
