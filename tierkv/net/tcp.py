"""The TCP fallback transport: the :class:`~tierkv.net.transport.Transport` API over plain sockets.

Used where no RDMA device exists (CI, laptops), and as the baseline the RDMA path is
measured against. A :class:`TcpTransport` holds ``NetConfig.links`` connections to one
peer behind a :class:`~tierkv.net.mux.Mux`; each connection (:class:`TcpLink`) has

- a send window (:class:`~tierkv.net.window.SendWindow`): requests in flight, in order;
- a credit gate (:class:`~tierkv.net.credits.CreditGate`) fed by the server's grants;
- a sender thread (sends the oldest unsent request once it holds a credit), a reader
  thread per socket (replies ack the window and resolve futures; grants feed the gate;
  a NAK schedules a retry after ``rnr_delay_s``), a reaper (fails requests past their
  deadline) and a reconnector (backoff from ``backoff_initial_s`` to ``backoff_max_s``).

On a lost connection the window is rewound and, once a new connection is up, every
unacknowledged request is sent again in order (writes are idempotent at the server).
While the peer cannot be reached at all, requests fail at once (misses) instead of
waiting out their deadline. Replies land in the transport's :class:`~tierkv.net.pool.PagePool`.
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierkv.errors import InputError, StoreClosedError, TierKVError, TierUnavailableError
from tierkv.net.credits import CreditGate
from tierkv.net.framing import recv_message, send_message
from tierkv.net.mux import Mux
from tierkv.net.pool import Block, PagePool
from tierkv.net.split import in_turn
from tierkv.net.transport import (CallResult, LinkStats, NetConfig, PeerInfo, ReadResult, Transport,
                                  WriteResult)
from tierkv.net.verify import copy_accepted, failed_read, read_args, write_args
from tierkv.net import auth
from tierkv.net.wire import (Auth, Body, Call, Challenge, Hello, Kind, PageMeta, Pages, ProtocolError, ReadPages,
                             Reply, Welcome, WriteAck, WriteStatus, page_checksum, pages_per_message)
from tierkv.net.window import Entry, SendWindow

_client_ids = itertools.count(1)


@dataclass
class _Req:
    kind: Kind
    channel: int
    parts: list[bytes | memoryview]
    future: Future[Any]
    on_reply: Callable[[Body], object]
    on_fail: Callable[[str], object]


def _resolve(e: Entry[_Req], result: object) -> None:
    if not e.item.future.done():
        e.item.future.set_result(result)


class TcpLink:
    """One connection to the peer. Thread-safe; ``submit`` never blocks past the deadline."""

    def __init__(self, host: str, port: int, config: NetConfig, pool: PagePool) -> None:
        self.host, self.port, self.config, self.pool = host, port, config, pool
        self.client_id = (os.getpid() << 20) | next(_client_ids)
        self.window: SendWindow[_Req] = SendWindow(config.window)
        self.gate = CreditGate(0, enabled=config.credits)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._gen = 0
        self._connected = threading.Event()
        self._down = threading.Event()
        self._closed = threading.Event()
        self._unreachable = False
        self._up_since = 0.0  # when the current connection came up
        self.info = PeerInfo(0, 0, 0)
        self.counts = {"sent": 0, "naks": 0, "expired": 0, "reconnects": 0, "bad_replies": 0}
        self._connect()  # the first connect raises; later ones retry in the background
        for fn, name in ((self._send_loop, "send"), (self._reap_loop, "reap"), (self._reconnect_loop, "reconnect")):
            threading.Thread(target=fn, name=f"tierkv-peer-{name}", daemon=True).start()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def stats(self) -> LinkStats:
        c = self.counts
        return LinkStats(c["sent"], self.window.resends, c["naks"], c["expired"], c["reconnects"], self.gate.waits,
                         c["bad_replies"])

    def submit(self, req: _Req) -> None:
        if self._closed.is_set():
            raise StoreClosedError(f"transport to {self.host}:{self.port} is closed")
        if self._unreachable:
            req.future.set_result(req.on_fail(f"peer {self.host}:{self.port} unreachable"))
            return
        e = self.window.reserve(req, time.monotonic() + self.config.timeout_s)
        if e is None:
            req.future.set_result(req.on_fail(f"send window to {self.host}:{self.port} stayed full"))

    def close(self) -> None:
        self._closed.set()
        self.gate.close()
        for e in self.window.close():
            _resolve(e, e.item.on_fail("transport closed"))
        self._drop(self._gen, "closed")

    # -- connection lifecycle -------------------------------------------------------------
    def _connect(self) -> None:
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.config.connect_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            body = self._handshake(sock, time.monotonic() + self.config.connect_timeout_s)
        except (OSError, ConnectionError, ProtocolError) as e:
            if sock is not None:
                sock.close()
            raise TierUnavailableError(f"cannot reach peer {self.host}:{self.port}: {e}") from None
        except TierUnavailableError:
            assert sock is not None
            sock.close()
            raise
        sock.settimeout(None)
        with self._lock:
            if self._closed.is_set():  # closed while this handshake ran: keep nothing
                sock.close()
                raise StoreClosedError(f"transport to {self.host}:{self.port} is closed")
            self._gen += 1
            gen = self._gen
            self._sock = sock
            self._up_since = time.monotonic()
            self.info = PeerInfo(body.epoch, body.num_slots, body.slot_bytes)
            self.gate.reset(body.credits)
            self.window.rewind()
            self._unreachable = False
            self._down.clear()
            self._connected.set()
        threading.Thread(target=self._read_loop, args=(sock, gen), name="tierkv-peer-read", daemon=True).start()

    def _handshake(self, sock: socket.socket, deadline: float) -> Welcome:
        """HELLO, then (with a server that has credentials) the challenge and this side's
        answer; the server's WELCOME. A whole-handshake deadline: each receive is bounded by
        the socket timeout, but a peer trickling its answer a byte at a time would otherwise
        never time out. TierUnavailableError when either side fails to authenticate."""
        cred = self.config.credential
        mine = auth.nonce() if cred is not None else b""
        send_message(sock, Kind.HELLO, 0, 0, 0,
                     Hello(self.client_id, cred.principal if cred else "", mine).encode())
        _, body, _ = recv_message(sock, deadline=deadline)
        where = f"peer {self.host}:{self.port}"
        if isinstance(body, Challenge):
            if cred is None:
                raise TierUnavailableError(f"{where} requires authentication; this side has no credential "
                                           "(set [peers] secret_file)")
            if not auth.same(body.proof, auth.server_proof(cred.secret, cred.principal, mine, body.nonce)):
                raise TierUnavailableError(f"{where} failed to prove it holds the secret of principal "
                                           f"{cred.principal or '(cluster)'!r}: a different secret, or not a peer")
            send_message(sock, Kind.AUTH, 0, 0, 0,
                         Auth(auth.client_proof(cred.secret, cred.principal, body.nonce, mine)).encode())
            try:
                _, body, _ = recv_message(sock, deadline=deadline)
            except ConnectionError:
                raise TierUnavailableError(f"{where} refused this side's credential for principal "
                                           f"{cred.principal or '(cluster)'!r}") from None
        elif cred is not None and isinstance(body, Welcome):
            raise TierUnavailableError(f"{where} runs without credentials, so it cannot prove who it is; "
                                       "this side refuses it (give both sides the same secret)")
        if not isinstance(body, Welcome):
            raise TierUnavailableError(f"{where} answered the handshake with {type(body).__name__}")
        return body

    def _drop(self, gen: int, why: str) -> None:
        with self._lock:
            if gen != self._gen or self._sock is None:
                return
            sock, self._sock = self._sock, None
            self._gen += 1
            self._connected.clear()
            self.window.rewind()
            self._down.set()
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()

    def _reconnect_loop(self) -> None:
        backoff = self.config.backoff_initial_s
        retrying = False  # the last try failed and its backoff has been waited already
        while not self._closed.is_set():
            if not self._down.wait(0.1) or self._closed.is_set():
                continue
            young = time.monotonic() - self._up_since < self.config.backoff_max_s
            if young and not retrying:
                # It died young: a peer that welcomes and then drops every connection
                # must not draw a reconnect storm, so back off before this try as well.
                self._closed.wait(backoff)
                backoff = min(backoff * 2, self.config.backoff_max_s)
                if self._closed.is_set():
                    return
            elif not retrying:
                backoff = self.config.backoff_initial_s
            try:
                self._connect()
                self.counts["reconnects"] += 1
                retrying = False
            except StoreClosedError:
                return
            except TierUnavailableError:
                retrying = True
                self._unreachable = True  # fail what waits, and new requests, at once
                for e in self.window.drain():
                    _resolve(e, e.item.on_fail(f"peer {self.host}:{self.port} unreachable"))
                self._closed.wait(backoff)
                backoff = min(backoff * 2, self.config.backoff_max_s)

    # -- the three loops ------------------------------------------------------------------
    def _send_loop(self) -> None:
        while not self._closed.is_set():
            if not self._connected.wait(0.1):
                continue
            with self._lock:
                sock, gen = self._sock, self._gen
            if sock is None or not self.gate.acquire(0.1):
                continue
            e = self.window.next_unsent(0.1)
            if e is None:
                self.gate.grant(1)
                continue
            try:
                send_message(sock, e.item.kind, e.item.channel, 0, e.seq, e.item.parts)
                self.counts["sent"] += 1
            except OSError as err:
                self.window.retry(e.seq, 0.0)
                self._drop(gen, f"send failed: {err}")

    def _read_loop(self, sock: socket.socket, gen: int) -> None:
        blocks: list[Block] = []

        def alloc(n: int) -> memoryview:
            b = self.pool.allocate(n)
            if b is None:
                return np.empty(n, dtype=np.uint8).data
            blocks.append(b)
            return self.pool.view(b).data

        while True:
            try:
                header, body, _ = recv_message(sock, alloc)
            except (OSError, ConnectionError, ProtocolError) as err:
                self._free(blocks)
                self._drop(gen, str(err))
                return
            try:
                if gen != self._gen:
                    continue
                self.gate.grant(header.credits)
                if header.kind == Kind.NAK:
                    self.counts["naks"] += 1
                    self.gate.grant(1)  # the receive was never consumed
                    self.window.retry(header.seq, self.config.rnr_delay_s)
                    continue
                e = self.window.ack(header.seq)
                if e is not None:
                    try:
                        result = e.item.on_reply(body)
                    except (TierKVError, ValueError, struct.error) as err:  # a reply that does not add up
                        self.counts["bad_replies"] += 1
                        result = e.item.on_fail(f"peer {self.host}:{self.port} sent a malformed reply: {err}")
                    _resolve(e, result)
            finally:
                self._free(blocks)

    def _free(self, blocks: list[Block]) -> None:
        while blocks:
            self.pool.free(blocks.pop())

    def _reap_loop(self) -> None:
        while not self._closed.wait(0.02):
            gone = self.window.expire(time.monotonic())
            for e in gone:
                self.counts["expired"] += 1
                _resolve(e, e.item.on_fail(f"no reply from {self.host}:{self.port} within {self.config.timeout_s} s"))
            if any(e.sent for e in gone):  # a peer that stops answering is treated as lost
                self._drop(self._gen, "request timed out")


class TcpTransport(Transport):
    """The client side of one peer over TCP; see the module docstring."""

    def __init__(self, host: str, port: int, config: NetConfig | None = None, pool: PagePool | None = None) -> None:
        self.config = config or NetConfig()
        self.address = (host, port)
        self.pool = pool or PagePool(self.config.pool_bytes)
        self._links: list[TcpLink] = []
        # Issues the later parts of a batch too large for one message (tierkv.net.split).
        self._parts = ThreadPoolExecutor(2, thread_name_prefix="tierkv-peer-parts")
        try:
            for _ in range(max(1, self.config.links)):
                self._links.append(TcpLink(host, port, self.config, self.pool))
        except TierUnavailableError:
            self.close()
            raise
        self.mux = Mux(self._links)
        self._closed = False

    @property
    def info(self) -> PeerInfo:  # type: ignore[override]
        return self._links[0].info

    @property
    def connected(self) -> bool:
        return all(link.connected for link in self._links)

    @property
    def reachable(self) -> bool:
        """False while a reconnect attempt has failed (requests then fail at once)."""
        return not any(link._unreachable for link in self._links)

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait until every link is connected (after a peer restart); False on timeout."""
        end = time.monotonic() + timeout_s
        return all(link._connected.wait(max(0.0, end - time.monotonic())) for link in self._links)

    def read(self, slots: Sequence[int], dst: np.ndarray, expect: Sequence[PageMeta | None] | None = None,
             channel: int = 0, keys: Sequence[bytes] | None = None) -> Future[ReadResult]:
        slots = read_args(slots, dst, self.info)
        if keys is not None and len(keys) != len(slots):
            raise InputError(f"a read names one key per slot: {len(keys)} keys for {len(slots)} slots")
        per = pages_per_message(self.info.slot_bytes)
        if len(slots) <= per:
            return self._read(slots, dst, expect, channel, keys)
        # A reply carries at most ``per`` pages: split, and answer once every part has.
        parts = [functools.partial(self._read, slots[i:i + per], dst[i:i + per],
                                   None if expect is None else expect[i:i + per], channel,
                                   None if keys is None else keys[i:i + per])
                 for i in range(0, len(slots), per)]
        return in_turn(parts, lambda rs: ReadResult(tuple(o for r in rs for o in r.ok),
                                                   tuple(m for r in rs for m in r.metas),
                                                   next((r.error for r in rs if r.error), None)),
                       self._parts)

    def _read(self, slots: list[int], dst: np.ndarray, expect: Sequence[PageMeta | None] | None,
              channel: int, keys: Sequence[bytes] | None = None) -> Future[ReadResult]:
        fut: Future[ReadResult] = Future()
        if not slots:
            fut.set_result(ReadResult((), ()))
            return fut

        def on_reply(body: Body) -> ReadResult:
            if not isinstance(body, Pages) or len(body.metas) != len(slots):
                return failed_read(slots, f"peer answered a read with {type(body).__name__}")
            offs = body.offsets()
            datas = [body.data[o:o + m.length] for o, m in zip(offs, body.metas)]
            return copy_accepted(body.metas, datas, slots, dst, expect)

        body = ReadPages(tuple(slots), tuple(keys) if keys else ())
        self._submit(channel, _Req(Kind.READ, channel, body.encode(), fut, on_reply,
                                   lambda why: failed_read(slots, why)))
        return fut

    def write(self, slots: Sequence[int], generations: Sequence[int], src: np.ndarray,
              channel: int = 0) -> Future[WriteResult]:
        slots, generations = write_args(slots, generations, src, self.info)
        per = pages_per_message(src.shape[1])
        if len(slots) <= per:
            return self._write(slots, generations, src, channel)
        parts = [functools.partial(self._write, slots[i:i + per], generations[i:i + per], src[i:i + per], channel)
                 for i in range(0, len(slots), per)]
        return in_turn(parts, lambda rs: WriteResult(tuple(st for r in rs for st in r.statuses),
                                                    tuple(m for r in rs for m in r.metas),
                                                    next((r.error for r in rs if r.error), None)),
                       self._parts)

    def _write(self, slots: list[int], generations: Sequence[int], src: np.ndarray,
               channel: int) -> Future[WriteResult]:
        fut: Future[WriteResult] = Future()
        if not slots:
            fut.set_result(WriteResult(()))
            return fut
        width = src.shape[1]
        metas = tuple(PageMeta(s, int(g), width, page_checksum(src[i].data))
                      for i, (s, g) in enumerate(zip(slots, generations)))
        parts = Pages(metas, src.data.cast("B")).encode()

        def on_reply(body: Body) -> WriteResult:
            if not isinstance(body, WriteAck) or len(body.statuses) != len(slots):
                return _failed_write(slots, f"peer answered a write with {type(body).__name__}")
            return WriteResult(body.statuses, metas)

        self._submit(channel, _Req(Kind.WRITE, channel, parts, fut, on_reply,
                                   lambda why: _failed_write(slots, why, metas)))
        return fut

    def call(self, method: str, body: bytes, channel: int = 0) -> Future[CallResult]:
        fut: Future[CallResult] = Future()

        def on_reply(reply: Body) -> CallResult:
            if not isinstance(reply, Reply):
                return CallResult(False, b"", f"peer answered a call with {type(reply).__name__}")
            return CallResult(reply.ok, reply.body, None if reply.ok else reply.body.decode(errors="replace"))

        self._submit(channel, _Req(Kind.CALL, channel, Call(method, body).encode(), fut, on_reply,
                                   lambda why: CallResult(False, b"", why)))
        return fut

    def stats(self) -> list[LinkStats]:
        return [link.stats() for link in self._links]

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for link in self._links:
            link.close()
        self._parts.shutdown(wait=False)  # queued parts run, find the links closed, and fail

    def _submit(self, channel: int, req: _Req) -> None:
        if self._closed:
            raise StoreClosedError(f"transport to {self.address[0]}:{self.address[1]} is closed")
        self.mux.route(channel).submit(req)


def _failed_write(slots: Sequence[int], why: str, metas: tuple[PageMeta, ...] = ()) -> WriteResult:
    return WriteResult(tuple(WriteStatus.FAILED for _ in slots), metas, why)
