"""A store served by ``tierkv serve``, used from another process: ``Store.connect(path)``.

:class:`RemoteStore` has the in-process :class:`~tierkv.store.api.Store`'s methods,
arguments, results and errors (put, get, lookup, prefetch, pin/unpin, stats, flush,
close); arguments are checked here with the same code and messages before anything
is sent. Page bytes travel through shared memory (:mod:`tierkv.serve.protocol`):

- a batch that lies in a buffer from :meth:`RemoteStore.page_buffer` is read (put) or
  filled (get) by the daemon in place: one copy, as in-process;
- any other batch is copied through the connection's own scratch segment first.

Each calling thread uses a connection of its own, so threads run their calls at once
(the daemon orders them as the store's lock does in-process), and a thread's get then
put of one prompt is one request to the eviction policies, as in-process. When the
daemon is not there (it does not accept or greet within ``timeout_s``) or goes away
during a call, the call raises :class:`~tierkv.errors.StoreUnavailableError`; the next
call connects again, so a client outlives a daemon restart without help (pins taken
before it are gone with the daemon's memory, as its DRAM pages are). A call waits for
its reply as long as the daemon lives: until then the daemon may be using the
caller's buffer.
"""

from __future__ import annotations

import fcntl
import dataclasses
import json
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import count
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tierkv import errors
from tierkv.errors import InputError, StoreClosedError, StoreUnavailableError, TierKVError
from tierkv.splice.ops import SpliceResult
from tierkv.splice.rope import Rope
from tierkv.keys import Tokens, as_token_array, narrow_into, range_error, stretch_ends, tenant_salt, wide_ids
from tierkv.layout import KVLayout
from tierkv.serve import protocol as P
from tierkv.store import landed as landed_words
from tierkv.store import lossy_pages
from tierkv.store.derived import Origin
from tierkv.store.landed import check_record
from tierkv.store.pages import PageBatch, PageList, PageSource, page_list, page_rows
from tierkv.store.results import GetResult, Lent, LookupResult, PutResult, _KIND_BY_RANK
from tierkv.store.stats import StoreStats, TierStats
from tierkv.store.validate import GET_LIST_MESSAGE, check_requested, check_unfilled
from tierkv.tiers.hugepages import advise_huge

if TYPE_CHECKING:
    from tierkv.lossy.alloc import Calibration, Importance

#: Segment ids: a connection's scratch and token segments keep theirs as they grow (the
#: daemon replaces the mapping), page buffers take fresh ones.
SCRATCH_ID, TOKENS_ID = 1, 2
_ids = count(16)



def stats_of(doc: dict[str, Any]) -> StoreStats:
    """A daemon's ``StoreStats.to_dict()`` as a :class:`StoreStats`: derived figures and
    fields this version does not know (a newer daemon's) are left out, fields an older
    daemon did not send keep their defaults."""
    tier_fields = {f.name for f in dataclasses.fields(TierStats)}
    store_fields = {f.name for f in dataclasses.fields(StoreStats)} - {"tiers"}
    tiers = {name: TierStats(**{k: v for k, v in t.items() if k in tier_fields}) for name, t in doc["tiers"].items()}
    return StoreStats(tiers=tiers, **{k: v for k, v in doc.items() if k in store_fields})

class _Segment:
    """A sealed memfd mapped here, registered with the daemon per connection."""

    def __init__(self, nbytes: int, name: str, seg_id: int | None = None) -> None:
        self.id = next(_ids) if seg_id is None else seg_id
        self.size = max(nbytes, mmap.PAGESIZE)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self.map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        advise_huge(self.map)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.array[::mmap.PAGESIZE] = 0   # allocated now, by this process (and charged to its memory)
        self.base = self.array.__array_interface__["data"][0]

    def rows(self, n: int, page_bytes: int) -> np.ndarray:
        return self.array[:n * page_bytes].reshape(n, page_bytes)

    def close(self) -> bool:
        """Close the memfd and unmap; returns whether it is unmapped. A mapping the caller
        still holds views of (a page buffer) stays until they go: a later close, or the
        last view's end, unmaps it."""
        if self.fd >= 0:
            del self.array
            os.close(self.fd)
            self.fd = -1
        try:
            self.map.close()
        except BufferError:
            return False
        return True


# Requests whose replies are polled for before the caller sleeps (_Conn._spin), and for how
# long: the scheduler's lookups, whose answer is a scan of keys, not a copy of pages.
SPIN_OPS = frozenset((P.Op.LOOKUP,))
SPIN_S = 200e-6
_PEEK_NOW = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)   # an int: or-ing the enum each poll cost 2 us


class _Conn:
    """One socket to the daemon, its scratch segment and the segments it has registered."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.timeout_s = timeout_s
        self.scratch: _Segment | None = None
        self.token_seg: _Segment | None = None
        self.answered = 0   # calls this connection has answered
        self.registered: set[int] = set()
        # Held for a whole request by the thread that owns the connection, and by another
        # thread that releases a page buffer (so no request is using it meanwhile).
        self.lock = threading.Lock()
        try:
            self.sock.connect(path)
        except BaseException:
            self.sock.close()
            raise

    def call(self, op: int, body: bytes = b"", fds: tuple[int, ...] = (), got: list[int] | None = None,
             after_send: Callable[[], bool | None] | None = None) -> memoryview:
        """Send one request and wait for its reply. The send is bounded by ``timeout_s``;
        the reply is waited for as long as the daemon lives (its end closes the socket):
        the daemon may be copying from or into the caller's buffer until it answers, so
        returning earlier would let the caller reuse a buffer still in use.
        ``after_send``: work of this request done once it is sent, before its reply is
        read (a streamed lookup's ids); False from it: do not poll for the reply, sleep
        on the socket at once."""
        try:
            P.send_frame(self.sock, op, body, fds=fds)
        except (BrokenPipeError, ConnectionResetError):
            # The daemon may have said why before it closed (too many clients): read that.
            rop, status, reply, _ = P.recv_frame(self.sock, body_timeout=self.timeout_s)
            if status != P.Status.OK:
                raise _error(reply) from None
            raise
        poll = after_send() if after_send is not None else None
        self.sock.settimeout(None)
        try:
            if op in SPIN_OPS and poll is not False:
                self._spin(SPIN_S)
            rop, status, reply, fds_in = P.recv_frame(self.sock, want_fds=got is not None)
        finally:
            self.sock.settimeout(self.timeout_s)
        if got is not None:
            got.extend(fds_in)   # the caller's to close, whatever the reply says
        if rop != op and status == P.Status.OK:
            raise P.ProtocolError(f"asked op {op}, the daemon answered op {rop}")
        if status != P.Status.OK:
            raise _error(reply)
        return reply

    def _spin(self, seconds: float) -> None:
        """Poll for the reply for up to ``seconds`` before sleeping on the socket. A lookup's
        answer comes within tens of microseconds, less than this VM takes to wake a
        sleeping thread (about 25 us a wake-up, measured for issue 21), and a thread that
        polls does not need waking: the daemon's send finds no sleeper either."""
        end = time.perf_counter() + seconds
        while True:
            try:
                self.sock.recv(1, _PEEK_NOW)
                return   # a byte, or the end of the stream: recv_frame reads it
            except (BlockingIOError, InterruptedError):
                if time.perf_counter() >= end:
                    return

    def register(self, seg: _Segment) -> None:
        if seg.id not in self.registered:
            self.call(P.Op.SEGMENT, P.SEGMENT_REQ.pack(seg.id, seg.size), fds=(seg.fd,))
            self.registered.add(seg.id)

    def _grown(self, seg: _Segment | None, need: int, name: str, seg_id: int) -> _Segment:
        """``seg``, or (too small) a segment twice its size or ``need`` that takes its id,
        so that registering it replaces the daemon's mapping of the old one."""
        if seg is None or seg.size < need:
            old = seg
            seg = _Segment(max(need, 2 * old.size if old is not None else 0), name, seg_id)
            if old is not None:
                self.registered.discard(old.id)
                old.close()
        self.register(seg)
        return seg

    def scratch_rows(self, n: int, page_bytes: int) -> tuple[_Segment, np.ndarray]:
        self.scratch = self._grown(self.scratch, n * page_bytes, "tierkv-scratch", SCRATCH_ID)
        return self.scratch, self.scratch.rows(n, page_bytes)

    def tokens(self, salt: bytes, toks: np.ndarray, prefix: bytes = b"") -> bytes:
        """The body of a token op: the tokens (from ``as_token_array``) inline when short,
        else through this connection's token segment."""
        need = toks.nbytes
        if need <= 4 * P.INLINE_TOKENS:
            return P.token_body(salt, toks.tobytes(), prefix)
        seg = self._token_segment(need)
        seg.array[:need].view(toks.dtype)[:] = toks
        return P.token_ref(salt, seg.id, 0, toks.size, prefix)

    def _token_segment(self, need: int) -> _Segment:
        """This connection's token segment, grown to ``need`` bytes where smaller."""
        self.token_seg = self._grown(self.token_seg, need, "tierkv-tokens", TOKENS_ID)
        return self.token_seg

    def close(self) -> None:
        self.sock.close()
        for seg in (self.scratch, self.token_seg):
            if seg is not None:
                seg.close()
        self.scratch = self.token_seg = None


class _IdFeed:
    """A streamed lookup's ids (protocol 8, ``FLAG_STREAMED``): a long prompt's int64 ids,
    checked and narrowed to uint32 into the connection's token segment a stretch at a
    time (as the daemon hashes them, :func:`tierkv.keys.stretch_ends`), behind a progress
    word the daemon polls. The first stretch is written before the request goes, the rest
    after (``rest``, while the request travels and the daemon looks the first stretch up),
    so that a new prompt's answer does not wait for its 1 MiB of ids to be narrowed. Every
    id is still checked before the lookup returns: one out of range abandons it
    (:data:`~tierkv.serve.protocol.STREAM_ABANDONED`) and ``check`` raises the InputError
    an in-process lookup raises."""

    def __init__(self, ids: np.ndarray, tokens_per_page: int, salt: bytes, head: bytes) -> None:
        self.ids, self.tpp, self.salt, self.head = ids, tokens_per_page, salt, head
        self.word: np.ndarray | None = None
        self.out: np.ndarray | None = None
        self.ends: list[int] = []
        self.error: InputError | None = None

    def start(self, conn: _Conn, _seg: int, _off: int) -> bytes:
        """The request's body, once the progress word is reset and the first stretch written."""
        n = self.ids.size
        seg = conn._token_segment(STREAM_IDS_AT + 4 * n)
        self.word = seg.array[:16].view(np.uint64)   # the progress word, then the daemon's
        self.out = seg.array[STREAM_IDS_AT:STREAM_IDS_AT + 4 * n].view("<u4")
        self.error = None
        landed_words.publish(self.word, 1, 0)
        landed_words.publish(self.word, 0, 0)
        self.ends = [end * self.tpp for end in stretch_ends(n // self.tpp)]
        self.ends[-1] = n   # the last stretch takes the ids of the partial page after it too
        self._write(0, self.ends[0])
        if self.error is not None:
            raise self.error   # nothing sent: the connection is as it was
        return P.token_ref(self.salt, seg.id, STREAM_IDS_AT, n, self.head + P.STREAM_REQ.pack(0))

    def rest(self) -> bool:
        """The ids after the first stretch, a stretch at a time; then whether the daemon has
        taken the lookup up (it writes the word after the progress word). If not, it is not
        running yet, perhaps queued on this very core: polling for its reply would hold it
        off (a lookup took 300 us instead of 100 so, 1-6% of them on a 2-core VM), so the
        caller sleeps on the socket instead."""
        for start, end in zip(self.ends, self.ends[1:]):
            if self.error is not None:
                break
            self._write(start, end)
        assert self.word is not None
        return landed_words.read(self.word, 1) != 0

    def _write(self, start: int, end: int) -> None:
        assert self.word is not None and self.out is not None
        if start < end:
            try:
                narrow_into(self.ids[start:end], self.out[start:end])
            except InputError:
                self.error = range_error(self.ids)
                landed_words.publish(self.word, 0, P.STREAM_ABANDONED)
                return
        landed_words.publish(self.word, 0, end)

    def check(self) -> None:
        if self.error is not None:
            raise self.error


#: Where a streamed lookup's ids start in the token segment: after its progress word, a
#: cache line of its own.
STREAM_IDS_AT = 64


class _Stale(Exception):
    """A connection that had served calls is dead: replace it and send the request again."""


def _empty(conn: _Conn, seg: int, off: int) -> bytes:
    return b""


def _error(reply: memoryview) -> TierKVError:
    try:
        doc = json.loads(bytes(reply))
        name, message = str(doc["type"]), str(doc["message"])
    except (ValueError, KeyError, TypeError):
        return TierKVError(f"the daemon answered with an unreadable error: {bytes(reply[:200])!r}")
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, TierKVError)):
        cls = TierKVError
    return cls(message)


class RemoteStore:
    """A connected store; see the module docstring. Use ``Store.connect(path)``."""

    read_only = False

    def __init__(self, socket_path: str | os.PathLike[str], *, timeout_s: float = 60.0) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 86400:
            raise InputError(f"connect: timeout_s must be seconds in (0, 86400], got {timeout_s!r}")
        self.socket_path = os.fspath(socket_path)
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._mine: dict[int, _Conn] = {}   # by thread
        self._all: set[_Conn] = set()
        self._buffers: list[_Segment] = []
        self._released: list[_Segment] = []   # released page buffers the caller still holds views of
        self._pool: np.ndarray | None = None   # the daemon's DRAM tier, once mapped (dram_pool)
        self._pool_id = 0                       # and its identity (a restarted daemon's is another)
        self._closed = False
        self._hello: dict[str, object] | None = None
        self._client_id = os.urandom(8).hex()   # this client's connections share its pins in the daemon
        conn = self._connect()   # the daemon's layout and model, and an error now if it is not there
        self._mine[threading.get_ident()] = conn
        assert self._hello is not None
        lay = self._hello["layout"]
        assert isinstance(lay, dict)
        self.layout: KVLayout = KVLayout(**lay)
        self.model_id: str = str(self._hello["model_id"])
        self._prefetcher: ThreadPoolExecutor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierkv-remote-prefetch")

    # -- connections --------------------------------------------------------------------
    def _connect(self) -> _Conn:
        try:
            conn = _Conn(self.socket_path, self.timeout_s)
        except OSError as exc:
            raise StoreUnavailableError(f"no tierkv daemon answers at {self.socket_path}: "
                                        f"{exc.strerror or exc}") from None
        try:
            reply = conn.call(P.Op.HELLO, json.dumps({"version": P.VERSION, "pid": os.getpid(),
                                                      "client": self._client_id}).encode())
            hello = json.loads(bytes(reply))
        except TierKVError:
            conn.close()
            raise
        except (OSError, EOFError, P.ProtocolError, ValueError) as exc:
            conn.close()
            raise StoreUnavailableError(f"the tierkv daemon at {self.socket_path} did not greet: {exc}") from None
        if self._hello is not None and (hello["layout"], hello["model_id"]) != (self._hello["layout"],
                                                                                 self._hello["model_id"]):
            conn.close()
            raise StoreUnavailableError(f"the daemon at {self.socket_path} now serves another model or layout "
                                        f"({hello['model_id']!r}); connect again")
        self._hello = hello
        # Greeted: the daemon served this connection, so its death from now on means the
        # daemon went away since (a retry's case), as after any other answered call.
        conn.answered += 1
        with self._lock:
            self._all.add(conn)
        return conn

    def _acquire(self) -> _Conn:
        """This thread's connection (made on its first call): a thread's calls reach one
        daemon thread in order, so a get then a put of one prompt on a thread is one
        request to the policies, as in-process."""
        me = threading.get_ident()
        with self._lock:
            self._check_open()
            conn = self._mine.get(me)
        if conn is not None:
            return conn
        conn = self._connect()
        with self._lock:
            if self._closed:   # closed while this thread connected
                self._all.discard(conn)
                conn.close()
                self._check_open()
            live = {t.ident for t in threading.enumerate()}
            for ident in [i for i in self._mine if i not in live]:   # threads gone since
                self._all.discard(self._mine[ident])
                self._mine.pop(ident).close()
            self._mine[me] = conn
        return conn

    def _release(self, conn: _Conn) -> None:
        if self._closed:
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        with self._lock:
            self._all.discard(conn)
            for ident, c in list(self._mine.items()):
                if c is conn:
                    del self._mine[ident]
        conn.close()

    def _request(self, op: int, build: Callable[[_Conn, int, int], bytes], *,
                 rows: np.ndarray | PageList | None = None, fill: bool = False, n_rows: int = 0,
                 got: list[int] | None = None, after_send: Callable[[], bool | None] | None = None) -> memoryview:
        """One request on this thread's connection: ``build(conn, segment_id, offset)``
        makes the body. ``rows`` are put from, or (``fill``) got into: in place when they
        lie in a page buffer, else through the connection's scratch segment.

        A connection that served calls before (its greeting counts) and turns out dead
        (the daemon restarted since) is replaced and the request sent again, once, except pins and unpins
        (not idempotent): the dead daemon can no longer touch anything of the caller's.
        ``got``: descriptors that came with the reply are added to it (the caller closes them).
        ``after_send``: as in :meth:`_Conn.call` (requests without rows)."""
        try:
            return self._request_once(op, build, rows, fill, n_rows, got=got, after_send=after_send)
        except _Stale:
            return self._request_once(op, build, rows, fill, n_rows, retry=False, got=got, after_send=after_send)

    def _request_once(self, op: int, build: Callable[[_Conn, int, int], bytes], rows: np.ndarray | PageList | None,
                      fill: bool, n_rows: int, retry: bool = True, got: list[int] | None = None,
                      after_send: Callable[[], bool | None] | None = None) -> memoryview:
        conn = self._acquire()
        try:
            with conn.lock:
                reply = self._exchange(conn, op, build, rows, fill, n_rows, got, after_send)
        except TierKVError:
            self._release(conn)
            raise
        except (OSError, EOFError, P.ProtocolError) as exc:
            self._drop(conn)
            if self._closed:
                raise StoreClosedError(f"the connection to {self.socket_path} was closed") from None
            # Not idempotent: pins; and an END_LEND, whose lend ended with the dead connection.
            if (retry and conn.answered and op not in (P.Op.PIN, P.Op.UNPIN, P.Op.END_LEND)
                    and not isinstance(exc, TimeoutError)):
                raise _Stale from None
            what = "did not answer in time" if isinstance(exc, TimeoutError) else f"is gone ({exc})"
            raise StoreUnavailableError(f"the tierkv daemon at {self.socket_path} {what}; the next call "
                                        "connects again") from None
        except BaseException:
            self._drop(conn)   # mid-request (KeyboardInterrupt): the stream cannot be trusted
            raise
        conn.answered += 1
        self._release(conn)
        return memoryview(reply)

    def _exchange(self, conn: _Conn, op: int, build: Callable[[_Conn, int, int], bytes],
                  rows: np.ndarray | PageList | None, fill: bool, n_rows: int, got: list[int] | None = None,
                  after_send: Callable[[], bool | None] | None = None) -> bytes:
        """One request and its reply on ``conn`` (its lock held): see :meth:`_request`."""
        if rows is None:
            return bytes(conn.call(op, build(conn, 0, 0), got=got, after_send=after_send))
        place = self._locate(rows)
        if place is not None:
            seg, off = place
            conn.register(seg)
            return bytes(conn.call(op, build(conn, seg.id, off)))
        seg, view = conn.scratch_rows(n_rows, self.layout.page_bytes)
        if not fill:
            if isinstance(rows, PageList):
                rows.stacked(view)
            else:
                np.copyto(view, rows)
        reply = bytes(conn.call(op, build(conn, seg.id, 0)))
        if fill:
            served = min(n_rows, int.from_bytes(reply[:8], "little"))
            assert isinstance(rows, np.ndarray)
            rows[:served] = view[:served]
        del view
        return reply

    def _locate(self, rows: np.ndarray | PageList) -> tuple[_Segment, int] | None:
        """(segment, offset) when ``rows`` is a contiguous batch inside one of this
        client's page buffers. InputError when it lies in a released one."""
        if not isinstance(rows, np.ndarray):
            return None
        start = rows.__array_interface__["data"][0]
        with self._lock:
            buffers, released = list(self._buffers), list(self._released)
        if any(seg.base <= start < seg.base + seg.size for seg in released):
            raise InputError("this batch lies in a page buffer released by release_buffer(); take a new one "
                             "with page_buffer()")
        if not rows.flags.c_contiguous:
            return None
        for seg in buffers:
            if seg.base <= start and start + rows.nbytes <= seg.base + seg.size:
                return seg, start - seg.base
        return None

    # -- buffers ------------------------------------------------------------------------
    def page_buffer(self, pages: int) -> np.ndarray:
        """A ``uint8 [pages, page_bytes]`` buffer in memory the daemon shares: a batch that
        lies in it (or a torch tensor made on it with ``torch.from_numpy``) is put from
        and got into by the daemon directly, with no copy here. Lives until
        :meth:`release_buffer` or ``close()``; each connection (one per calling thread)
        may have 64 registered with the daemon at once, so give back those no longer used."""
        if isinstance(pages, bool) or not isinstance(pages, int) or pages < 1:
            raise InputError(f"page_buffer: pages must be a positive integer, got {pages!r}")
        self._check_open()
        seg = _Segment(pages * self.layout.page_bytes, "tierkv-pages")
        with self._lock:
            self._buffers.append(seg)
        return seg.rows(pages, self.layout.page_bytes)

    def landing_record(self) -> np.ndarray:
        """A landing record (:mod:`tierkv.store.landed`) in memory the daemon shares, for
        ``get(..., landed=record)``; reusable from get to get (each resets it), given back
        with :meth:`release_buffer` like a page buffer."""
        self._check_open()
        seg = _Segment(landed_words.WORDS * 8, "tierkv-landed")
        with self._lock:
            self._buffers.append(seg)
        return np.frombuffer(seg.map, dtype=np.uint64, count=landed_words.WORDS)

    def attach_buffer(self, buf: np.ndarray) -> None:
        """Register a :meth:`page_buffer` with the daemon on the calling thread's connection
        now (the daemon maps it), so that this thread's first put or get in it does not
        pay for that. Optional: a call registers the buffer it uses when needed."""
        self._check_open()
        start = buf.__array_interface__["data"][0] if isinstance(buf, np.ndarray) else None
        with self._lock:
            seg = next((b for b in self._buffers if b.base == start), None)
        if seg is None:
            raise InputError("attach_buffer: not a page buffer of this client (page_buffer() makes them)")
        conn = self._acquire()
        try:
            with conn.lock:
                conn.register(seg)
        except TierKVError:
            self._release(conn)
            raise
        except (OSError, EOFError, P.ProtocolError) as exc:
            self._drop(conn)
            raise StoreUnavailableError(f"the tierkv daemon at {self.socket_path} is gone ({exc}); the next call "
                                        "connects again") from None
        except BaseException:
            self._drop(conn)
            raise
        self._release(conn)

    def release_buffer(self, buf: np.ndarray) -> None:
        """Give back a buffer :meth:`page_buffer` returned: the daemon unmaps it on every
        connection of this client that used it, and so does this process. A call on
        another thread using it is waited for. Afterwards a batch that lies in it is
        refused (InputError), as is a second release; its memory stays mapped while the
        caller holds views of it (reading them is harmless), then goes. InputError for
        an array that is not such a buffer."""
        self._check_open()
        start = buf.__array_interface__["data"][0] if isinstance(buf, np.ndarray) else None
        with self._lock:
            seg = next((b for b in self._buffers if b.base == start), None)
            if seg is None:
                if any(b.base == start for b in self._released):
                    raise InputError("release_buffer: this page buffer was released already")
                raise InputError("release_buffer: not a page buffer of this client (page_buffer() makes them)")
            self._buffers.remove(seg)
            self._released.append(seg)   # a request that finds it from here on is refused
            conns = list(self._all)
        for conn in conns:
            with conn.lock:   # a request using it on that connection ends first
                if seg.id not in conn.registered:
                    continue
                conn.registered.discard(seg.id)
                try:
                    conn.call(P.Op.UNREGISTER, P.UNREGISTER_REQ.pack(seg.id))
                    continue
                except (TierKVError, OSError, EOFError, P.ProtocolError):
                    pass
            self._drop(conn)   # could not say so: a connection's end unmaps all its segments
        with self._lock:   # forgotten once unmapped (no view of it can remain then)
            self._released = [b for b in self._released if not b.close()]

    # -- the API ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the connection to the store at {self.socket_path} is closed")

    def _pages_of(self, toks: np.ndarray) -> int:
        return len(toks) // self.layout.tokens_per_page

    def lookup(self, tokens: Tokens, tenant: str | bytes = "", *, count: bool = True,
               accept: str = "exact", accept_lossy: float | None = None) -> LookupResult:
        """As :meth:`Store.lookup <tierkv.store.api.Store.lookup>`."""
        derived = _derived(accept, "lookup")
        budget = _lossy(accept_lossy, derived, "lookup")
        self._check_open()
        # The ids go as they are (a long int64 prompt's checked as it is narrowed to uint32
        # straight into the token segment; any other checked here, before the request, so
        # that an error leaves the connection and the pins and lends it holds alone): the
        # daemon hashes their keys a stretch at a time and stops at the first page it does
        # not hold, so a prompt costs what its cached prefix costs.
        salt = tenant_salt(tenant)
        flags = (P.FLAG_COUNT if count else 0) | (P.FLAG_DERIVED if derived else 0)
        if wide_ids(tokens) and tokens.size > P.INLINE_TOKENS:
            # A long prompt of int64 ids: narrowed into the token segment while the request
            # is on its way and the daemon hashes the first stretch (_IdFeed).
            feed = _IdFeed(tokens, self.layout.tokens_per_page, salt,
                           P.LOOKUP_REQ.pack(flags | P.FLAG_STREAMED, budget))
            try:
                reply = self._request(P.Op.LOOKUP, feed.start, after_send=feed.rest)
            except TierKVError:
                feed.check()   # an id out of range: this error, not the daemon's word for it
                raise
            feed.check()
        else:
            ids = as_token_array(tokens)
            reply = self._request(P.Op.LOOKUP, lambda conn, _s, _o: conn.tokens(salt, ids, P.LOOKUP_REQ.pack(flags,
                                                                                                            budget)))
        n, ntok, total, nderived, nlossy = P.LOOKUP_REP.unpack_from(reply)
        return LookupResult(n, ntok, total, bytes(reply[P.LOOKUP_REP.size:]), derived=nderived, lossy=nlossy)

    def get(self, tokens: Tokens, out: PageBatch, tenant: str | bytes = "", *,
            requested: int | None = None, landed: np.ndarray | None = None, accept: str = "exact",
            accept_lossy: float | None = None) -> GetResult:
        """As :meth:`Store.get <tierkv.store.api.Store.get>` (lossy pages come as stored and
        are decoded here, in the client's process). ``landed``: a record from
        :meth:`landing_record`, which the daemon updates as the layers of the pages land
        in ``out`` (which must then lie in a :meth:`page_buffer`), for a consumer on
        another thread that uses the first layers while the last are read (exact pages only)."""
        derived = _derived(accept, "get")
        budget = _lossy(accept_lossy, derived, "get")
        if (derived or budget) and landed is not None:
            raise InputError("get(accept='derived' or accept_lossy=...) loads whole pages: it takes no landing record")
        self._check_open()
        toks, salt = as_token_array(tokens), tenant_salt(tenant)
        if isinstance(out, (list, tuple)):
            raise InputError(GET_LIST_MESSAGE)
        rows = page_rows(out, self.layout, "get(out=...)", self._pages_of(toks))
        if not rows.flags.writeable:
            raise InputError("get(out=...): the output buffer is read-only")
        want = rows.shape[0]
        check_requested(requested, want)

        asked = -1 if requested is None else requested
        if landed is not None:
            record = check_record(landed)
            at = self._locate(record)
            if at is None:
                raise InputError("get(landed=...): the record must lie in memory this client shares with the "
                                 "daemon (landing_record() makes one)")
            if self._locate(rows) is None:
                raise InputError("get(landed=...): the pages of a layered get must lie in a page_buffer() of this "
                                 "client (the daemon writes them there as they land)")
            rseg, roff = at

            def build_layered(conn: _Conn, seg: int, off: int) -> bytes:
                conn.register(rseg)
                return conn.tokens(salt, toks, P.GET_LAYERED_REQ.pack(seg, off, want, asked, rseg.id, roff))
            reply = self._request(P.Op.GET_LAYERED, build_layered, rows=rows, fill=True, n_rows=want)
            return _get_result(reply)

        def build(conn: _Conn, seg: int, off: int) -> bytes:
            return conn.tokens(salt, toks, P.GET_REQ.pack(seg, off, want, asked, P.FLAG_DERIVED if derived else 0,
                                                          budget))
        reply = self._request(P.Op.GET, build, rows=rows, fill=True, n_rows=want)
        res = _get_result(reply)
        if not res.lossy:
            return res
        first = res.pages - res.lossy
        n, evicted = lossy_pages.decode_rows(self.layout, rows, first, res.lossy, budget)
        total = first + n
        return GetResult(total, total * self.layout.tokens_per_page, res.tiers[:total], lossy=n,
                         evicted=evicted if n else None)

    def put_lossy(self, tokens: Tokens, pages: PageSource, budget: float, tenant: str | bytes = "", *,
                  importance: Importance | None = None, calibration: Calibration | None = None,
                  evict: bool = True) -> PutResult:
        """As :meth:`Store.put_lossy <tierkv.store.api.Store.put_lossy>`: the pages are coded
        here, in the client's process, and the daemon stores the blobs."""
        self._check_open()
        toks, salt = as_token_array(tokens), tenant_salt(tenant)
        rows = lossy_pages.code_rows(self.layout, pages, self._pages_of(toks), budget, importance, calibration,
                                     evict, "put_lossy")
        k = rows.shape[0]

        def build(conn: _Conn, seg: int, off: int) -> bytes:
            return conn.tokens(salt, toks, P.PUT_REQ.pack(seg, off, k, 0, True, float(budget)))
        reply = self._request(P.Op.PUT, build, rows=rows, n_rows=k)
        return PutResult(*P.PUT_REP.unpack_from(reply))

    def splice(self, tokens: Tokens, start: int, end: int, replacement: Tokens, *, rope: Rope,
               tenant: str | bytes = "") -> SpliceResult:
        """As :meth:`Store.splice <tierkv.store.api.Store.splice>`: the daemon moves the pages."""
        self._check_open()
        toks, salt = as_token_array(tokens), tenant_salt(tenant)
        rep = as_token_array(replacement)
        for name, v in (("start", start), ("end", end)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise InputError(f"splice: {name} must be a token index, got {v!r}")
        kind = rope.rope_type.encode()
        if len(kind) > 0xFF:
            raise InputError(f"splice: a rope type's name is at most 255 bytes, got {len(kind)}")
        if rep.nbytes > 4 * P.INLINE_TOKENS:
            raise InputError(f"splice: a replacement of at most {P.INLINE_TOKENS:,} tokens goes through a daemon, "
                             f"got {rep.size:,}")
        head = b"".join([P.SPLICE_REQ.pack(int(start), int(end), rope.head_dim, rope.inv_freq.size,
                                           rope.convention == "interleaved", len(kind)),
                         rope.inv_freq.astype("<f4").tobytes(), kind, P.SPLICE_LEN.pack(rep.size), rep.tobytes()])
        reply = self._request(P.Op.SPLICE, lambda conn, _s, _o: conn.tokens(salt, toks, head))
        pf, pt, first, derived, stored, delta = P.SPLICE_REP.unpack_from(reply)
        return SpliceResult(np.concatenate([toks[:start], rep, toks[end:]]), pf, pt, first, derived, stored, delta)

    def origins(self, tokens: Tokens, tenant: str | bytes = "") -> list[Origin | None]:
        """As :meth:`Store.origins <tierkv.store.api.Store.origins>`."""
        self._check_open()
        toks, salt = as_token_array(tokens), tenant_salt(tenant)
        found: list[Origin | None] = []
        total = -1
        for _ in range(_ORIGINS_TRIES * (1 + len(toks) // P.ORIGINS_PER_REPLY)):
            # A reply carries at most ORIGINS_PER_REPLY; where the count changes between
            # replies (a splice or an eviction meanwhile), the pages are asked for again.
            head = P.ORIGINS_REQ.pack(len(found), P.ORIGINS_PER_REPLY)
            doc = json.loads(bytes(self._request(P.Op.ORIGINS, lambda conn, _s, _o: conn.tokens(salt, toks, head))))
            if total not in (-1, doc["total"]):
                found, total = [], -1
                continue
            total, part = doc["total"], doc["origins"]
            found += [Origin.from_dict(d) if d is not None else None for d in part]
            if not part or len(found) >= total:
                return found[:total]
        raise TierKVError(f"the derived pages' origins kept changing while {_ORIGINS_TRIES} reads of them ran")

    # -- pages lent in place ----------------------------------------------------------
    def dram_pool(self) -> np.ndarray:
        """The daemon's DRAM tier, mapped read-only here: ``uint8 [slots, page_bytes]``,
        whose rows :meth:`lend` names. Made once per daemon: after a lend from a restarted
        daemon (whose pool is another), this returns the new pool's mapping, and a caller
        that kept the old array must take this one. Only for a user that may use
        every tenant (AccessDeniedError otherwise: the pool holds every tenant's pages);
        TierKVError when the daemon's DRAM tier is not shared (page-locked, or none)."""
        self._check_open()
        with self._lock:
            if self._pool is not None:
                return self._pool
        fds: list[int] = []
        try:
            reply = self._request(P.Op.DRAM_POOL, lambda conn, seg, off: b"", got=fds)
            slots, slot_bytes, pool_id = P.POOL_REP.unpack_from(reply)
            if len(fds) != 1 or slot_bytes < self.layout.page_bytes:
                raise StoreUnavailableError(f"the tierkv daemon at {self.socket_path} answered DRAM_POOL with "
                                            f"{len(fds)} descriptors and {slot_bytes}-byte slots")
            try:
                m = mmap.mmap(fds[0], slots * slot_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
            except OSError as exc:
                raise StoreUnavailableError(f"cannot map the DRAM pool of the tierkv daemon at {self.socket_path}: "
                                            f"{exc}") from None
        finally:
            for fd in fds:
                os.close(fd)   # the mapping keeps what it needs
        pool = np.frombuffer(m, dtype=np.uint8).reshape(slots, slot_bytes)[:, :self.layout.page_bytes]
        with self._lock:
            if self._pool is None:
                self._pool, self._pool_id = pool, pool_id
            return self._pool

    def lend(self, tokens: Tokens, tenant: str | bytes = "", *, want: int, requested: int | None = None,
             whole: bool = False) -> Lent:
        """As :meth:`Store.lend <tierkv.store.api.Store.lend>`: page ``i`` is row
        ``lent.slots[i]`` of :meth:`dram_pool` until :meth:`end_lend`, which must come from
        the same thread (a lend lives on its thread's connection and ends with it)."""
        self._check_open()
        toks, salt = as_token_array(tokens), tenant_salt(tenant)
        if isinstance(want, bool) or not isinstance(want, int) or not 0 <= want <= self._pages_of(toks):
            raise InputError(f"lend: want must be a page count in [0, {self._pages_of(toks)}] (the full pages of "
                             f"the tokens), got {want!r}")
        check_requested(requested, want)

        def build(conn: _Conn, seg: int, off: int) -> bytes:
            return conn.tokens(salt, toks, P.LEND_REQ.pack(want, -1 if requested is None else requested, whole))
        reply = self._request(P.Op.LEND, build)
        pages, ntok, token, pool_id = P.LEND_REP.unpack_from(reply)
        slots = np.frombuffer(reply, dtype="<u4", count=pages, offset=P.LEND_REP.size)
        lent = Lent(pages, ntok, tuple(int(x) for x in slots), token, pool_id)
        with self._lock:
            stale = self._pool is not None and pool_id != self._pool_id
            if stale:   # the daemon restarted since dram_pool(): its rows are in another buffer
                self._pool = None
        if stale and pages:
            try:
                self.dram_pool()
                if self._pool_id != pool_id:
                    raise StoreUnavailableError(f"the tierkv daemon at {self.socket_path} changed its DRAM pool "
                                                "again (restarted twice?); lend again")
            except BaseException:
                self.end_lend(lent)
                raise
        return lent

    def end_lend(self, lent: Lent | int) -> None:
        """The rows :meth:`lend` named are no longer read (on the thread that lent them)."""
        self._check_open()
        token = lent.token if isinstance(lent, Lent) else int(lent)
        if token >= 0:
            self._request(P.Op.END_LEND, lambda conn, seg, off: P.END_LEND_REQ.pack(token))

    def put(self, tokens: Tokens, pages: PageSource, tenant: str | bytes = "", *,
            announce: bool = True, unfilled: int = 0) -> PutResult:
        """As :meth:`Store.put <tierkv.store.api.Store.put>`."""
        self._check_open()
        toks, salt = as_token_array(tokens), tenant_salt(tenant)
        n = self._pages_of(toks)
        rows = (page_list(pages, self.layout, "put(pages=...)", n) if isinstance(pages, (list, tuple)) else
                page_rows(pages, self.layout, "put(pages=...)", n, lists=True))  # type: ignore[arg-type]
        check_unfilled(unfilled, rows.shape[0])
        k = rows.shape[0]

        def build(conn: _Conn, seg: int, off: int) -> bytes:
            return conn.tokens(salt, toks, P.PUT_REQ.pack(seg, off, k, unfilled, bool(announce), 0.0))
        reply = self._request(P.Op.PUT, build, rows=rows, n_rows=k)
        return PutResult(*P.PUT_REP.unpack_from(reply))

    def prefetch(self, tokens: Tokens, tenant: str | bytes = "") -> Future[int]:
        """As :meth:`Store.prefetch <tierkv.store.api.Store.prefetch>`: the daemon promotes
        the pages; the future resolves when it has."""
        self._check_open()
        salt, toks = tenant_salt(tenant), as_token_array(tokens)
        try:
            return self._prefetcher.submit(self._count_op, P.Op.PREFETCH, salt, toks)
        except RuntimeError:  # closed between the check and the submit
            self._check_open()
            raise

    def _count_op(self, op: int, salt: bytes, toks: np.ndarray) -> int:
        (n,) = P.COUNT.unpack_from(self._request(op, lambda conn, _s, _o: conn.tokens(salt, toks)))
        return int(n)

    def pin(self, tokens: Tokens, tenant: str | bytes = "") -> int:
        """As :meth:`Store.pin <tierkv.store.api.Store.pin>`. Pins live in the daemon and
        are this client's: its unpins (from any of its threads) release its own pins only,
        never another client's, and those left are released when it closes or its process
        ends. A daemon restart releases them (its DRAM pages are gone too)."""
        self._check_open()
        return self._count_op(P.Op.PIN, tenant_salt(tenant), as_token_array(tokens))

    def unpin(self, tokens: Tokens, tenant: str | bytes = "") -> int:
        """As :meth:`Store.unpin <tierkv.store.api.Store.unpin>`."""
        self._check_open()
        return self._count_op(P.Op.UNPIN, tenant_salt(tenant), as_token_array(tokens))

    def stats(self) -> StoreStats:
        """The daemon's store's counters (every client's calls together)."""
        self._check_open()
        return stats_of(json.loads(bytes(self._request(P.Op.STATS, _empty))))

    def status(self) -> dict[str, Any]:
        """The daemon's status: pid, uptime, connections, requests, the store's stats, and
        (for a user that may use every tenant) each client's pid, user and requests."""
        self._check_open()
        doc = json.loads(bytes(self._request(P.Op.STATUS, _empty)))
        assert isinstance(doc, dict)
        return doc

    def flush(self) -> None:
        """As :meth:`Store.flush <tierkv.store.api.Store.flush>`, for every client's pages."""
        self._check_open()
        self._request(P.Op.FLUSH, _empty)

    def close(self) -> None:
        """Close this client's connections and buffers; the daemon and its store go on."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._all, self._mine = list(self._all), set(), {}
            buffers, self._buffers = self._buffers, []
            released, self._released = self._released, []
        self._prefetcher.shutdown(wait=True)
        for conn in conns:
            conn.close()
        for seg in buffers + released:
            seg.close()

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteStore({self.socket_path!r}, {'closed' if self._closed else 'open'})"


def connect(socket_path: str | os.PathLike[str] | Path, *, timeout_s: float = 60.0) -> RemoteStore:
    """A client of the daemon listening at ``socket_path``."""
    return RemoteStore(socket_path, timeout_s=timeout_s)


#: Reads of a prompt's origins a client starts before it gives up on a store that keeps changing them.
_ORIGINS_TRIES = 3


def _derived(accept: str, what: str) -> bool:
    if accept not in ("exact", "derived"):
        raise InputError(f"{what}(accept=...) must be one of exact, derived, got {accept!r}")
    return accept == "derived"


def _lossy(accept_lossy: float | None, derived: bool, what: str) -> float:
    """A call's lossy budget as sent (0.0: none); InputError as the store gives it."""
    if accept_lossy is None:
        return 0.0
    if derived:
        raise InputError(f"{what}: accept='derived' and accept_lossy= cannot be asked together")
    return lossy_pages.check_budget(accept_lossy, f"{what}(accept_lossy=...)")


def _get_result(reply: bytes | memoryview) -> GetResult:
    pages, ntok, nderived, nlossy = P.GET_REP.unpack_from(reply)
    return GetResult(pages, ntok, tuple(_KIND_BY_RANK[r] for r in bytes(reply[P.GET_REP.size:])), derived=nderived,
                     lossy=nlossy)
