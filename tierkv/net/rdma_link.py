"""One RC QP of an :class:`~tierkv.net.rdma_client.RdmaTransport`: its threads, its work
requests, and what happens when it fails.

A :class:`Link` serves one of the transport's send windows (one per mux link), which
outlives it. Three threads: a *feeder* takes the oldest unsent operation from the window
once it holds the receive credits the operation needs and hands it to the *poster*,
which posts work requests (an operation's start and its continuations, in order; the
only thread that may block on the send queue); the *progress* thread polls both CQs
(completions advance attempts, replies carry credits and answers) and, while operations
wait for answers with nothing outstanding, probes the peer with a one-sided READ so a
QP the server moved to ERR or dropped shows up as an error completion instead of a
silent wait.

Failure (an error completion, a post that fails, the peer lost, an operation past its
deadline): the progress thread destroys the QP first (no DMA after that), stops the
other two threads, retires every attempt on it (their blocks go back to the pool) and
tells the transport, whose reconnector builds a new Link; the new Link rewinds the
window, so every unacknowledged operation is started again on the new QP.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyverbs.enums as e

from tierkv.errors import TierUnavailableError
from tierkv.net.credits import CreditGate
from tierkv.net.inflight import Op
from tierkv.net.pool import Block
from tierkv.net.rdma import CTRL_BYTES, Endpoint, connect_qp, frame_into, make_qp, post_recv, post_send, unframe
from tierkv.net.server import META_DTYPE
from tierkv.net.wire import Kind

if TYPE_CHECKING:
    from tierkv.net.rdma_client import RdmaTransport

SEND_DEPTH = 256
PROBE_IDLE_S = 0.5     # answers awaited and no completion for this long: probe the peer
PROBE_TIMEOUT_S = 2.0  # a probe unanswered this long: the QP is dead (rxe may never time out)
Step = Callable[["Link", Op], None]


class NoBlock(Exception):
    """The registered pool cannot fit a block now: the operation is retried later."""


class Link:
    """Raises TierUnavailableError when the peer refuses the QP or cannot be reached."""

    def __init__(self, t: RdmaTransport, index: int) -> None:
        self.t, cfg = t, t.config
        self.index, self.window, self.counts = index, t.windows[index], t.counts[index]
        self.pool, d = t.pool, t.device
        self.qp_lock, self.lock = threading.Lock(), threading.Lock()
        self.destroyed, self.alive, self.why = False, False, ""
        self.released = threading.Event()
        self.qp, self.scq, self.rcq = make_qp(d, SEND_DEPTH, cfg.window)
        self.recv_blocks: dict[int, Block] = {}
        self.probe: Block | None = None
        try:
            psn = int(time.time_ns() & 0xFFFFFF)
            mine = Endpoint(self.qp.qp_num, psn, d.gid).to_dict() | {"client": t.client_id, "link": index}
            res = t.control.call("rdma-connect", json.dumps(mine).encode()).result(cfg.timeout_s + 1)
            if not res.ok:
                raise TierUnavailableError(f"rdma-connect refused: {res.error}")
            self.remote: dict[str, Any] = json.loads(res.body)
            for i in range(cfg.window):
                b = self.block(CTRL_BYTES)
                self.recv_blocks[i] = b
                post_recv(self.qp, i, self.addr(b), CTRL_BYTES, t.mr.lkey)
            self.probe = self.block(META_DTYPE.itemsize)
            connect_qp(d, self.qp, psn, Endpoint(self.remote["qpn"], self.remote["psn"], self.remote["gid"]))
        except Exception as err:
            self._destroy()
            self._free_local()
            raise TierUnavailableError(f"cannot set up an RDMA QP: {err}") from None
        self.gate = CreditGate(self.remote["credits"], enabled=cfg.credits)
        self.sq = threading.BoundedSemaphore(SEND_DEPTH)
        self.ops: dict[int, Op] = {}                                   # wire seq -> op with an attempt here
        self.wrs: dict[int, tuple[Op | None, int, Block | None]] = {}  # wr_id -> (op, attempt, own block)
        self.wr_ids = itertools.count(1 << 20)
        self.queue: queue.Queue[Op | tuple[Op, int, Step] | None] = queue.Queue()
        self.probing, self.last_activity, self.probe_at = False, time.monotonic(), 0.0
        self.alive = True
        self.window.rewind()  # what an earlier QP left unacknowledged goes out first, in order
        self.threads = [threading.Thread(target=fn, daemon=True, name=f"tierkv-rdma-{name}")
                        for fn, name in ((self._feed_loop, "feed"), (self._post_loop, "post"),
                                         (self._progress_loop, "progress"))]
        for th in self.threads:
            th.start()

    # -- resources ------------------------------------------------------------------------
    def block(self, n: int) -> Block:
        b = self.pool.allocate(n)
        if b is None:
            raise NoBlock(f"registered pool full ({self.pool.in_use_bytes} of {self.pool.capacity_bytes} bytes)")
        return b

    def addr(self, b: Block) -> int:
        return int(self.pool.buffer.ctypes.data) + b.offset

    def post(self, op: Op | None, opcode: int, b: Block, length: int, remote_addr: int = 0, rkey: int = 0,
             imm: int = 0, own: bool = False) -> None:
        while not self.sq.acquire(timeout=0.1):
            if not self.alive:
                raise TierUnavailableError("RDMA link down")
        wr_id = next(self.wr_ids)
        with self.lock:
            if op is not None:
                op.wrs += 1
            self.wrs[wr_id] = (op, op.attempt if op is not None else 0, b if own else None)
        with self.qp_lock:  # never post on a QP that _destroy is closing (a use after free in C)
            if self.destroyed:
                raise TierUnavailableError("RDMA link down")
            post_send(self.qp, wr_id, opcode, self.addr(b), length, self.t.mr.lkey, remote_addr, rkey, imm)
        self.counts["sent"] += 1

    def send_ctrl(self, op: Op, kind: Kind, channel: int, parts: list[bytes | memoryview]) -> None:
        b = self.block(CTRL_BYTES)
        n = frame_into(self.pool.buffer[b.offset:b.offset + CTRL_BYTES], kind, channel, 0, op.wire_seq, parts)
        self.post(op, e.IBV_WR_SEND, b, n, own=True)

    # -- an attempt's steps ---------------------------------------------------------------
    def run(self, op: Op, step: Step) -> None:
        """Run ``step`` of the current attempt; ``op.then`` runs (on the poster) once all its
        work requests completed. A guard count keeps an early completion from firing it."""
        attempt = op.attempt
        with self.lock:
            op.wrs += 1
        try:
            step(self, op)
        finally:
            self.done_wr(op, attempt)

    def done_wr(self, op: Op, attempt: int) -> None:
        with self.lock:
            if op.attempt != attempt:
                return
            op.wrs -= 1
            if op.wrs > 0 or op.then is None:
                return
            then, op.then = op.then, None
        self.queue.put((op, attempt, lambda link, o: then()))

    def later(self, op: Op, step: Step) -> None:
        """Run ``step`` on the poster (from the progress thread, which must not post)."""
        self.queue.put((op, op.attempt, step))

    def complete(self, op: Op, make_result: Callable[[], object]) -> None:
        """The answer arrived: finish once the attempt's work requests have completed."""
        with self.lock:
            if self.ops.get(op.wire_seq) is not op:
                return
            if op.wrs > 0:
                op.then = lambda: self.finish(op, make_result)
                return
        self.finish(op, make_result)

    def finish(self, op: Op, make_result: Callable[[], object]) -> None:
        """Resolve ``op`` (unless its deadline already did), then retire its attempt."""
        with self.lock:
            if self.ops.get(op.wire_seq) is not op:
                return
            del self.ops[op.wire_seq]
        claimed = op.resolve(make_result)  # reads the attempt's blocks: before retiring them
        with self.lock:
            op.retire(self.pool)
        if claimed:
            self.window.ack(op.seq)

    def retry(self, op: Op, unused_credits: int) -> None:
        """Start ``op`` again later (the pool here or the staging there was full). Only when
        no work request of the attempt can touch its blocks any more."""
        with self.lock:
            if self.ops.get(op.wire_seq) is not op:
                return
            del self.ops[op.wire_seq]
            op.retire(self.pool)
        self.gate.grant(unused_credits)
        op.retries += 1
        self.window.retry(op.seq, min(0.1, max(self.t.config.rnr_delay_s, 1e-4) * 2 ** min(op.retries, 10)))

    # -- threads --------------------------------------------------------------------------
    def _feed_loop(self) -> None:
        while self.alive:
            entry = self.window.next_unsent(0.1)
            if entry is None or entry.item.done:
                continue
            op = entry.item
            op.seq = entry.seq
            got = 0
            while got < op.credits and self.alive and time.monotonic() < op.deadline:
                got += self.gate.acquire(min(0.1, max(0.0, op.deadline - time.monotonic())))
            if got < op.credits:  # link down (the next QP starts it) or deadline (the reaper fails it)
                self.gate.grant(got)
                if self.alive is False:
                    self.window.retry(entry.seq, 0.0)
                continue
            self.queue.put(op)

    def _post_loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None or not self.alive:
                return
            op = item if isinstance(item, Op) else item[0]
            try:
                if isinstance(item, Op):
                    if op.done:
                        continue
                    with self.lock:
                        op.begin(self)
                        self.ops[op.wire_seq] = op
                    self.run(op, op.start)
                elif op.attempt == item[1]:
                    self.run(op, item[2])
            except NoBlock:
                self.retry(op, op.credits)  # nothing of this attempt was sent yet
            except Exception as err:  # noqa: BLE001 - a post on a broken QP: the link is down
                self.fail(f"RDMA post failed: {err}")
                return

    def _progress_loop(self) -> None:
        idle = 0.0
        try:
            while self.alive:
                if self.t.stale(self):
                    self.why = "peer lost (control connection down or a new epoch)"
                    return
                try:
                    busy = self._poll()
                    self._maybe_probe()
                except Exception as err:  # noqa: BLE001 - an error completion: the QP is in error
                    self.why = str(err)
                    return
                idle = 0.0 if busy else min(0.002, idle + 0.0002)
                if idle:
                    time.sleep(idle)
        finally:
            self.alive = False
            self.gate.close()
            self.queue.put(None)
            self._release()

    def _poll(self) -> bool:
        n, wcs = self.scq.poll(32)
        for wc in wcs[:n]:
            self.sq.release()
            with self.lock:
                op, attempt, own = self.wrs.pop(wc.wr_id, (None, 0, None))
            if own is not None:
                self.pool.free(own)
            if wc.status != e.IBV_WC_SUCCESS:
                raise TierUnavailableError(f"work completion status {wc.status}")
            if op is None:
                self.probing = False
            else:
                self.done_wr(op, attempt)
        m, rwcs = self.rcq.poll(16)
        for wc in rwcs[:m]:
            if wc.status != e.IBV_WC_SUCCESS:
                raise TierUnavailableError(f"receive completion status {wc.status}")
            b = self.recv_blocks[wc.wr_id]
            header, body = unframe(self.pool.buffer[b.offset:b.offset + CTRL_BYTES], wc.byte_len)
            post_recv(self.qp, wc.wr_id, self.addr(b), CTRL_BYTES, self.t.mr.lkey)
            self.gate.grant(header.credits)
            with self.lock:
                op = self.ops.get(header.seq)
            if op is not None and op.on_reply is not None:
                op.on_reply(self, op, body)
        if n + m:
            self.last_activity = time.monotonic()
        return n + m > 0

    def _maybe_probe(self) -> None:
        now = time.monotonic()
        if self.probing:
            if now - self.probe_at > PROBE_TIMEOUT_S:
                raise TierUnavailableError(f"the peer did not answer a probe within {PROBE_TIMEOUT_S} s")
            return
        if self.probe is None or not self.ops or now - self.last_activity < PROBE_IDLE_S:
            return
        if not self.sq.acquire(blocking=False):
            return
        wr_id = next(self.wr_ids)
        with self.lock:
            self.wrs[wr_id] = (None, 0, None)
        self.probing, self.probe_at = True, now
        with self.qp_lock:
            if not self.destroyed:
                post_send(self.qp, wr_id, e.IBV_WR_RDMA_READ, self.addr(self.probe), META_DTYPE.itemsize,
                          self.t.mr.lkey, self.remote["meta_addr"], self.remote["meta_rkey"])

    # -- failure --------------------------------------------------------------------------
    def fail(self, why: str) -> None:
        """Stop the link from any thread (the progress thread releases it)."""
        if self.alive:
            self.why, self.alive = why, False
            self.gate.close()
            self.queue.put(None)

    def teardown(self, why: str) -> None:
        """Stop the link and wait until it is released."""
        self.fail(why)
        self.released.wait(5)

    def _release(self) -> None:
        """On the progress thread: the QP goes first (no DMA after that), then the other
        threads stop, then every attempt here is retired; the window keeps the operations."""
        self._destroy()
        for th in self.threads:
            if th is not threading.current_thread():
                th.join(1.0)
        with self.lock:
            ops = list(self.ops.values())
            self.ops.clear()
            for op in ops:
                op.retire(self.pool)
            owns = [own for _, _, own in self.wrs.values() if own is not None]
            self.wrs.clear()
        for b in owns:
            self.pool.free(b)
        self._free_local()
        self.released.set()
        self.t.kick()

    def _free_local(self) -> None:
        for b in self.recv_blocks.values():
            self.pool.free(b)
        self.recv_blocks.clear()
        if self.probe is not None:
            self.pool.free(self.probe)
            self.probe = None

    def _destroy(self) -> None:
        with self.qp_lock:
            self.destroyed = True
        for o in (self.qp, self.scq, self.rcq):
            try:
                o.close()
            except Exception:  # noqa: BLE001 - already gone
                pass
