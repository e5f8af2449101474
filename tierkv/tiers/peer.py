"""The peer-DRAM tier: slots that live in another node's DRAM tier, reached over the network.

The other node runs a :class:`tierkv.net.PeerServer` over its
:class:`~tierkv.tiers.dram.DramTier`; this tier holds a :class:`tierkv.net.Transport` to it
(RDMA READ/WRITE where available, else the TCP fallback) and leases the remote slots
``base_slot .. base_slot + num_slots - 1`` as its own slots ``0 .. num_slots - 1``.
Allocation is local (the lease is this tier's alone); bytes move by remote slot index.

Every write carries a fresh generation (a nanosecond clock, strictly increasing per
tier) so a resent or reordered write cannot overwrite a newer page, and the tier keeps
the meta of its last stored write per slot: a read returns a page only when the peer's
bytes hash to exactly that meta. A page the peer lost (restarted, overwritten), a torn
or partial transfer, or a peer that does not answer within ``NetConfig.timeout_s`` is a
miss: ``read`` raises :class:`~tierkv.errors.TierIOError` (``TierUnavailableError`` when
the peer is unreachable), and :meth:`PeerDramTier.fetch` returns the per-page result
instead. Nothing here blocks past the transport's deadline.

Besides the Tier interface, :meth:`lookup` asks the peer which of a list of page keys it
holds (its own published pages), and :meth:`fetch_remote` reads those by their remote
slots. Its kind is :attr:`TierKind.PEER`, not DRAM: it is another node's memory, and the
store never places pages in it. Used by :mod:`tierkv.store.peering` (a store's ``[peers]
fetch``: ``lookup`` then ``fetch_remote``) and by the conformance suite (``tests/tiers``),
which puts its whole Tier interface through the same tests as every other tier.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol, TypeVar

import numpy as np

from tierkv.errors import InputError, TierIOError, TierUnavailableError
from tierkv.net import NetConfig, PeerServer, TransportKind, connect
from tierkv.net.transport import ReadResult, Transport
from tierkv.net.wire import MAX_LOOKUP_KEYS, PageMeta, WriteStatus, decode_metas, encode_keys, pages_per_message
from tierkv.tiers.base import Tier, TierKind

_GRACE_S = 2.0  # beyond the transport's own deadline, which always resolves its futures
T = TypeVar("T")


class Closeable(Protocol):
    def close(self) -> None: ...


class PeerDramTier(Tier):
    """``num_slots`` slots of the peer's DRAM tier from ``base_slot`` on (default: all of
    them). Closing the tier closes ``transport`` when ``owns_transport``, then each of
    ``also_close`` (a loopback server, say). Thread-safe as the Tier contract requires;
    operations spread over ``channels`` of the transport's mux."""

    kind = TierKind.PEER
    persistent = False

    def __init__(self, transport: Transport, num_slots: int | None = None, base_slot: int = 0,
                 owns_transport: bool = True, channels: int = 8, also_close: Sequence[Closeable] = (),
                 name: str | None = None) -> None:
        info = transport.info
        n = info.num_slots - base_slot if num_slots is None else num_slots
        if base_slot < 0 or n < 0 or base_slot + n > info.num_slots:
            raise InputError(f"peer slots [{base_slot}, {base_slot + n}) do not fit the peer's {info.num_slots}")
        super().__init__(n, info.slot_bytes, name=name)
        self.transport = transport
        self.base_slot = base_slot
        self._owns = owns_transport
        self._also_close = tuple(also_close)
        self._expect: dict[int, PageMeta] = {}
        self._lock = threading.Lock()
        self._last_gen = 0
        self._channels = itertools.cycle(range(max(1, channels)))
        config = getattr(transport, "config", None)
        self._timeout_s: float = getattr(config, "timeout_s", 5.0)
        # A batch one message cannot carry goes out as parts, each with its own deadline.
        self._per_message = pages_per_message(info.slot_bytes)

    @property
    def available(self) -> bool:
        return not self._closed and bool(getattr(self.transport, "connected", True))

    # -- beyond the Tier interface ------------------------------------------------------
    def fetch(self, slots: Sequence[int], dst: np.ndarray) -> ReadResult:
        """Like ``read`` but per page: rows of ok pages are filled, the rest are misses."""
        self._check_io(slots, dst)
        self._check_writable(dst)
        return self._fetch(slots, dst)

    def lookup(self, keys: Sequence[bytes]) -> list[PageMeta | None]:
        """Which of ``keys`` the peer holds (its published pages): their remote metas, or None."""
        self._check_open()
        out: list[PageMeta | None] = []
        for at in range(0, len(keys), MAX_LOOKUP_KEYS):  # the most one lookup may carry
            part = keys[at:at + MAX_LOOKUP_KEYS]
            res = self._wait(self.transport.call("lookup", encode_keys(part), next(self._channels)))
            if not res.ok:
                raise TierUnavailableError(f"peer lookup of {len(part)} keys failed: {res.error}")
            metas = decode_metas(res.body)
            if len(metas) != len(part):
                raise TierUnavailableError(f"peer answered a lookup of {len(part)} keys with {len(metas)} metas")
            out.extend(m if m.generation else None for m in metas)
        return out

    def fetch_remote(self, metas: Sequence[PageMeta], dst: np.ndarray,
                     keys: Sequence[bytes] | None = None) -> ReadResult:
        """Read pages the peer published (found by :meth:`lookup`) by their remote slots;
        a page whose generation or checksum changed since the lookup is a miss. ``keys``:
        the pages' keys, which a peer serving a store requires the read to name."""
        self._check_open()
        return self._wait(self.transport.read([m.slot for m in metas], dst, list(metas), next(self._channels),
                                               keys),
                          len(metas))

    # -- the Tier interface -------------------------------------------------------------
    def _write(self, slots: Sequence[int], src: np.ndarray) -> None:
        gens = self._generations(len(slots))
        with self._lock:  # a failed write leaves no expectation: the slot reads as a miss
            for s in slots:
                self._expect.pop(s, None)
        res = self._wait(self.transport.write([self.base_slot + s for s in slots], gens, src, next(self._channels)),
                         len(slots))
        failed = 0
        with self._lock:
            for s, st, m in zip(slots, res.statuses, res.metas or [None] * len(slots)):
                if st in (WriteStatus.STORED, WriteStatus.DUPLICATE) and m is not None:
                    old = self._expect.get(s)
                    if old is None or old.generation < m.generation:
                        self._expect[s] = m
                elif st != WriteStatus.STALE:  # STALE: a newer write of this slot already landed
                    failed += 1
        if failed:
            cls = TierUnavailableError if res.error else TierIOError
            raise cls(f"peer write: {failed} of {len(slots)} pages not stored ({res.error or 'refused'})")

    def _read(self, slots: Sequence[int], dst: np.ndarray) -> None:
        res = self._fetch(slots, dst)
        if not res.all_ok:
            cls = TierUnavailableError if not self.available else TierIOError
            raise cls(f"peer read: {res.misses} of {len(slots)} pages missed ({res.error})")

    def _fetch(self, slots: Sequence[int], dst: np.ndarray) -> ReadResult:
        with self._lock:
            expect = [self._expect.get(s) for s in slots]
        remote = [self.base_slot + s for s in slots]
        # A slot this tier never wrote has nothing to expect: its read is a miss by design.
        res = self._wait(self.transport.read(remote, dst, expect, next(self._channels)), len(slots))
        if any(e is None for e in expect):
            ok = tuple(o and e is not None for o, e in zip(res.ok, expect))
            res = ReadResult(ok, res.metas, res.error or "slot never written through this tier")
        return res

    def _generations(self, n: int) -> list[int]:
        with self._lock:
            first = max(self._last_gen + 1, time.time_ns())
            self._last_gen = first + n - 1
        return list(range(first, first + n))

    def _wait(self, fut: Future[T], pages: int = 1) -> T:
        """The result of a transfer of ``pages`` pages. The transport resolves each part of
        it within its own deadline; past all of them and a grace, give up, but only once no
        part is in flight, so nothing lands in the caller's buffer after this returns."""
        parts = max(1, -(-pages // self._per_message))
        limit = parts * self._timeout_s + _GRACE_S
        try:
            return fut.result(timeout=limit)
        except TimeoutError:
            fut.cancel()
            settled = getattr(fut, "settled", None)  # a split batch (tierkv.net.split)
            if settled is not None and not settled.wait(self._timeout_s + _GRACE_S):
                raise TierUnavailableError(f"peer transfer of {pages} pages unresolved after {limit:.1f} s "
                                           "and a part still in flight") from None
            raise TierUnavailableError(f"peer transfer of {pages} pages unresolved after {limit:.1f} s") from None

    def _close(self) -> None:
        if self._owns:
            self.transport.close()
        for c in self._also_close:
            c.close()


def loopback_peer_tier(num_slots: int, page_bytes: int, config: NetConfig | None = None,
                       kind: TransportKind = "tcp", host: str = "127.0.0.1") -> PeerDramTier:
    """A peer tier over a :class:`~tierkv.net.PeerServer` of a fresh DRAM tier in this
    process on ``host`` (any free port); closing the tier stops the server. For tests
    and benchmarks."""
    from tierkv.tiers.dram import DramTier

    dram = DramTier(num_slots, page_bytes)
    server = PeerServer(dram, host, 0, config, rdma=kind == "rdma")
    try:
        transport = connect(host, server.address[1], kind, config)
    except BaseException:
        server.close()
        dram.close()
        raise
    return PeerDramTier(transport, also_close=(server, dram))
