"""The RDMA transport's client side: :class:`RdmaTransport` (see :mod:`tierkv.net.rdma`).

A TCP control connection (:class:`~tierkv.net.tcp.TcpTransport`) carries the
out-of-band exchange; ``NetConfig.links`` RC QPs (:class:`~tierkv.net.rdma_link.Link`)
behind a :class:`~tierkv.net.mux.Mux` carry the data. Each mux link has a
:class:`~tierkv.net.window.SendWindow` that outlives its QPs: an operation
(:class:`~tierkv.net.inflight.Op`) stays there until it is answered or its deadline
passes. Local buffers come from one registered :class:`~tierkv.net.pool.PagePool`.

- Pull: two one-sided READs per page (its meta, then its bytes), checked, then copied
  into the caller's row.
- Push: a SEND with the metas; the server answers with its WRITE_ACK at once (a resend
  that already landed: DUPLICATE; older: STALE) or grants staging (STAGE); then one
  WRITE_WITH_IMM of every page's bytes into the staging block; WRITE_ACK when the
  server has checked and copied them (:mod:`tierkv.net.staging`).
- Recovery: a QP that fails is destroyed and rebuilt by a reconnector thread (backoff
  ``backoff_initial_s`` doubling to ``backoff_max_s``, once the control connection is up)
  and every unacknowledged operation is started again on the new QP, in order. A reaper
  fails operations at their deadline (misses), ``NetConfig.timeout_s`` after they were
  issued, whether or not the peer came back. While the peer is unreachable (the control
  connection's reconnects fail) new operations fail at once.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import pyverbs.enums as e

from tierkv.errors import StoreClosedError, TierUnavailableError
from tierkv.net.inflight import Op
from tierkv.net.mux import Mux
from tierkv.net.pool import Block, PagePool
from tierkv.net.rdma import CTRL_BYTES, Device
from tierkv.net.rdma_link import Link
from tierkv.net.server import META_DTYPE
from tierkv.net.tcp import TcpTransport
from tierkv.net.transport import CallResult, LinkStats, NetConfig, PeerInfo, ReadResult, Transport, WriteResult
from tierkv.net.verify import copy_accepted, failed_read, read_args, write_args
from tierkv.net.wire import Call, Kind, PageMeta, Pages, Reply, Stage, WriteAck, WriteStatus, page_checksum
from tierkv.net.window import SendWindow

_MS = META_DTYPE.itemsize


class RdmaTransport(Transport):
    """The client side of one peer over RDMA; see the module docstring. Raises
    TierUnavailableError at construction when the peer, the device or the QP setup fails."""

    def __init__(self, host: str, port: int, config: NetConfig | None = None) -> None:
        cfg = self.config = config or NetConfig()
        self.control = TcpTransport(host, port, NetConfig(timeout_s=cfg.timeout_s, links=1,
                                                          connect_timeout_s=cfg.connect_timeout_s,
                                                          credential=cfg.credential))
        self.address = (host, port)
        self._closed = False
        self.client_id = ((os.getpid() << 32) ^ time.time_ns()) & 0x7FFFFFFFFFFFFFFF or 1
        n = max(1, cfg.links)
        self.windows: list[SendWindow[Op]] = [SendWindow(cfg.window) for _ in range(n)]
        self.counts = [{"sent": 0, "expired": 0, "reconnects": 0} for _ in range(n)]
        self.links: list[Link] = []
        self._stop, self._wake = threading.Event(), threading.Event()
        try:
            self.device = Device(_local_address(host))
            self.pool = PagePool(cfg.pool_bytes)
            self.mr = self.device.register(self.pool.buffer)
            for i in range(n):
                self.links.append(Link(self, i))
        except Exception:
            for link in self.links:
                link.teardown("setup failed")
            self.control.close()
            raise
        self.mux: Mux[int] = Mux(list(range(n)))
        self.reconnects = 0
        self._threads = [threading.Thread(target=self._reap_loop, daemon=True, name="tierkv-rdma-reap"),
                         threading.Thread(target=self._reconnect_loop, daemon=True, name="tierkv-rdma-reconnect")]
        for th in self._threads:
            th.start()

    @property
    def info(self) -> PeerInfo:  # type: ignore[override]
        r = self.links[0].remote
        return PeerInfo(r["epoch"], r["num_slots"], r["slot_bytes"])

    @property
    def connected(self) -> bool:
        return all(not self.stale(link) for link in self.links)

    def stale(self, link: Link) -> bool:
        """A link is unusable when it failed, the control connection is down (the peer is
        most likely gone: fail fast rather than wait out RC retries), or the peer restarted."""
        return (not link.alive or not self.control.connected
                or link.remote["epoch"] != self.control.info.epoch)

    def kick(self) -> None:
        """Wake the reconnector (a link was released)."""
        self._wake.set()

    def wait_connected(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.connected:
                return True
            self.kick()
            time.sleep(0.05)
        return self.connected

    # -- operations -------------------------------------------------------------------------
    def read(self, slots: Sequence[int], dst: np.ndarray, expect: Sequence[PageMeta | None] | None = None,
             channel: int = 0, keys: Sequence[bytes] | None = None) -> Future[ReadResult]:
        # One-sided: ``keys`` are not sent; the connection (a cluster principal's) authorizes it.
        slots = read_args(slots, dst, self.info)
        fut: Future[ReadResult] = Future()
        if not slots:
            fut.set_result(ReadResult((), ()))
            return fut
        n, sb = len(slots), self.info.slot_bytes

        def start(link: Link, op: Op) -> None:
            mb = link.block(n * _MS)
            op.blocks.append(mb)
            op.then = lambda: phase2(link, op)
            for i, s in enumerate(slots):  # phase 1: each page's meta, one-sided
                b = Block(mb.offset + i * _MS, _MS, _MS)
                link.post(op, e.IBV_WR_RDMA_READ, b, _MS, link.remote["meta_addr"] + s * _MS, link.remote["meta_rkey"])

        def phase2(link: Link, op: Op) -> None:
            mb = op.blocks[0]
            rec = np.frombuffer(self.pool.buffer[mb.offset:mb.offset + n * _MS].tobytes(), META_DTYPE)
            metas = [PageMeta(int(r["slot"]), int(r["generation"]), int(r["length"]), int(r["checksum"])) for r in rec]
            blocks: list[Block | None] = [None] * n
            for i, m in enumerate(metas):  # every block first: a full pool retries before anything is posted
                if m.generation != 0 and dst.shape[1] <= m.length <= sb:
                    blocks[i] = link.block(m.length)
                    op.blocks.append(blocks[i])  # type: ignore[arg-type]
            op.then = lambda: link.finish(op, lambda: self._verify(slots, metas, blocks, dst, expect))
            for i, b in enumerate(blocks):  # phase 2: the bytes of every page the peer holds
                if b is not None:
                    link.post(op, e.IBV_WR_RDMA_READ, b, b.length, link.remote["slots_addr"] + slots[i] * sb,
                              link.remote["slots_rkey"])

        self._submit(channel, fut, start, lambda why: failed_read(slots, why), credits=0)
        return fut

    def _verify(self, slots: list[int], metas: list[PageMeta], blocks: list[Block | None], dst: np.ndarray,
                expect: Sequence[PageMeta | None] | None) -> ReadResult:
        datas = [self.pool.view(b).data if b is not None else memoryview(b"") for b in blocks]
        return copy_accepted(metas, datas, slots, dst, expect)

    def write(self, slots: Sequence[int], generations: Sequence[int], src: np.ndarray,
              channel: int = 0) -> Future[WriteResult]:
        slots, generations = write_args(slots, generations, src, self.info)
        fut: Future[WriteResult] = Future()
        if not slots:
            fut.set_result(WriteResult(()))
            return fut
        n, width = len(slots), src.shape[1]
        total = n * width
        metas = tuple(PageMeta(s, int(g), width, page_checksum(src[i].data))
                      for i, (s, g) in enumerate(zip(slots, generations)))
        if total + CTRL_BYTES > self.pool.capacity_bytes // 2:
            fut.set_result(_failed_write(slots, metas, f"a write of {total} bytes does not fit half the registered"
                                                       f" pool of {self.pool.capacity_bytes}: split it"))
            return fut

        def start(link: Link, op: Op) -> None:
            db = link.block(total)
            op.blocks.append(db)
            self.pool.buffer[db.offset:db.offset + total] = src.reshape(-1)
            link.send_ctrl(op, Kind.WRITE, channel, Pages(metas, memoryview(b"")).encode())

        def push(addr: int) -> Callable[[Link, Op], None]:
            def step(link: Link, op: Op) -> None:  # the whole batch, one WRITE_WITH_IMM into granted staging
                op.phase = 1
                link.post(op, e.IBV_WR_RDMA_WRITE_WITH_IMM, op.blocks[0], total, addr, link.remote["staging_rkey"],
                          imm=op.wire_seq)
            return step

        def on_reply(link: Link, op: Op, body: object) -> None:
            if isinstance(body, Stage) and body.length == 0:  # no staging free there: again later
                link.retry(op, unused_credits=1)
                return
            if isinstance(body, Stage) and op.phase == 0 and body.length >= total:
                link.later(op, push(body.addr))
                return
            if op.phase == 0:  # answered without a push: the immediate's credit was not used
                link.gate.grant(1)
            if isinstance(body, WriteAck) and len(body.statuses) == n:
                statuses = body.statuses
                link.complete(op, lambda: WriteResult(statuses, metas))
            else:
                why = f"peer answered a write with {type(body).__name__}"
                link.complete(op, lambda: _failed_write(slots, metas, why))

        self._submit(channel, fut, start, lambda why: _failed_write(slots, metas, why), credits=2, on_reply=on_reply)
        return fut

    def call(self, method: str, body: bytes, channel: int = 0) -> Future[CallResult]:
        fut: Future[CallResult] = Future()

        def start(link: Link, op: Op) -> None:
            link.send_ctrl(op, Kind.CALL, channel, Call(method, body).encode())

        def on_reply(link: Link, op: Op, reply: object) -> None:
            if not isinstance(reply, Reply):
                why = f"peer answered a call with {type(reply).__name__}"
                link.complete(op, lambda: CallResult(False, b"", why))
            else:
                link.complete(op, lambda: CallResult(reply.ok, reply.body,
                                                     None if reply.ok else reply.body.decode(errors="replace")))

        self._submit(channel, fut, start, lambda why: CallResult(False, b"", why), credits=1, on_reply=on_reply)
        return fut

    def stats(self) -> list[LinkStats]:
        return [LinkStats(c["sent"], w.resends, 0, c["expired"], c["reconnects"], link.gate.waits)
                for c, w, link in zip(self.counts, self.windows, self.links)]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        for th in self._threads:
            th.join(self.config.timeout_s + 2)
        for link in self.links:
            link.teardown("transport closed")
        for w in self.windows:
            for entry in w.close():
                op = entry.item
                op.resolve(lambda op=op: op.fail("transport closed"))  # type: ignore[misc]
        self.mr.close()
        self.device.close()
        self.control.close()

    # -- plumbing ---------------------------------------------------------------------------
    def _submit(self, channel: int, fut: Future[Any], start: Callable[[Link, Op], None],
                fail: Callable[[str], object], credits: int,
                on_reply: Callable[[Link, Op, Any], None] | None = None) -> None:
        if self._closed:
            raise StoreClosedError(f"transport to {self.address[0]}:{self.address[1]} is closed")
        i = self.mux.link_index(channel)
        self.mux.route(channel)
        if self.stale(self.links[i]):
            self.kick()
            if not self.control.reachable:
                fut.set_result(fail("RDMA link down; the peer is not reachable now"))
                return
        op = Op(time.monotonic() + self.config.timeout_s, fail, fut, start, credits, on_reply)
        if self.windows[i].reserve(op, op.deadline) is None:
            fut.set_result(fail("RDMA send window stayed full"))

    def _reap_loop(self) -> None:
        """Fail operations at their deadline; a link that had one in flight is torn down
        (its QP must go before the attempt's blocks can be freed)."""
        while not self._stop.wait(0.02):
            now = time.monotonic()
            for i, w in enumerate(self.windows):
                for entry in w.expire(now):
                    op, link = entry.item, entry.item.link
                    self.counts[i]["expired"] += 1
                    why = f"no answer from {self.address[0]}:{self.address[1]} within {self.config.timeout_s} s"
                    if op.resolve(lambda op=op, why=why: op.fail(why)) and link is not None:  # type: ignore[misc]
                        link.fail("an operation on it passed its deadline")

    def _reconnect_loop(self) -> None:
        backoff = self.config.backoff_initial_s
        while not self._stop.is_set():
            self._wake.wait(0.1)
            self._wake.clear()
            if self._stop.is_set() or self.connected:
                backoff = self.config.backoff_initial_s
                continue
            if self._repair():
                backoff = self.config.backoff_initial_s
            else:
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.config.backoff_max_s)

    def _repair(self) -> bool:
        """Replace stale links with new QPs once the control connection is up; True when
        every link is usable."""
        if not self.control.connected:
            return False
        for i, link in enumerate(self.links):
            if not self.stale(link):
                continue
            link.fail("replaced after the peer came back")
            if not link.released.wait(2.0):
                return False
            try:
                self.links[i] = Link(self, i)
            except TierUnavailableError:
                return False
            self.reconnects += 1
            self.counts[i]["reconnects"] += 1
        return True


def _failed_write(slots: Sequence[int], metas: tuple[PageMeta, ...], why: str) -> WriteResult:
    return WriteResult(tuple(WriteStatus.FAILED for _ in slots), metas, why)


def _local_address(peer: str) -> str:
    """This node's address on the route to ``peer`` (whose GID the QP uses)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return str(s.getsockname()[0])
