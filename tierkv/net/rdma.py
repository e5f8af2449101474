"""RDMA plumbing (pyverbs) shared by both sides, and the RDMA peer server.

Imported lazily (``tierkv.net.connect(kind="rdma")``, ``PeerServer(rdma=True)``): pyverbs
imports only under Debian's ``/usr/bin/python3`` and needs a device (soft-RoCE ``rxe0``
in the rig). Layout of one connection (RC QP) between a client and this server:

- The tier's whole slot buffer is registered once as one MR (remote read and write),
  and so is the packed meta table of :class:`~tierkv.net.server.SlotStore` (remote
  read): a client pulls a page by slot index with two one-sided READs (its 24-byte meta,
  then its bytes) and checks the bytes against the meta.
- A push is a control SEND (WRITE: the pages' metas, seq S) followed by one RDMA WRITE
  per page into its slot, the last WRITE_WITH_IMM carrying S. RC delivers in order, so
  when the immediate arrives every byte is placed; the server checks each page against
  its meta, publishes it (generation rules as over TCP) and SENDs WRITE_ACK S.
- Control RPCs (``lookup``) are SEND/RECV. The server posts ``recv_credits`` receives per
  QP and grants that many credits; each reply returns the credits its request used
  (a WRITE uses two: its SEND and its immediate). So a client never overruns the posted
  receives and the NIC never sends an RNR NAK.
- The QP numbers, GIDs, PSNs, addresses and rkeys are exchanged out of band over the
  TCP control connection (the ``rdma-connect`` call), not through rdma-cm.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyverbs.device as dev
import pyverbs.enums as e
from pyverbs.addr import AHAttr, GID, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

from tierkv.errors import TierUnavailableError
from tierkv.net.server import SlotStore
from tierkv.net.transport import NetConfig
from tierkv.net.wire import (HEADER_BYTES, Call, Kind, Pages, ProtocolError, check_payload, decode_body,
                             decode_header, encode_header)

log = logging.getLogger(__name__)
PORT = 1
CTRL_BYTES = 64 << 10  # one control message buffer (a WRITE of about 2,700 pages' metas)
ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE


def devices() -> list[str]:
    try:
        return [d.name.decode() for d in dev.get_device_list()]
    except Exception:  # noqa: BLE001 - no rdma subsystem at all
        return []


def gid_index(ctx: dev.Context, host: str) -> tuple[int, str]:
    """The GID table index whose address is ``host`` (RoCE v2 over IPv4: ::ffff:a.b.c.d)."""
    want = ipaddress.ip_address(host)
    mapped = ipaddress.IPv6Address(f"::ffff:{want}") if want.version == 4 else want
    n = ctx.query_port(PORT).gid_tbl_len
    for i in range(n):
        try:
            g = ctx.query_gid(PORT, i).gid
        except Exception:  # noqa: BLE001 - empty entries raise
            continue
        if g and ipaddress.IPv6Address(g) == mapped:
            return i, g
    raise TierUnavailableError(f"no GID for {host} on port {PORT} of {ctx.device.name if hasattr(ctx, 'device') else 'the device'}")


class Device:
    """An opened device, its PD, and the GID of ``host`` on port 1."""

    def __init__(self, host: str) -> None:
        names = devices()
        if not names:
            raise TierUnavailableError("no RDMA device")
        self.ctx: Any = None
        for name in names:
            ctx = dev.Context(name=name)
            try:
                self.gid_index, self.gid = gid_index(ctx, host)
                self.ctx, self.name = ctx, name
                break
            except TierUnavailableError:
                ctx.close()
        if self.ctx is None:
            raise TierUnavailableError(f"no RDMA device {names} has the address {host}")
        self.pd = PD(self.ctx)
        self.mtu = self.ctx.query_port(PORT).active_mtu

    def register(self, buf: np.ndarray) -> Any:
        return MR(self.pd, buf.nbytes, ACCESS, address=buf.ctypes.data)

    def close(self) -> None:
        self.pd.close()
        self.ctx.close()


@dataclass(frozen=True)
class Endpoint:
    """One side of an RC QP, as exchanged out of band."""

    qpn: int
    psn: int
    gid: str

    def to_dict(self) -> dict[str, Any]:
        return {"qpn": self.qpn, "psn": self.psn, "gid": self.gid}


def make_qp(d: Device, send_depth: int, recv_depth: int) -> tuple[Any, Any, Any]:
    """An RC QP in INIT with its own send and receive CQs."""
    scq, rcq = CQ(d.ctx, send_depth * 2 + 8), CQ(d.ctx, recv_depth * 2 + 8)
    cap = QPCap(max_send_wr=send_depth, max_recv_wr=recv_depth, max_send_sge=1, max_recv_sge=1)
    qp = QP(d.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=scq, rcq=rcq, cap=cap))
    attr = QPAttr()
    attr.qp_access_flags = ACCESS
    attr.port_num = PORT
    attr.pkey_index = 0
    qp.to_init(attr)
    return qp, scq, rcq


def connect_qp(d: Device, qp: Any, local_psn: int, remote: Endpoint) -> None:
    """INIT -> RTR -> RTS towards ``remote``; RNR retries unlimited (credits keep them at zero)."""
    gr = GlobalRoute(dgid=GID(remote.gid), sgid_index=d.gid_index)
    attr = QPAttr()
    attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=PORT)
    attr.path_mtu = d.mtu
    attr.dest_qp_num = remote.qpn
    attr.rq_psn = remote.psn
    attr.max_dest_rd_atomic = 16
    attr.min_rnr_timer = 1
    attr.qp_access_flags = ACCESS
    attr.port_num = PORT
    qp.to_rtr(attr)
    attr.sq_psn = local_psn
    attr.timeout = 14
    attr.retry_cnt = 7
    attr.rnr_retry = 7
    attr.max_rd_atomic = 16
    qp.to_rts(attr)


def post_recv(qp: Any, wr_id: int, addr: int, length: int, lkey: int) -> None:
    qp.post_recv(RecvWR(wr_id=wr_id, num_sge=1, sg=[SGE(addr, length, lkey)]))


def post_send(qp: Any, wr_id: int, opcode: int, addr: int, length: int, lkey: int, remote_addr: int = 0,
              rkey: int = 0, imm: int = 0) -> None:
    wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[SGE(addr, length, lkey)],
                send_flags=e.IBV_SEND_SIGNALED, imm_data=imm)
    if opcode in (e.IBV_WR_RDMA_READ, e.IBV_WR_RDMA_WRITE, e.IBV_WR_RDMA_WRITE_WITH_IMM):
        wr.set_wr_rdma(rkey, remote_addr)
    qp.post_send(wr)


def frame_into(buf: np.ndarray, kind: Kind, channel: int, credits: int, seq: int,
               parts: list[bytes | memoryview]) -> int:
    """Write one whole message into ``buf``; returns its length."""
    head = encode_header(kind, channel, credits, seq, parts)
    at = len(head)
    buf[:at] = np.frombuffer(head, np.uint8)
    for p in parts:
        n = len(p)
        buf[at:at + n] = np.frombuffer(p, np.uint8)
        at += n
    return at


def unframe(buf: np.ndarray, length: int) -> tuple[Any, Any]:
    raw = buf[:length].tobytes()
    header, checksum = decode_header(raw[:HEADER_BYTES])
    payload = memoryview(raw)[HEADER_BYTES:HEADER_BYTES + header.length]
    check_payload(raw[:HEADER_BYTES], checksum, payload)
    return header, decode_body(header.kind, payload)


class _ServerQP:
    """One client's QP at the server: ``depth`` receives posted, ``depth`` send buffers."""

    def __init__(self, server: RdmaServer, remote: Endpoint) -> None:
        d, depth = server.device, server.config.recv_credits
        self.depth = depth
        self.timeout_s = server.config.timeout_s
        self.qp, self.scq, self.rcq = make_qp(d, depth + 4, depth)
        self.psn = int(time.time_ns() & 0xFFFFFF)
        self.bufs = np.zeros((2 * depth, CTRL_BYTES), np.uint8)  # receives, then sends
        self.mr = d.register(self.bufs)
        self.free_sends = list(range(depth, 2 * depth))
        self.pending: dict[int, tuple] = {}  # WRITE seq -> metas, waiting for its immediate
        self.grants = 0
        for i in range(depth):
            self._repost(i, count=False)
        connect_qp(d, self.qp, self.psn, remote)
        self.alive = True

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
        self.alive = False
        for o in (self.qp, self.scq, self.rcq, self.mr):
            o.close()


class RdmaServer:
    """Accepts RDMA clients of a :class:`SlotStore` (through its ``rdma-connect`` call) and
    runs one progress thread over their QPs. Thread-safe; ``close`` tears everything down."""

    def __init__(self, store: SlotStore, host: str, config: NetConfig) -> None:
        self.store, self.config = store, config
        self.device = Device(host)
        self.slots_mr = self.device.register(store.tier.buffer)
        self.meta_mr = self.device.register(store.metas)
        self._qps: list[_ServerQP] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.imm_writes = 0
        self._thread = threading.Thread(target=self._progress, name="tierkv-rdma-srv", daemon=True)
        self._thread.start()

    def accept(self, body: bytes) -> bytes:
        """The ``rdma-connect`` call: the client's endpoint in, this side's (and the MRs) out."""
        remote = Endpoint(**json.loads(body))
        conn = _ServerQP(self, remote)
        with self._lock:
            self._qps.append(conn)
        return json.dumps({
            "qpn": conn.qp.qp_num, "psn": conn.psn, "gid": self.device.gid, "credits": conn.depth,
            "slots_addr": self.store.tier.buffer.ctypes.data, "slots_rkey": self.slots_mr.rkey,
            "meta_addr": self.store.metas.ctypes.data, "meta_rkey": self.meta_mr.rkey,
            "num_slots": self.store.num_slots, "slot_bytes": self.store.slot_bytes, "epoch": self.store.epoch,
        }).encode()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        with self._lock:
            for c in self._qps:
                c.close()
            self._qps.clear()
        self.slots_mr.close()
        self.meta_mr.close()
        self.device.close()

    def _progress(self) -> None:
        idle = 0.0
        while not self._closed.is_set():
            with self._lock:
                conns = [c for c in self._qps if c.alive]
            busy = False
            for c in conns:
                try:
                    busy |= self._poll(c)
                except Exception as err:  # noqa: BLE001 - one client's QP failing must not stop the others
                    log.warning("rdma server: dropping a client QP: %s", err)
                    with self._lock:
                        self._qps.remove(c)
                    c.close()
            idle = 0.0 if busy else min(0.002, idle + 0.0002)
            if idle:
                time.sleep(idle)

    def _poll(self, c: _ServerQP) -> bool:
        n, wcs = c.rcq.poll(16)
        for wc in wcs[:n]:
            if wc.status != e.IBV_WC_SUCCESS:
                raise ProtocolError(f"receive completion status {wc.status}")
            i = wc.wr_id
            if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                self.imm_writes += 1
                seq = wc.imm_data
                if seq not in c.pending:  # immediates are big-endian on the wire
                    seq = int.from_bytes(seq.to_bytes(4, "little"), "big")
                metas = c.pending.pop(seq, ())
                c._repost(i)
                c.reply(Kind.WRITE_ACK, 0, seq, self.store.commit(metas).encode())
                continue
            header, body = unframe(c.bufs[i], wc.byte_len)
            c._repost(i)
            if header.kind == Kind.WRITE and isinstance(body, Pages):
                c.pending[header.seq & 0x7FFFFFFF] = body.metas  # committed when its immediate lands
            elif header.kind == Kind.CALL and isinstance(body, Call):
                c.reply(Kind.REPLY, header.channel, header.seq, self.store.call(body).encode())
            else:
                raise ProtocolError(f"unexpected {header.kind.name} over RDMA")
        if len(c.free_sends) < c.depth // 2:
            c.poll_sends()
        return n > 0

