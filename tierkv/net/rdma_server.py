"""The RDMA peer server: accepts RC QPs for a :class:`~tierkv.net.server.SlotStore`.

Started by :class:`tierkv.net.PeerServer` (``rdma=True``), which routes the
``rdma-connect`` call here. Registered once: the tier's slot buffer and the meta table
(remote read: clients pull by one-sided READ), and a staging :class:`~tierkv.net.pool.PagePool`
of ``NetConfig.staging_bytes`` (remote write: the only memory a client writes into; see
:mod:`tierkv.net.staging`). One progress thread polls every QP, answers control messages
and lands pushes; it alone touches QPs and CQs after setup.

A QP that fails (an error completion), that a client replaced (a new ``rdma-connect``
from the same client and link), or that leaves a granted push unfinished for
``4 * timeout_s`` is destroyed, and only then are its staging blocks freed, so no late
DMA can land in a block given to another push. :meth:`RdmaServer.reset_qps` moves every
QP to ERR (a fault switch for tests: clients rebuild their QPs and resend).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import numpy as np
import pyverbs.enums as e

from tierkv.net.pool import PagePool
from tierkv.net.rdma import (ACCESS, CTRL_BYTES, Device, Endpoint, connect_qp, frame_into, make_qp, post_recv,
                             post_send, to_error, unframe)
from tierkv.net.server import SlotStore
from tierkv.net.staging import Pushes
from tierkv.net.transport import NetConfig
from tierkv.net.wire import Call, Kind, Pages, ProtocolError, Stage

log = logging.getLogger(__name__)
_READ_ONLY = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ


class _ServerQP:
    """One client's QP at the server: ``depth`` receives posted, ``depth`` send buffers,
    and the pushes granted to it."""

    def __init__(self, server: RdmaServer, remote: Endpoint, owner: tuple[int, int]) -> None:
        d, depth = server.device, server.config.recv_credits
        self.depth, self.owner = depth, owner
        self.timeout_s = server.config.timeout_s
        self.qp, self.scq, self.rcq = make_qp(d, depth + 4, depth)
        self.psn = int(time.time_ns() & 0xFFFFFF)
        self.bufs = np.zeros((2 * depth, CTRL_BYTES), np.uint8)  # receives, then sends
        self.mr = d.register(self.bufs)
        self.free_sends = list(range(depth, 2 * depth))
        self.pushes = Pushes(server.store, server.staging, int(server.staging.buffer.ctypes.data))
        self.grants = 0
        self.retire: str | None = None   # why the progress thread should drop it
        self.reset = False               # fault switch: move to ERR on the progress thread
        for i in range(depth):
            self._repost(i, count=False)
        connect_qp(d, self.qp, self.psn, remote)

    def _repost(self, i: int, count: bool = True) -> None:
        post_recv(self.qp, i, self.bufs[i].ctypes.data, CTRL_BYTES, self.mr.lkey)
        if count:
            self.grants += 1

    def reply(self, kind: Kind, channel: int, seq: int, parts: list[bytes | memoryview]) -> None:
        if not self.free_sends:
            self.poll_sends()
        i = self.free_sends.pop()
        grants, self.grants = self.grants, 0
        n = frame_into(self.bufs[i], kind, channel, grants, seq, parts)
        post_send(self.qp, i, e.IBV_WR_SEND, self.bufs[i].ctypes.data, n, self.mr.lkey)

    def poll_sends(self) -> None:
        end = time.monotonic() + self.timeout_s
        while True:
            n, wcs = self.scq.poll(16)
            for wc in wcs[:n]:
                if wc.status != e.IBV_WC_SUCCESS:
                    raise ProtocolError(f"send completion status {wc.status}")
                self.free_sends.append(wc.wr_id)
            if n == 0 and self.free_sends:
                return
            if time.monotonic() > end:
                raise ProtocolError("no send buffer came back in time")

    def close(self) -> None:
        """Destroy the QP, then free its staging (no DMA can reach it any more)."""
        for o in (self.qp, self.scq, self.rcq, self.mr):
            try:
                o.close()
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.pushes.drop()


class RdmaServer:
    """Accepts RDMA clients of a :class:`SlotStore` (through its ``rdma-connect`` call) and
    runs one progress thread over their QPs. Thread-safe; ``close`` tears everything down."""

    def __init__(self, store: SlotStore, host: str, config: NetConfig) -> None:
        self.store, self.config = store, config
        self.device = Device(host)
        self.slots_mr = self.device.register(store.tier.buffer, _READ_ONLY)
        self.meta_mr = self.device.register(store.metas, _READ_ONLY)
        self.staging = PagePool(config.staging_bytes)
        self.staging_mr = self.device.register(self.staging.buffer, ACCESS)
        self._qps: list[_ServerQP] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.imm_writes = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._progress, name="tierkv-rdma-srv", daemon=True)
        self._thread.start()

    def accept(self, body: bytes) -> bytes:
        """The ``rdma-connect`` call: the client's endpoint in, this side's (and the MRs) out.
        A client's new QP for a link replaces its old one (whose staging is then freed)."""
        d: dict[str, Any] = json.loads(body)
        owner = (int(d.pop("client", 0)), int(d.pop("link", 0)))
        conn = _ServerQP(self, Endpoint(**d), owner)
        with self._lock:
            for old in self._qps:
                if owner[0] and old.owner == owner and old.retire is None:
                    old.retire = "replaced by the client's new QP"
            self._qps.append(conn)
        return json.dumps({
            "qpn": conn.qp.qp_num, "psn": conn.psn, "gid": self.device.gid, "credits": conn.depth,
            "slots_addr": self.store.tier.buffer.ctypes.data, "slots_rkey": self.slots_mr.rkey,
            "meta_addr": self.store.metas.ctypes.data, "meta_rkey": self.meta_mr.rkey,
            "staging_rkey": self.staging_mr.rkey,
            "num_slots": self.store.num_slots, "slot_bytes": self.store.slot_bytes, "epoch": self.store.epoch,
        }).encode()

    def reset_qps(self) -> int:
        """Fault switch: move every client QP to ERR (on the progress thread); returns how many."""
        with self._lock:
            for c in self._qps:
                c.reset = True
            return len(self._qps)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        with self._lock:
            for c in self._qps:
                c.close()
            self._qps.clear()
        for mr in (self.slots_mr, self.meta_mr, self.staging_mr):
            mr.close()
        self.device.close()

    def _progress(self) -> None:
        idle = 0.0
        while not self._closed.is_set():
            with self._lock:
                conns = list(self._qps)
            busy = False
            now = time.monotonic()
            for c in conns:
                oldest = c.pushes.oldest()
                if c.retire is None and oldest is not None and now - oldest > 4 * self.config.timeout_s:
                    c.retire = "a granted push never landed"
                if c.retire is not None:
                    self._drop(c, c.retire)
                    continue
                try:
                    if c.reset:
                        c.reset = False
                        to_error(c.qp)
                    busy |= self._poll(c)
                except Exception as err:  # noqa: BLE001 - one client's QP failing must not stop the others
                    self._drop(c, str(err))
            idle = 0.0 if busy else min(0.002, idle + 0.0002)
            if idle:
                time.sleep(idle)

    def _drop(self, c: _ServerQP, why: str) -> None:
        log.warning("rdma server: dropping a client QP (%d pushes pending): %s", len(c.pushes), why)
        with self._lock:
            self._qps.remove(c)
        c.close()
        self.dropped += 1

    def _poll(self, c: _ServerQP) -> bool:
        n, wcs = c.rcq.poll(16)
        for wc in wcs[:n]:
            if wc.status != e.IBV_WC_SUCCESS:
                raise ProtocolError(f"receive completion status {wc.status}")
            i = wc.wr_id
            if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                self.imm_writes += 1
                seq = wc.imm_data
                if seq not in c.pushes:  # immediates are big-endian on the wire
                    seq = int.from_bytes(seq.to_bytes(4, "little"), "big")
                ack = c.pushes.land(seq)
                c._repost(i)
                c.reply(Kind.WRITE_ACK, 0, seq, ack.encode())
                continue
            header, body = unframe(c.bufs[i], wc.byte_len)
            c._repost(i)
            if header.kind == Kind.WRITE and isinstance(body, Pages):
                got = c.pushes.begin(header.seq & 0x7FFFFFFF, body.metas, time.monotonic())
                kind = Kind.STAGE if isinstance(got, Stage) else Kind.WRITE_ACK
                c.reply(kind, header.channel, header.seq, got.encode())
            elif header.kind == Kind.CALL and isinstance(body, Call):
                c.reply(Kind.REPLY, header.channel, header.seq, self.store.call(body, inline=True).encode())
            else:
                raise ProtocolError(f"unexpected {header.kind.name} over RDMA")
        if len(c.free_sends) < c.depth // 2:
            c.poll_sends()
        return n > 0
