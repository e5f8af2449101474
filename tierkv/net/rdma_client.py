"""The RDMA transport's client side: :class:`RdmaTransport` (see :mod:`tierkv.net.rdma`).

A TCP control connection (:class:`~tierkv.net.tcp.TcpTransport`) carries the
out-of-band exchange; ``NetConfig.links`` RC QPs behind a :class:`~tierkv.net.mux.Mux`
carry the data. Per QP (:class:`_Link`): a poster thread (takes queued operations, holds
a window slot and the receive credits each needs, posts its work requests), a progress
thread (polls both CQs: completions advance operations, replies carry credits), and
the caller never blocks. Local buffers come from one registered
:class:`~tierkv.net.pool.PagePool` (the MR is registered once).

Failure: a completion with an error status, or an operation past its deadline, tears the
QP down (which stops any DMA into our buffers), fails every operation on it (misses), and
a background thread builds a new QP once the control connection is back. Unlike TCP,
operations in flight on a failed QP are not resent: they fail, and the caller's next
read or write goes to the new QP.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyverbs.enums as e

from tierkv.errors import StoreClosedError, TierUnavailableError
from tierkv.net.credits import CreditGate
from tierkv.net.mux import Mux
from tierkv.net.pool import Block, PagePool
from tierkv.net.rdma import CTRL_BYTES, Device, Endpoint, connect_qp, frame_into, make_qp, post_recv, post_send, unframe
from tierkv.net.server import META_DTYPE
from tierkv.net.tcp import TcpTransport
from tierkv.net.transport import CallResult, LinkStats, NetConfig, PeerInfo, ReadResult, Transport, WriteResult
from tierkv.net.verify import check_rows, copy_accepted, failed_read
from tierkv.net.wire import Call, Kind, PageMeta, Pages, Reply, WriteAck, WriteStatus, page_checksum

SEND_DEPTH = 256


@dataclass
class _Op:
    seq: int
    deadline: float
    fail: Callable[[str], object]
    future: Future[Any]
    start: Callable[[_Link, _Op], None]
    credits: int = 0
    wrs: int = 0                       # signaled work requests not yet completed
    blocks: list[Block] = field(default_factory=list)
    then: Callable[[], None] | None = None  # when wrs reaches 0
    on_reply: Callable[[Any], object] | None = None


class _Link:
    def __init__(self, t: RdmaTransport) -> None:
        self.t, cfg = t, t.config
        self.pool, d = t.pool, t.device
        self.qp_lock = threading.Lock()
        self.destroyed = False
        self.qp, self.scq, self.rcq = make_qp(d, SEND_DEPTH, cfg.window)
        psn = int(time.time_ns() & 0xFFFFFF)
        mine = Endpoint(self.qp.qp_num, psn, d.gid)
        res = t.control.call("rdma-connect", json.dumps(mine.to_dict()).encode()).result(cfg.timeout_s + 1)
        if not res.ok:
            self._destroy()
            raise TierUnavailableError(f"rdma-connect refused: {res.error}")
        self.remote = json.loads(res.body)
        connect_qp(d, self.qp, psn, Endpoint(self.remote["qpn"], self.remote["psn"], self.remote["gid"]))
        self.gate = CreditGate(self.remote["credits"], enabled=cfg.credits)
        self.sq = threading.BoundedSemaphore(SEND_DEPTH)
        self.window = threading.BoundedSemaphore(cfg.window)
        self.lock = threading.Lock()
        self.ops: dict[int, _Op] = {}
        self.wrs: dict[int, tuple[_Op, Block | None]] = {}
        self.wr_ids = itertools.count(1 << 20)
        self.recv_blocks: dict[int, Block] = {}
        for i in range(cfg.window):
            b = self._block(CTRL_BYTES)
            self.recv_blocks[i] = b
            post_recv(self.qp, i, self._addr(b), CTRL_BYTES, t.mr.lkey)
        self.queue: queue.Queue[_Op | Callable[[], None] | None] = queue.Queue()
        self.alive = True
        self.counts = {"sent": 0, "expired": 0}
        threading.Thread(target=self._post_loop, daemon=True, name="tierkv-rdma-post").start()
        self.progress = threading.Thread(target=self._progress_loop, daemon=True, name="tierkv-rdma-progress")
        self.progress.start()

    # -- resources ------------------------------------------------------------------------
    def _block(self, n: int) -> Block:
        b = self.pool.allocate(n)
        if b is None:
            raise TierUnavailableError(f"registered pool exhausted ({self.pool.capacity_bytes} bytes)")
        return b

    def _addr(self, b: Block) -> int:
        return int(self.pool.buffer.ctypes.data) + b.offset

    def post(self, op: _Op, opcode: int, b: Block, length: int, remote_addr: int = 0, rkey: int = 0,
             imm: int = 0, own: bool = False) -> None:
        while not self.sq.acquire(timeout=0.1):
            if not self.alive:
                raise TierUnavailableError("RDMA link down")
        wr_id = next(self.wr_ids)
        with self.lock:
            op.wrs += 1
            self.wrs[wr_id] = (op, b if own else None)
        with self.qp_lock:  # never post on a QP that _destroy is closing (a use after free in C)
            if self.destroyed:
                raise TierUnavailableError("RDMA link down")
            post_send(self.qp, wr_id, opcode, self._addr(b), length, self.t.mr.lkey, remote_addr, rkey, imm)
        self.counts["sent"] += 1

    def run(self, op: _Op, start: Callable[[_Link, _Op], None]) -> None:
        """Post an operation's work requests; ``op.then`` runs (on the poster thread) once
        all of them completed. A guard count keeps an early completion from firing it."""
        with self.lock:
            op.wrs += 1
        start(self, op)
        self.done_wr(op)

    def done_wr(self, op: _Op) -> None:
        with self.lock:
            op.wrs -= 1
            then = op.then if op.wrs == 0 else None
            if then is not None:
                op.then = None
        if then is not None:
            self.queue.put(then)

    def send_ctrl(self, op: _Op, kind: Kind, channel: int, parts: list[bytes | memoryview]) -> None:
        b = self._block(CTRL_BYTES)
        n = frame_into(self.pool.buffer[b.offset:b.offset + CTRL_BYTES], kind, channel, 0, op.seq, parts)
        self.post(op, e.IBV_WR_SEND, b, n, own=True)

    # -- operation lifecycle --------------------------------------------------------------
    def submit(self, op: _Op) -> None:
        if not self.alive:
            op.future.set_result(op.fail("RDMA link down"))
            return
        self.queue.put(op)

    def finish(self, op: _Op, result: object) -> None:
        with self.lock:
            if self.ops.pop(op.seq, None) is None:
                return
        for b in op.blocks:
            self.pool.free(b)
        self.window.release()
        if not op.future.done():
            op.future.set_result(result)

    def _post_loop(self) -> None:
        while self.alive:
            op = self.queue.get()
            if callable(op) and not isinstance(op, _Op):  # a continuation (a read's second phase)
                try:
                    op()
                except Exception as err:  # noqa: BLE001 - a post on a broken QP: the link is down
                    self.t.link_failed(self, str(err))
                continue
            if op is None or not self.alive:
                if op is not None:
                    op.future.set_result(op.fail("RDMA link down"))
                continue
            left = op.deadline - time.monotonic()
            if not self.window.acquire(timeout=max(0.0, left)):
                op.future.set_result(op.fail("RDMA send window stayed full"))
                continue
            with self.lock:
                self.ops[op.seq] = op
            if not all(self.gate.acquire(max(0.0, op.deadline - time.monotonic())) for _ in range(op.credits)):
                self.finish(op, op.fail("no receive credits from the peer in time"))
                continue
            try:
                self.run(op, op.start)
            except Exception as err:  # noqa: BLE001 - a post on a broken QP: the link is down
                self.finish(op, op.fail(f"RDMA post failed: {err}"))
                self.t.link_failed(self, str(err))

    def _progress_loop(self) -> None:
        try:
            self._progress()
        finally:
            if not self.alive:
                self._release()

    def _progress(self) -> None:
        idle = 0.0
        while self.alive:
            if self.t.stale(self):  # the peer restarted or its control connection dropped
                self.why, self.alive = "peer lost (control connection down or a new epoch)", False
                self.gate.close()
                self.queue.put(None)
                return
            try:
                busy = self._poll()
            except Exception as err:  # noqa: BLE001 - an error completion: the QP is in error
                self.why, self.alive = str(err), False
                self.gate.close()
                self.queue.put(None)
                return
            now = time.monotonic()
            with self.lock:
                late = [op for op in self.ops.values() if op.deadline <= now]
            if late:
                self.counts["expired"] += len(late)
                self.why, self.alive = f"{len(late)} operations past their deadline", False
                self.gate.close()
                self.queue.put(None)
                return
            idle = 0.0 if busy else min(0.002, idle + 0.0002)
            if idle:
                time.sleep(idle)

    def _poll(self) -> bool:
        n, wcs = self.scq.poll(32)
        for wc in wcs[:n]:
            self.sq.release()
            with self.lock:
                op, own = self.wrs.pop(wc.wr_id, (None, None))
            if own is not None:
                self.pool.free(own)
            if wc.status != e.IBV_WC_SUCCESS:
                raise TierUnavailableError(f"work completion status {wc.status}")
            if op is not None:
                self.done_wr(op)
        m, rwcs = self.rcq.poll(16)
        for wc in rwcs[:m]:
            if wc.status != e.IBV_WC_SUCCESS:
                raise TierUnavailableError(f"receive completion status {wc.status}")
            b = self.recv_blocks[wc.wr_id]
            header, body = unframe(self.pool.buffer[b.offset:b.offset + CTRL_BYTES], wc.byte_len)
            post_recv(self.qp, wc.wr_id, self._addr(b), CTRL_BYTES, self.t.mr.lkey)
            self.gate.grant(header.credits)
            with self.lock:
                op = self.ops.get(header.seq)
            if op is not None and op.on_reply is not None:
                self.finish(op, op.on_reply(body))
        return n + m > 0

    def teardown(self, why: str) -> None:
        """Stop the link. The QP is destroyed before any buffer is freed (no late DMA), on
        the progress thread, which is the only one touching the CQs."""
        self.why = why
        self.alive = False
        self.gate.close()
        self.queue.put(None)
        if threading.current_thread() is self.progress:
            self._release()
        else:
            self.progress.join(5)

    def _release(self) -> None:
        why = getattr(self, "why", "closed")
        self._destroy()
        with self.lock:
            ops = list(self.ops.values())
        for op in ops:
            self.finish(op, op.fail(f"RDMA link lost: {why}"))
        for b in self.recv_blocks.values():
            self.pool.free(b)
        self.recv_blocks.clear()

    def _destroy(self) -> None:
        with self.qp_lock:
            self.destroyed = True
        for o in (self.qp, self.scq, self.rcq):
            try:
                o.close()
            except Exception:  # noqa: BLE001 - already gone
                pass


class RdmaTransport(Transport):
    """The client side of one peer over RDMA; see the module docstring. Raises
    TierUnavailableError at construction when the peer, the device or the QP setup fails."""

    def __init__(self, host: str, port: int, config: NetConfig | None = None) -> None:
        self.config = config or NetConfig()
        self.control = TcpTransport(host, port, NetConfig(timeout_s=self.config.timeout_s, links=1,
                                                          connect_timeout_s=self.config.connect_timeout_s))
        self.address = (host, port)
        self._closed = False
        self.seqs = itertools.count(1)
        try:
            self.device = Device(_local_address(host))
            self.pool = PagePool(self.config.pool_bytes)
            self.mr = self.device.register(self.pool.buffer)
            self.links = [_Link(self) for _ in range(max(1, self.config.links))]
        except Exception:
            self.control.close()
            raise
        self.mux: Mux[int] = Mux(list(range(len(self.links))))
        self.reconnects = 0
        self._fixing = threading.Lock()

    @property
    def info(self) -> PeerInfo:  # type: ignore[override]
        r = self.links[0].remote
        return PeerInfo(r["epoch"], r["num_slots"], r["slot_bytes"])

    @property
    def connected(self) -> bool:
        return all(not self.stale(link) for link in self.links)

    def stale(self, link: _Link) -> bool:
        """A link is unusable when it failed, the control connection is down (the peer is
        most likely gone: fail fast rather than wait out RC retries), or the peer restarted."""
        return (not link.alive or not self.control.connected
                or link.remote["epoch"] != self.control.info.epoch)

    def wait_connected(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.connected:
                return True
            self._repair()
            time.sleep(0.05)
        return self.connected

    # -- operations -------------------------------------------------------------------------
    def read(self, slots: Sequence[int], dst: np.ndarray, expect: Sequence[PageMeta | None] | None = None,
             channel: int = 0) -> Future[ReadResult]:
        slots = [int(s) for s in slots]
        check_rows(dst, len(slots), self.info.slot_bytes, "read destination")
        fut: Future[ReadResult] = Future()
        if not slots:
            fut.set_result(ReadResult((), ()))
            return fut
        n, sb = len(slots), self.info.slot_bytes

        def start(link: _Link, op: _Op) -> None:
            mb = link._block(n * META_DTYPE.itemsize)
            op.blocks.append(mb)
            op.then = lambda: link.run(op, phase2)
            for i, s in enumerate(slots):  # phase 1: each page's meta, one-sided
                b = Block(mb.offset + i * META_DTYPE.itemsize, META_DTYPE.itemsize, META_DTYPE.itemsize)
                link.post(op, e.IBV_WR_RDMA_READ, b, b.length, link.remote["meta_addr"] + s * META_DTYPE.itemsize,
                          link.remote["meta_rkey"])

        def phase2(link: _Link, op: _Op) -> None:
            mb = op.blocks[0]
            rec = np.frombuffer(self.pool.buffer[mb.offset:mb.offset + n * META_DTYPE.itemsize].tobytes(), META_DTYPE)
            metas = [PageMeta(int(r["slot"]), int(r["generation"]), int(r["length"]), int(r["checksum"])) for r in rec]
            blocks: list[Block | None] = []
            for s, m in zip(slots, metas):  # phase 2: the bytes of every page the peer holds
                if m.generation == 0 or not dst.shape[1] <= m.length <= sb:
                    blocks.append(None)
                    continue
                b = link._block(m.length)
                op.blocks.append(b)
                blocks.append(b)
                link.post(op, e.IBV_WR_RDMA_READ, b, m.length, link.remote["slots_addr"] + s * sb,
                          link.remote["slots_rkey"])
            op.then = lambda: link.finish(op, self._verify(slots, metas, blocks, dst, expect))

        self._submit(channel, fut, start, lambda why: failed_read(slots, why), credits=0)
        return fut

    def _verify(self, slots: list[int], metas: list[PageMeta], blocks: list[Block | None], dst: np.ndarray,
                expect: Sequence[PageMeta | None] | None) -> ReadResult:
        datas = [self.pool.view(b).data if b is not None else memoryview(b"") for b in blocks]
        return copy_accepted(metas, datas, slots, dst, expect)

    def write(self, slots: Sequence[int], generations: Sequence[int], src: np.ndarray,
              channel: int = 0) -> Future[WriteResult]:
        slots = [int(s) for s in slots]
        check_rows(src, len(slots), self.info.slot_bytes, "write source")
        fut: Future[WriteResult] = Future()
        if not slots:
            fut.set_result(WriteResult(()))
            return fut
        width, sb = src.shape[1], self.info.slot_bytes
        metas = tuple(PageMeta(s, int(g), width, page_checksum(src[i].data))
                      for i, (s, g) in enumerate(zip(slots, generations)))

        def start(link: _Link, op: _Op) -> None:
            db = link._block(len(slots) * width)
            op.blocks.append(db)
            self.pool.buffer[db.offset:db.offset + db.length] = src.reshape(-1)
            link.send_ctrl(op, Kind.WRITE, channel, Pages(metas, memoryview(b"")).encode())
            for i, s in enumerate(slots):
                b = Block(db.offset + i * width, width, width)
                last = i == len(slots) - 1
                link.post(op, e.IBV_WR_RDMA_WRITE_WITH_IMM if last else e.IBV_WR_RDMA_WRITE, b, width,
                          link.remote["slots_addr"] + s * sb, link.remote["slots_rkey"], imm=op.seq if last else 0)

        def on_reply(body: object) -> WriteResult:
            if not isinstance(body, WriteAck) or len(body.statuses) != len(slots):
                return _failed_write(slots, metas, f"peer answered a write with {type(body).__name__}")
            return WriteResult(body.statuses, metas)

        self._submit(channel, fut, start, lambda why: _failed_write(slots, metas, why), credits=2, on_reply=on_reply)
        return fut

    def call(self, method: str, body: bytes, channel: int = 0) -> Future[CallResult]:
        fut: Future[CallResult] = Future()

        def start(link: _Link, op: _Op) -> None:
            link.send_ctrl(op, Kind.CALL, channel, Call(method, body).encode())

        def on_reply(reply: object) -> CallResult:
            if not isinstance(reply, Reply):
                return CallResult(False, b"", f"peer answered a call with {type(reply).__name__}")
            return CallResult(reply.ok, reply.body, None if reply.ok else reply.body.decode(errors="replace"))

        self._submit(channel, fut, start, lambda why: CallResult(False, b"", why), credits=1, on_reply=on_reply)
        return fut

    def stats(self) -> list[LinkStats]:
        return [LinkStats(link.counts["sent"], 0, 0, link.counts["expired"], self.reconnects, link.gate.waits)
                for link in self.links]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for link in self.links:
            link.teardown("transport closed")
        self.mr.close()
        self.device.close()
        self.control.close()

    # -- plumbing ---------------------------------------------------------------------------
    def _submit(self, channel: int, fut: Future[Any], start: Callable[[_Link, _Op], None],
                fail: Callable[[str], object], credits: int, on_reply: Callable[[Any], object] | None = None) -> None:
        if self._closed:
            raise StoreClosedError(f"transport to {self.address[0]}:{self.address[1]} is closed")
        link = self.links[self.mux.link_index(channel)]
        self.mux.route(channel)
        if self.stale(link):
            self._repair()
            link = self.links[self.mux.link_index(channel)]
            if self.stale(link):
                fut.set_result(fail("RDMA link down; the peer is not reachable now"))
                return
        seq = next(self.seqs) & 0x7FFFFFFF
        op = _Op(seq, time.monotonic() + self.config.timeout_s, fail, fut, start, credits, on_reply=on_reply)
        if credits == 0:  # one-sided only: finished by its last completion, not by a reply
            op.on_reply = None
        link.submit(op)

    def link_failed(self, link: _Link, why: str) -> None:
        if link.alive:
            link.teardown(why)

    def _repair(self) -> None:
        """Replace dead links with new QPs when the control connection is up (non-blocking
        when another thread is already at it)."""
        if self._closed or not self._fixing.acquire(blocking=False):
            return
        try:
            if not self.control.connected:
                return
            for i, link in enumerate(self.links):
                if self.stale(link):
                    if link.alive:
                        link.teardown("replaced after the peer came back")
                    try:
                        self.links[i] = _Link(self)
                        self.reconnects += 1
                    except Exception:  # noqa: BLE001 - the peer is not back yet
                        return
        finally:
            self._fixing.release()


def _failed_write(slots: Sequence[int], metas: tuple[PageMeta, ...], why: str) -> WriteResult:
    return WriteResult(tuple(WriteStatus.FAILED for _ in slots), metas, why)


def _local_address(peer: str) -> str:
    """This node's address on the route to ``peer`` (whose GID the QP uses)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return str(s.getsockname()[0])
