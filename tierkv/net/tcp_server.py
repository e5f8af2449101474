"""The TCP fallback's server: serves a :class:`~tierkv.net.server.SlotStore` over plain sockets.

One listener thread accepts; each connection gets a reader thread that checks every
message and hands it to a small shared worker pool, and a sender thread that sends the
replies the workers queue, in order (a reply the client does not take within
``timeout_s`` cuts its connection), so no client's socket ever holds a worker. Receive credits are enforced as RDMA enforces them: each
connection has ``recv_credits`` posted receives (a :class:`~tierkv.net.credits.ReceiveLedger`);
a message beyond them is answered with a NAK (RDMA's RNR NAK), counted in ``naks``, and
the client retries it. A message that fails its checksum or does not parse closes the
connection (the client reconnects and resends). With credentials (``auth``), a connection
is served only once the client has answered the challenge (:mod:`tierkv.net.auth`): any
other message before that, a wrong answer, or no answer within ``timeout_s`` closes it,
and counts in ``auth_failures``. Started by :class:`tierkv.net.PeerServer`.
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tierkv.net import auth
from tierkv.net.auth import ServerAuth
from tierkv.net.credits import ReceiveLedger
from tierkv.net.framing import frame, recv_message, send_buffers
from tierkv.net.server import SlotStore
from tierkv.net.transport import NetConfig
from tierkv.net.wire import (Auth, Body, Call, Challenge, Header, Hello, Kind, Pages, ProtocolError, ReadPages, Welcome,
                             pages_per_message)

log = logging.getLogger(__name__)
REFUSAL_LOG_S = 60.0  # the most often a refused handshake is logged


@dataclass(frozen=True)
class ServerStats:
    connections: int
    requests: int
    naks: int
    protocol_errors: int
    auth_failures: int = 0


class _Wake:
    """Queued to a connection's sender when a worker left part of a reply for it."""


_Item = tuple[Kind, int, int, list[bytes | memoryview]] | _Wake | None


class _Conn:
    """One client connection. A worker sends its reply itself only when nothing is queued
    or half-sent and the socket takes the whole reply at once; anything else goes to the
    connection's own sender thread, so the shared workers never wait on a client's
    socket: a client that reads slowly delays only itself, and a reply it has not taken
    within ``timeout_s`` cuts its connection. ``_wire`` keeps messages whole on the
    socket (replies themselves may go out in any order: each names its request)."""

    def __init__(self, sock: socket.socket, depth: int, timeout_s: float) -> None:
        self.sock = sock
        self.ledger = ReceiveLedger(depth)
        self.timeout_s = timeout_s
        self.open = True
        self._wire = threading.Lock()
        self._rest: list[memoryview] | None = None  # the unsent end of a message (under _wire)
        self._outbox: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self.sender = threading.Thread(target=self._send_loop, name="tierkv-peer-send", daemon=True)
        self.reader: threading.Thread | None = None   # the server's thread reading its requests
        self.scope: auth.Scope = None   # the tenants it may see, once authenticated (None: all)

    def send(self, kind: Kind, channel: int, seq: int, parts: list[bytes | memoryview]) -> None:
        if not self.open:
            return
        if self._outbox.empty() and self._wire.acquire(blocking=False):
            try:
                if self._rest is None:
                    rest = send_buffers(self.sock, frame(kind, channel, self.ledger.take_grants(), seq, parts),
                                        nowait=True)
                    if rest:
                        self._rest = rest
                        self._outbox.put(_Wake())
                    return
            except OSError:  # the client is gone
                _shut(self)
                return
            finally:
                self._wire.release()
        self._outbox.put((kind, channel, seq, parts))

    def stop(self) -> None:
        self._outbox.put(None)

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None or not self.open:
                return
            try:
                with self._wire:
                    if self._rest is not None:
                        send_buffers(self.sock, self._rest, time.monotonic() + self.timeout_s)
                        self._rest = None
                    if not isinstance(item, _Wake):
                        kind, channel, seq, parts = item
                        send_buffers(self.sock, frame(kind, channel, self.ledger.take_grants(), seq, parts),
                                     time.monotonic() + self.timeout_s)
            except OSError:  # the client is gone, stopped reading, or reads too slowly
                _shut(self)
                return


class TcpServer:
    def __init__(self, store: SlotStore, host: str, port: int, config: NetConfig, workers: int = 4,
                 auth: ServerAuth | None = None) -> None:
        self.store = store
        self.config = config
        self.auth = auth
        self._listener = socket.create_server((host, port))  # SO_REUSEADDR: a restarted server rebinds at once
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._workers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tierkv-peer-srv")
        self._conns: set[_Conn] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._counts = {"connections": 0, "requests": 0, "naks": 0, "protocol_errors": 0, "auth_failures": 0}
        self._last_refusal = -REFUSAL_LOG_S
        self._thread = threading.Thread(target=self._accept_loop, name="tierkv-peer-listen", daemon=True)
        self._thread.start()

    def stats(self) -> ServerStats:
        with self._lock:
            return ServerStats(**self._counts)

    def drop_connections(self) -> int:
        """Cut every client connection (a fault switch for tests: clients reconnect and
        resend what was not acknowledged); returns how many were cut."""
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _shut(c)
        return len(conns)

    def close(self) -> None:
        with self._lock:  # from here on no reader takes its connection out of _conns
            if self._closed.is_set():
                return
            self._closed.set()
        self._listener.close()
        self._thread.join(timeout=5)
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _shut(c)
        self._workers.shutdown(wait=True)
        # Each connection's reader and sender end once its socket is shut (the reader
        # within its 0.2 s poll); wait for them, so none outlives the server.
        for c in conns:
            for t in (c.reader, c.sender):
                if t is not None and t.is_alive() and t is not threading.current_thread():
                    t.join(timeout=max(self.config.timeout_s, 1.0))

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([self._listener], [], [], 0.2)
                if not ready:
                    continue
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # The socket stays blocking; the kernel bounds each send and receive instead, so
            # neither direction's timeout leaks into the other. A client that stops reading
            # its replies cannot hold the shared workers: a send that makes no progress for
            # timeout_s fails and the connection is cut. Slow receives are cut the same way.
            secs = max(self.config.timeout_s, 0.001)
            tv = struct.pack("ll", int(secs), int((secs % 1) * 1_000_000))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            conn = _Conn(sock, self.config.recv_credits, secs)
            with self._lock:
                self._conns.add(conn)
                self._counts["connections"] += 1
            conn.reader = threading.Thread(target=self._serve, args=(conn,), name="tierkv-peer-conn", daemon=True)
            conn.sender.start()
            conn.reader.start()

    def _serve(self, conn: _Conn) -> None:
        try:
            if not self._greet(conn):
                return
            while not self._closed.is_set():
                ready, _, _ = select.select([conn.sock], [], [], 0.2)
                if not ready:
                    continue
                # A message started must finish in time, however slowly it trickles in.
                header, body, _payload = recv_message(conn.sock, deadline=time.monotonic() + self.config.timeout_s)
                if header.kind in (Kind.HELLO, Kind.AUTH):
                    raise ProtocolError(f"a {header.kind.name} after the handshake")
                if not conn.ledger.consume():  # no receive posted for it: RNR
                    self._count("naks")
                    conn.send(Kind.NAK, header.channel, header.seq, [])
                    continue
                self._count("requests")
                self._workers.submit(self._handle, conn, header, body)
        except ProtocolError as e:
            self._count("protocol_errors")
            log.warning("peer server: closing a connection after a bad message: %s", e)
        except (OSError, ConnectionError, RuntimeError, ValueError):
            pass  # peer gone or too slow, the pool shut down at close, or a worker cut the connection
        finally:
            _shut(conn)
            with self._lock:
                # Once closing, close() takes the set as it stands and joins every thread in
                # it; a reader leaving on the closed flag must not hide its sender from that.
                if not self._closed.is_set():
                    self._conns.discard(conn)

    def _greet(self, conn: _Conn) -> bool:
        """The handshake: HELLO, and with credentials the challenge and its answer, all
        within ``timeout_s``; then WELCOME. False (the connection is to be closed) when the
        client fails it; ProtocolError for a message out of turn."""
        deadline = time.monotonic() + self.config.timeout_s
        header, hello, _ = self._recv_by(conn, deadline)
        if not isinstance(hello, Hello):
            raise ProtocolError(f"a {header.kind.name} before HELLO")
        if self.auth is not None:
            known = self.auth.lookup(hello.principal)
            # An unknown principal is challenged under a random secret, so that a scan
            # cannot tell which names exist (it fails the client's check instead).
            secret, scope = known if known is not None else (auth.nonce(), None)
            mine = auth.nonce()
            proof = auth.server_proof(secret, hello.principal, hello.nonce, mine)
            conn.send(Kind.CHALLENGE, header.channel, header.seq, Challenge(mine, proof).encode())
            if len(hello.nonce) != auth.NONCE_BYTES:  # it learns from the challenge that it needs one
                return self._refuse(conn, hello.principal, "no credential (a hello without a nonce)")
            try:
                header, answer, _ = self._recv_by(conn, deadline)
            except (OSError, ConnectionError):
                if self._closed.is_set():
                    raise
                return self._refuse(conn, hello.principal, "no answer to the challenge (the client could not "
                                    "verify this server: a different secret?)")
            if not isinstance(answer, Auth):
                raise ProtocolError(f"a {header.kind.name} where the answer to the challenge belongs")
            if known is None or not auth.same(answer.proof, auth.client_proof(secret, hello.principal, mine,
                                                                              hello.nonce)):
                return self._refuse(conn, hello.principal, "a wrong answer to the challenge")
            conn.scope = scope
        w = Welcome(self.store.epoch, self.store.num_slots, self.store.slot_bytes, conn.ledger.depth)
        conn.send(Kind.WELCOME, header.channel, header.seq, w.encode())
        return True

    def _recv_by(self, conn: _Conn, deadline: float) -> tuple[Header, Body, object]:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._closed.is_set():
                raise ConnectionError("the handshake did not finish in time")
            ready, _, _ = select.select([conn.sock], [], [], min(left, 0.2))
            if ready:
                return recv_message(conn.sock, deadline=deadline)

    def _refuse(self, conn: _Conn, principal: str, why: str) -> bool:
        self._count("auth_failures")
        peer = _peer_name(conn.sock)
        now = time.monotonic()
        with self._lock:
            quiet = now - self._last_refusal < REFUSAL_LOG_S
            if not quiet:
                self._last_refusal = now
        if not quiet:  # one line a minute at most: a scan must not flood the log
            log.warning("peer server: refused %s (principal %r): %s; %d refused so far", peer,
                        principal or "(cluster)", why, self.stats().auth_failures)
        return False

    def _handle(self, conn: _Conn, header: Header, body: Body) -> None:
        try:
            kind, parts = self._reply(body, conn.scope)
            conn.ledger.repost()
            conn.send(kind, header.channel, header.seq, parts)
        except Exception as e:  # noqa: BLE001 - a worker must not die silently with the credit taken
            self._count("protocol_errors")
            log.warning("peer server: closing a connection after a request it could not answer: %s", e)
            _shut(conn)

    def _reply(self, body: Body, scope: auth.Scope) -> tuple[Kind, list[bytes | memoryview]]:
        if isinstance(body, ReadPages):
            if len(body.slots) > pages_per_message(self.store.slot_bytes):
                raise ProtocolError(f"a read of {len(body.slots)} pages; a reply carries at most "
                                    f"{pages_per_message(self.store.slot_bytes)} of {self.store.slot_bytes} bytes")
            metas, parts = self.store.read(body.slots, body.keys or None, scope)
            head = Pages(metas, memoryview(b"")).encode()
            return Kind.PAGES, head + list(parts)
        if isinstance(body, Pages):
            return Kind.WRITE_ACK, self.store.write(body).encode()
        if isinstance(body, Call):
            return Kind.REPLY, self.store.call(body, scope).encode()
        raise ProtocolError(f"a client sent a {type(body).__name__}")


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "a client"
    return f"{host}:{port}"


def _shut(conn: _Conn) -> None:
    conn.open = False
    conn.stop()
    try:
        conn.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.sock.close()

