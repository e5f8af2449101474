"""The transport interface: what a node uses to move pages to and from a peer's DRAM tier.

A :class:`Transport` is the client side of one peer. It is NIXL-shaped: the peer's slot
buffer is described once at connect (its geometry, and on RDMA its address and rkey),
then pages move by remote slot index. Every operation returns a future whose
``result(timeout)`` is a frozen result, not an exception: a transport failure (peer lost,
deadline passed, a page whose bytes do not match its checksum or generation) is a
*failed result*, whose pages are misses. Only bad input and use after ``close`` raise.
Futures always resolve within ``NetConfig.timeout_s`` of being issued.

Implementations: :class:`tierkv.net.tcp.TcpTransport` (plain sockets, everywhere) and
:class:`tierkv.net.rdma.RdmaTransport` (pyverbs RC QPs). :func:`tierkv.net.connect` picks.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Self

import numpy as np

from tierkv.net.auth import Credential
from tierkv.net.wire import PageMeta, WriteStatus


@dataclass(frozen=True)
class NetConfig:
    """Knobs of both transports (units in the names).

    ``links`` connections (QPs) per peer carry all channels; ``recv_credits`` receives the
    server posts per connection (and so the credits it grants); ``window`` requests in
    flight per connection; ``credits=False`` turns the credit gate off (the benchmark's
    baseline: the server then NAKs overruns and the client retries after
    ``rnr_delay_s``, as an RDMA NIC does on RNR). ``pool_bytes``: the client's registered
    buffer; ``staging_bytes``: the RDMA server's registered pool that pushes land in
    before they are checked and copied into their slots."""

    timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    links: int = 2
    recv_credits: int = 16
    window: int = 32
    credits: bool = True
    rnr_delay_s: float = 0.001
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 1.0
    pool_bytes: int = 64 << 20
    staging_bytes: int = 64 << 20
    credential: Credential | None = None


@dataclass(frozen=True)
class PeerInfo:
    """What the handshake told: the server's epoch (a new one after a restart) and geometry."""

    epoch: int
    num_slots: int
    slot_bytes: int


@dataclass(frozen=True)
class ReadResult:
    """Per page: whether it arrived whole and as expected (``ok``), and what the peer said
    it holds (``metas``; generation 0 for a miss). ``error`` says why pages are missing."""

    ok: tuple[bool, ...]
    metas: tuple[PageMeta, ...]
    error: str | None = None

    @property
    def all_ok(self) -> bool:
        return all(self.ok)

    @property
    def misses(self) -> int:
        return sum(1 for x in self.ok if not x)


@dataclass(frozen=True)
class WriteResult:
    """Per page: what the peer did with it, and the meta it was sent with (what a later
    read should find)."""

    statuses: tuple[WriteStatus, ...]
    metas: tuple[PageMeta, ...] = ()
    error: str | None = None

    @property
    def all_stored(self) -> bool:
        return all(s in (WriteStatus.STORED, WriteStatus.DUPLICATE) for s in self.statuses)


@dataclass(frozen=True)
class CallResult:
    ok: bool
    body: bytes
    error: str | None = None


@dataclass(frozen=True)
class LinkStats:
    """Counters of one connection (QP): messages sent, resent after reconnects, NAKed by
    the receiver (RNR), expired, reconnects, how often the sender waited for credits, and
    replies that did not add up (their requests failed; TCP only)."""

    sent: int
    resent: int
    naks: int
    expired: int
    reconnects: int
    credit_waits: int
    bad_replies: int = 0


class Transport(abc.ABC):
    info: PeerInfo

    @abc.abstractmethod
    def read(self, slots: Sequence[int], dst: np.ndarray, expect: Sequence[PageMeta | None] | None = None,
             channel: int = 0, keys: Sequence[bytes] | None = None) -> Future[ReadResult]:
        """Fetch remote ``slots`` into the rows of ``dst`` (the first ``dst.shape[1]`` bytes of
        each page). A page is ok when its bytes hash to its meta and, where ``expect`` is
        given, its generation and checksum equal the expected ones. Rows of missed pages
        are left in an unspecified state (never a mix the caller could take for a page).
        ``keys``: the page key each slot should hold; a server that serves a store answers
        only reads that name them (over TCP; an RDMA read is one-sided, authorized by the
        connection, and does not send them)."""

    @abc.abstractmethod
    def write(self, slots: Sequence[int], generations: Sequence[int], src: np.ndarray,
              channel: int = 0) -> Future[WriteResult]:
        """Store row ``i`` of ``src`` in remote slot ``slots[i]`` as generation
        ``generations[i]`` (> 0). Idempotent: the same (slot, generation) twice stores once;
        an older generation than the stored one is ignored (STALE)."""

    @abc.abstractmethod
    def call(self, method: str, body: bytes, channel: int = 0) -> Future[CallResult]:
        """A control RPC to the peer's handler (``lookup``, ``rdma-info`` ...)."""

    @abc.abstractmethod
    def stats(self) -> list[LinkStats]: ...

    @abc.abstractmethod
    def wait_connected(self, timeout_s: float) -> bool:
        """Wait until the transport is connected again after losing its peer; False on timeout."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
