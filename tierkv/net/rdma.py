"""RDMA plumbing (pyverbs) shared by both sides: device, QPs, work requests, framing.

The server is :mod:`tierkv.net.rdma_server`, the client :mod:`tierkv.net.rdma_client`.
Imported lazily (``tierkv.net.connect(kind="rdma")``, ``PeerServer(rdma=True)``): pyverbs
imports only under Debian's ``/usr/bin/python3`` and needs a device (soft-RoCE ``rxe0``
in the rig). Layout of one connection (RC QP) between a client and this server:

- The tier's whole slot buffer is registered once as one MR (remote read only), and so
  is the packed meta table of :class:`~tierkv.net.server.SlotStore`: a client pulls a
  page by slot index with two one-sided READs (its 24-byte meta, then its bytes) and
  checks the bytes against the meta.
- A push is a control SEND (WRITE: the pages' metas, seq S); the server answers with
  its WRITE_ACK at once (a resend that already landed, a stale write) or with a STAGE
  granting a block of its registered staging pool; the client RDMA-WRITEs the bytes
  there with WRITE_WITH_IMM carrying S, and the server checks each page, copies it into
  its slot only if it is newer, frees the block and SENDs WRITE_ACK S
  (:mod:`tierkv.net.staging`). No client ever writes into a slot.
- Control RPCs (``lookup``) are SEND/RECV. The server posts ``recv_credits`` receives per
  QP and grants that many credits; each reply returns the credits its request used
  (a WRITE uses two: its SEND and its immediate; the immediate only after its STAGE,
  so a client never pushes into staging it was not granted). So a client never overruns
  the posted receives and the NIC never sends an RNR NAK.
- The QP numbers, GIDs, PSNs, addresses and rkeys are exchanged out of band over the
  TCP control connection (the ``rdma-connect`` call), not through rdma-cm.
"""

from __future__ import annotations

import ipaddress
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
from tierkv.net.wire import HEADER_BYTES, Kind, check_payload, decode_body, decode_header, encode_header

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

    def register(self, buf: np.ndarray, access: int = ACCESS) -> Any:
        return MR(self.pd, buf.nbytes, access, address=buf.ctypes.data)

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


def to_error(qp: Any) -> None:
    """Move ``qp`` to ERR: its posted work flushes, and the peer's next request to it fails
    (a fault switch for tests, and how the server cuts off a QP it gives up on)."""
    attr = QPAttr()
    attr.qp_state = e.IBV_QPS_ERR
    qp.modify(attr, e.IBV_QP_STATE)


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
