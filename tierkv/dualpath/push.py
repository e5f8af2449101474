"""DualPath's second path in the store: a helper node reads pages for another node and
pushes them into that node's landing zone.

The node that wants pages (the *requester*, a prefill node) keeps a :class:`Landing`: a
small DRAM buffer of its own served by a peer server that accepts writes from the
cluster's principal only. It reserves landing slots, each with a fresh generation, and
asks a *helper* (a decode node, ``[peers] helper = true``) by a ``push`` call to read a
run of a prompt's pages from the storage it reaches and write them there. The helper
(:class:`Helper`) loads them in chunks from its own tiers and storage peers (never
keeping them: it holds no prefix of theirs) and writes each chunk as it is loaded through
its peer transport, so loading and forwarding overlap: over RDMA, one-sided writes into
the landing server's registered staging (the same credits and send window as every
write), over TCP inline. The landing server checks each page against the checksum the
helper computed as it arrives; the requester then takes a page only where its slot holds
the generation it reserved, and checks its bytes once more as it copies them out. A page
that did not arrive is a miss, which the requester reads itself.

Control (the ``push`` call and its answer) goes over TCP: an RDMA server answers calls
on its progress thread, which a push of many pages must not hold. The answer says how
many leading pages were stored and how many bytes the helper still has queued for
others, which the requester's scheduler counts (:mod:`tierkv.dualpath.loads`).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from tierkv.errors import TierKVError
from tierkv.keys import KEY_BYTES, PageKey
from tierkv.net import NetConfig, PeerServer, connect
from tierkv.net.auth import CLUSTER, ServerAuth
from tierkv.net.transport import Transport, WriteResult
from tierkv.net.wire import EMPTY_GENERATION, ProtocolError, WriteStatus, page_checksum
from tierkv.tiers.aligned import aligned_empty
from tierkv.tiers.dram import DramTier

log = logging.getLogger(__name__)
Endpoint = tuple[str, int]
#: A helper loads and forwards a push in chunks of about this many bytes, so that the
#: write of one chunk overlaps the load of the next.
CHUNK_BYTES = 2 << 20
#: Pushes a helper serves at once; more are answered at once with nothing stored (the
#: requester reads those pages itself), so pushes cannot take every server worker.
MAX_PUSHES = 2
_REQ = struct.Struct("<HHIHIQ")   # landing host length, landing port, pages, salt length, budget in ms, requester
_ANSWER = struct.Struct("<Id")    # leading pages stored, bytes queued at the helper for others
MAX_HOST_BYTES = 255
#: Loads the pages ``chain[start:start + len(rows)]`` into ``rows`` (the requester's
#: tenant ``salt``) unless ``deadline`` (``time.monotonic()``) passes first, waiting for
#: nothing past it: how many leading ones it found.
Loader = Callable[[Sequence[PageKey], int, np.ndarray, bytes, float], int]


@dataclass(frozen=True)
class PushRequest:
    """Push the pages of ``chain[start:]`` into ``slots`` of the landing server at
    ``landing``, as ``generations``, within ``budget_ms`` of its arrival (the requester
    stops waiting then); ``salt``: the requesting tenant's; ``requester``: the asking
    node's id (a node that reaches itself under another address answers at once)."""

    landing: Endpoint
    chain: tuple[PageKey, ...]
    start: int
    slots: tuple[int, ...]
    generations: tuple[int, ...]
    salt: bytes
    budget_ms: int
    requester: int = 0

    def encode(self) -> bytes:
        host = self.landing[0].encode()
        n = len(self.chain)
        return b"".join([_REQ.pack(len(host), self.landing[1], n, len(self.salt), self.budget_ms, self.requester),
                         host, self.salt,
                         struct.pack("<I", self.start), *self.chain,
                         np.asarray(self.slots, "<u4").tobytes(), np.asarray(self.generations, "<u8").tobytes()])

    @classmethod
    def decode(cls, body: bytes) -> PushRequest:
        """The request in ``body``; ProtocolError for anything else."""
        if len(body) < _REQ.size:
            raise ProtocolError(f"a push request of {len(body)} bytes is shorter than its header")
        hl, port, n, sl, budget, requester = _REQ.unpack_from(body)
        at = _REQ.size
        if not 0 < hl <= MAX_HOST_BYTES or not 0 < port:
            raise ProtocolError(f"a push request's landing must be a host of 1-{MAX_HOST_BYTES} bytes and a port "
                                f"of 1-65535, got {hl} bytes and port {port}")
        try:
            host = body[at:at + hl].decode("ascii")
        except UnicodeDecodeError:
            raise ProtocolError("a push request's landing host is not an ASCII name or address") from None
        salt = body[at + hl:at + hl + sl]
        at += hl + sl
        if len(body) < at + 4:
            raise ProtocolError("a push request ends before its start")
        (start,) = struct.unpack_from("<I", body, at)
        at += 4
        if n > 1 << 24 or start > n:
            raise ProtocolError(f"a push request names {n} keys and starts at {start}")
        pages = n - start
        want = at + n * KEY_BYTES + pages * 12
        if len(body) != want:
            raise ProtocolError(f"a push request of {n} keys, {pages} pushed, is {want} bytes, got {len(body)}")
        chain = tuple(PageKey(body[at + i * KEY_BYTES:at + (i + 1) * KEY_BYTES]) for i in range(n))
        at += n * KEY_BYTES
        slots = tuple(np.frombuffer(body, "<u4", pages, at).tolist())
        gens = tuple(np.frombuffer(body, "<u8", pages, at + 4 * pages).tolist())
        if any(g == EMPTY_GENERATION for g in gens):
            raise ProtocolError("a push request names generation 0")
        return cls((host, port), chain, start, slots, gens, salt, budget, requester)


def encode_answer(stored: int, queued_bytes: float) -> bytes:
    return _ANSWER.pack(stored, queued_bytes)


def decode_answer(body: bytes) -> tuple[int, float]:
    if len(body) != _ANSWER.size:
        raise ProtocolError(f"a push answer is {_ANSWER.size} bytes, got {len(body)}")
    stored, queued = _ANSWER.unpack(body)
    return int(stored), float(queued)


class Landing:
    """Where helpers push pages for this node: ``pages`` slots of ``page_bytes`` served at
    ``host:port`` to the cluster's principal (``secret``), writable by it."""

    def __init__(self, host: str, port: int, pages: int, page_bytes: int, net: NetConfig, secret: bytes,
                 rdma: bool) -> None:
        self.tier = DramTier(pages, page_bytes, name="landing")
        self.server = PeerServer(self.tier, host, port, net, rdma=rdma, accept_writes=True,
                                 auth=ServerAuth({CLUSTER: (secret, None)}))
        self.address: Endpoint = (host, self.server.address[1])
        self.page_bytes = page_bytes
        self._lock = threading.Lock()
        self._free = list(range(pages - 1, -1, -1))
        self._last_gen = 0

    def take(self, n: int) -> tuple[list[int], list[int]]:
        """Up to ``n`` free slots, and a fresh generation for each (never one used before)."""
        with self._lock:
            k = min(n, len(self._free))
            slots = [self._free.pop() for _ in range(k)]
            first = max(self._last_gen + 1, time.time_ns())
            self._last_gen = first + k - 1
        return slots, list(range(first, first + k))

    def collect(self, slots: Sequence[int], generations: Sequence[int], rows: np.ndarray) -> int:
        """Copy the pages that landed in ``slots`` (as ``generations``) into ``rows``: how
        many leading ones arrived whole."""
        store = self.server.store
        buf = self.tier.buffer
        for i, (s, g) in enumerate(zip(slots, generations)):
            m = store.meta(s)
            if m.generation != g or m.length != rows.shape[1]:
                return i
            rows[i] = buf[s, :m.length]
            if page_checksum(rows[i].data) != m.checksum:   # rewritten while copied: not this page
                return i
        return len(slots)

    def release(self, slots: Sequence[int]) -> None:
        """The slots are free again. A helper's late write into one carries an older
        generation than the next push's, so it can never be taken for that push's page."""
        with self._lock:
            self._free.extend(slots)

    def close(self) -> None:
        self.server.close()


class Helper:
    """Serves ``push`` calls: loads the pages asked for through ``loader`` and writes them
    into the requester's landing server over ``transport`` ("tcp" or "rdma"). Its links to
    landing servers are kept while used: one unused for ``LINK_IDLE_S`` is closed, and at
    most ``MAX_LINKS`` are kept (the least recently used goes)."""

    LINK_IDLE_S = 60.0
    MAX_LINKS = 16

    def __init__(self, loader: Loader, page_bytes: int, net: NetConfig, transport: str, node_id: int = 0) -> None:
        self._loader = loader
        self._node_id = node_id
        self._page_bytes = page_bytes
        self._net = net
        self._transport = transport
        self._lock = threading.Lock()
        self._links: dict[Endpoint, tuple[Transport, float]] = {}   # -> (link, last used), oldest first
        self._slots = threading.BoundedSemaphore(MAX_PUSHES)
        self._queued = 0.0          # bytes of the pushes being served
        self._closed = False
        self.pushes = self.pages_pushed = self.busy = self.failed = self.own = 0

    def handle(self, body: bytes, scope: object) -> bytes:
        """A ``push`` call (the cluster's principal only; the server refuses it to others).
        Answers how many leading pages landed and the bytes other pushes have queued here
        now; a push that fails for any reason stored what it stored, never an error."""
        req = PushRequest.decode(body)
        if self._node_id and req.requester == self._node_id:   # this node, under another of its addresses
            with self._lock:
                self.own += 1
                return encode_answer(0, self._queued)
        deadline = time.monotonic() + req.budget_ms / 1e3
        nbytes = len(req.slots) * self._page_bytes
        if not self._slots.acquire(blocking=False):
            with self._lock:
                self.busy += 1
                return encode_answer(0, self._queued)
        with self._lock:
            self._queued += nbytes
        stored = 0
        try:
            stored = self._push(req, deadline)
        except TierKVError as exc:   # the store closing, a tier failing: pages the requester reads itself
            log.warning("tierkv: a push to %s:%d failed: %s", req.landing[0], req.landing[1], exc)
            with self._lock:
                self.failed += 1
        except Exception:   # noqa: BLE001 - so is anything else, which must not cut the requester's connection
            log.exception("tierkv: a push to %s:%d failed", req.landing[0], req.landing[1])
            with self._lock:
                self.failed += 1
        finally:
            self._slots.release()
            with self._lock:
                self._queued -= nbytes
                self.pushes += 1
                self.pages_pushed += stored
                queued = self._queued
        return encode_answer(stored, queued)

    def _push(self, req: PushRequest, deadline: float) -> int:
        pages = len(req.slots)
        chunk = max(1, CHUNK_BYTES // self._page_bytes)
        rows = aligned_empty(pages * self._page_bytes).reshape(pages, self._page_bytes)
        link = self._link(req.landing)
        if link is None:
            return 0
        writes: list[tuple[int, Future[WriteResult]]] = []
        loaded = 0
        try:
            while loaded < pages and time.monotonic() < deadline:
                n = min(chunk, pages - loaded)
                got = self._loader(req.chain, req.start + loaded, rows[loaded:loaded + n], req.salt, deadline)
                if got:
                    writes.append((got, link.write(req.slots[loaded:loaded + got], req.generations[loaded:loaded + got],
                                                   rows[loaded:loaded + got])))
                loaded += got
                if got < n:
                    break
        finally:
            # Each write resolves within the transport's deadline; past the push's own, the
            # requester has stopped waiting, and what lands after counts for nothing.
            stored, short = 0, False
            for n, fut in writes:
                try:
                    res = fut.result(timeout=max(0.0, deadline - time.monotonic()))
                    lost = res.error is not None   # the link failed (a slow one is only late)
                except TimeoutError:
                    res, lost = WriteResult((WriteStatus.FAILED,) * n, error="past the push's deadline"), False
                except TierKVError as exc:
                    res, lost = WriteResult((WriteStatus.FAILED,) * n, error=str(exc)), True
                ok = next((i for i, st in enumerate(res.statuses)
                           if st not in (WriteStatus.STORED, WriteStatus.DUPLICATE)), n)
                if not short:   # only the leading run counts: what landed after a gap is not used
                    stored += ok
                    short = ok < n
                if lost:
                    self._drop(req.landing, link)
        if short:
            with self._lock:
                self.failed += 1
        return stored

    def _link(self, ep: Endpoint) -> Transport | None:
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return None
            idle = [e for e, (_, used) in self._links.items() if now - used > self.LINK_IDLE_S and e != ep]
            stale = [self._links.pop(e)[0] for e in idle]
            got = self._links.pop(ep, None)
            if got is not None and not getattr(got[0], "connected", True):
                stale.append(got[0])   # its landing went away (a requester restarted there): connect afresh
                got = None
            if got is not None:
                self._links[ep] = (got[0], now)   # to the end: the most recently used
        for old in stale:
            old.close()
        if got is not None:
            return got[0]
        try:
            link = connect(ep[0], ep[1], self._transport, self._net)  # type: ignore[arg-type]
        except (TierKVError, OSError, ValueError) as exc:
            log.warning("landing %s:%d unreachable (%s); the push is a miss", ep[0], ep[1], exc)
            return None
        with self._lock:
            if self._closed:
                link.close()
                return None
            other = self._links.get(ep)
            if other is None:
                self._links[ep] = (link, now)
                extra = [self._links.pop(e)[0] for e in list(self._links)[:max(0, len(self._links) - self.MAX_LINKS)]]
        if other is not None:
            link.close()
            return other[0]
        for old in extra:
            old.close()
        return link

    def _drop(self, ep: Endpoint, link: Transport) -> None:
        with self._lock:
            got = self._links.get(ep)
            if got is None or got[0] is not link:
                return
            del self._links[ep]
        link.close()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"pushes": self.pushes, "pages_pushed": self.pages_pushed, "busy": self.busy,
                    "failed": self.failed, "own": self.own, "queued_bytes": self._queued, "links": len(self._links)}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = [link for link, _ in self._links.values()]
            self._links.clear()
        for link in links:
            link.close()
