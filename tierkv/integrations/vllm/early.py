"""Loads announced when the scheduler decides them, before the step's plan reaches the worker.

vLLM hands a step's connector metadata to the worker only when the step runs: on this
CPU engine 3-7 ms after the scheduler allocated a request's blocks and chose to load its
pages (docs/benchmarks.md). A load from NVMe spends those milliseconds later, waiting for
its first layer. So the scheduler half also sends each :class:`LoadJob` straight to the
worker half when it makes it (:meth:`EarlySender.send`, from ``update_state_after_alloc``),
and the worker starts its get at once (:meth:`ConnectorWorker.start_early
<tierkv.integrations.vllm.transfer.ConnectorWorker.start_early>`); the plan that follows
names the job by its serial and the worker takes the load already under way. The plan
stays the truth: a job it does not name is never copied into vLLM's blocks (a get
started early for it is given back), and a message that arrives after its plan is
ignored.

The channel is a Unix stream socket in the abstract namespace, named after vLLM's
``engine_id`` (one per engine, data-parallel ranks apart), that the worker listens on.
Only a peer of the worker's own user is heard (``SO_PEERCRED``). Frames are
``<I length>`` then a JSON header (length-prefixed) then the tokens as ``<u4``. The
scheduler sends only to a listener of its own user (``SO_PEERCRED`` again: the name is
predictable, and another user could bind it first), and each job carries its planner's
random ``origin``, so that a worker ignores notes of another planner that found the same
name (a second engine given the same ``engine_id``). A send never blocks the scheduler
for long and never raises: without a listener, or with one that does not keep up, the
worker hears of the load from the plan, as without this.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from tierkv.errors import InputError
from tierkv.integrations.vllm.plan import LoadJob, store_accept

log = logging.getLogger(__name__)

#: Seconds a send may wait for room in the socket before the frame is dropped (and the
#: connection with it: a partial frame cannot be taken back).
SEND_TIMEOUT_S = 0.05
#: Seconds between attempts to connect to a worker that was not listening.
RECONNECT_S = 1.0
#: Largest frame a listener accepts (tokens of a 1M-token context and their header).
MAX_FRAME = 8 << 20

_LEN = struct.Struct("<I")
_PEERCRED = struct.Struct("iII")   # pid, uid, gid


def channel_address(engine_id: str) -> bytes:
    """The abstract socket name of ``engine_id``'s worker (hashed: names are at most 107 bytes)."""
    return b"\0tierkv-vllm-early-" + hashlib.sha256(engine_id.encode()).hexdigest()[:32].encode()


def encode(job: LoadJob) -> bytes:
    """``job`` as one frame (with when it was sent, ``time.monotonic()``: one clock per machine)."""
    head = json.dumps({"sent": time.monotonic(), "serial": job.serial, "origin": job.origin, "req_id": job.req_id,
                       "tenant": job.tenant, "skip": job.skip,
                       "block_ids": list(job.block_ids), "requested": job.requested, "lend": job.lend,
                       "accept": job.accept}).encode()
    tokens = np.ascontiguousarray(job.tokens, dtype="<u4").tobytes()
    body = _LEN.pack(len(head)) + head + tokens
    return _LEN.pack(len(body)) + body


def decode(body: bytes) -> tuple[LoadJob, float]:
    """A frame's body (without its length) as a job and when it was sent; ValueError when
    it is not one."""
    (n,) = _LEN.unpack_from(body)
    head = json.loads(body[_LEN.size:_LEN.size + n])
    raw = body[_LEN.size + n:]
    if len(raw) % 4:
        raise ValueError(f"{len(raw)} bytes of tokens is not a whole number of uint32")
    job = LoadJob(str(head["req_id"]), str(head["tenant"]), np.frombuffer(raw, dtype="<u4").copy(),
                  int(head["skip"]), tuple(int(b) for b in head["block_ids"]), int(head["requested"]),
                  lend=bool(head["lend"]), serial=int(head["serial"]), origin=int(head["origin"]),
                  accept=_accept(head.get("accept")))
    return job, float(head["sent"])


def _accept(value: object) -> str:
    """A frame's ``accept``: what :func:`~tierkv.integrations.vllm.plan.store_accept`
    takes, else "exact" (a job never takes more than it was planned with)."""
    try:
        store_accept(value)   # type: ignore[arg-type]
    except (InputError, AttributeError, TypeError):
        return "exact"
    return str(value)


class EarlySender:
    """The scheduler's end: sends each job to the worker listening at ``address``."""

    def __init__(self, address: bytes) -> None:
        self.address = address
        self._sock: socket.socket | None = None
        self._next_try = 0.0
        self.sent = 0
        self.dropped = 0

    def send(self, job: LoadJob) -> None:
        """Tell the worker about ``job`` now, if it listens; never raises (the plan carries
        the job whatever happens here)."""
        try:
            sock = self._connect()
            if sock is None:
                self.dropped += 1
                return
            sock.sendall(encode(job))
            self.sent += 1
        except Exception as exc:   # noqa: BLE001 - a timeout too: the frame may be cut, so the connection goes
            log.info("tierkv: announcing a load to the worker failed (%s); it starts with the step", exc)
            self.dropped += 1
            self._close()

    def _connect(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + RECONNECT_S
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(SEND_TIMEOUT_S)
            sock.connect(self.address)
            pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError as exc:
            sock.close()
            log.debug("tierkv: no worker listens for early loads (%s)", exc)
            return None
        if uid != os.getuid():
            sock.close()
            self._next_try = float("inf")   # never again: loads start with their steps
            log.warning("tierkv: the early-load socket of this engine is held by pid %d of uid %d, not this user "
                        "(uid %d); sending it nothing", pid, uid, os.getuid())
            return None
        self._sock = sock
        return sock

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._next_try = max(self._next_try, time.monotonic() + RECONNECT_S)

    def close(self) -> None:
        self._close()


class EarlyListener:
    """The worker's end: calls ``on_job(job, sent)`` (on its own thread; ``sent``: when the
    scheduler sent it, ``time.monotonic()``) for each job a peer of this process's user
    sends to ``address``. ``OSError`` from the constructor when the name is
    taken (another worker of the same engine listens)."""

    def __init__(self, address: bytes, on_job: Callable[[LoadJob, float], object]) -> None:
        self.address = address
        self._on_job = on_job
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(address)
            self._sock.listen(4)
        except OSError:
            self._sock.close()
            raise
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.refused = 0
        self._thread = threading.Thread(target=self._accept, name="tierkv-vllm-early", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)   # out of descriptors: accept again shortly, never stop listening
                continue
            try:
                pid, uid, _gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                  _PEERCRED.size))
            except OSError:
                conn.close()
                continue
            if uid != os.getuid():
                log.warning("tierkv: refused early loads from pid %d of uid %d (this worker runs as uid %d)",
                            pid, uid, os.getuid())
                self.refused += 1
                conn.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="tierkv-vllm-early-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                head = _recv_exact(conn, _LEN.size)
                if head is None:
                    return
                (n,) = _LEN.unpack(head)
                if n > MAX_FRAME:
                    log.warning("tierkv: an early-load frame of %d bytes (at most %d); closing its connection",
                                n, MAX_FRAME)
                    return
                body = _recv_exact(conn, n)
                if body is None:
                    return
                try:
                    job, sent = decode(body)
                except Exception as exc:   # noqa: BLE001 - whatever the frame holds, only its connection ends
                    log.warning("tierkv: a malformed early-load frame (%s); closing its connection", exc)
                    return
                try:
                    self._on_job(job, sent)
                except Exception:   # noqa: BLE001 - the plan still carries the job
                    log.exception("tierkv: starting an early load for %s failed", job.req_id)
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None at the end of the stream (a partial frame is dropped)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)
