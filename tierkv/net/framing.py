"""Whole messages over a stream socket: send a header and payload parts, receive one
message into a caller-chosen buffer. Used by :mod:`tierkv.net.tcp` (both sides) and by
the RDMA transport's out-of-band handshake. Not thread-safe per socket: one sender at
a time (the server's connections serialize theirs with a lock, the client's with its
sender thread) and one reader per socket.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence

import numpy as np

from tierkv.net.wire import HEADER_BYTES, Body, Header, Kind, check_payload, decode_body, decode_header, encode_header

Alloc = Callable[[int], memoryview]


def frame(kind: Kind, channel: int, credits: int, seq: int, parts: Sequence[bytes | memoryview]) -> list[memoryview]:
    """One message as the buffers to send: its header, then the non-empty payload parts."""
    head = encode_header(kind, channel, credits, seq, parts)
    return [memoryview(head)] + [memoryview(p).cast("B") for p in parts if len(p)]


def send_buffers(sock: socket.socket, bufs: list[memoryview], deadline: float | None = None, *,
                 nowait: bool = False) -> list[memoryview]:
    """Send ``bufs`` in order. With a ``deadline`` (monotonic) bytes still going out after
    it fail the send (TimeoutError), however the receiver paces its reads (each send is
    bounded by the socket's own timeout). ``nowait``: send only what the socket takes
    now and return the rest (empty when everything went)."""
    flags = socket.MSG_DONTWAIT if nowait else 0
    while bufs:
        try:
            n = sock.sendmsg(bufs[:64], [], flags)
        except BlockingIOError:
            if nowait:
                return bufs
            raise
        while n:
            if n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][n:]
                n = 0
        if bufs and deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"a message was not taken in time ({sum(len(b) for b in bufs)} bytes left)")
    return bufs


def send_message(sock: socket.socket, kind: Kind, channel: int, credits: int, seq: int,
                 parts: Sequence[bytes | memoryview], deadline: float | None = None) -> None:
    """Send one message whole (``deadline`` as for :func:`send_buffers`)."""
    send_buffers(sock, frame(kind, channel, credits, seq, parts), deadline)


def recv_exact(sock: socket.socket, into: memoryview, deadline: float | None = None) -> None:
    """Fill ``into``; raises ConnectionError on EOF, TimeoutError once ``deadline`` (monotonic)
    has passed between two receives (each receive is bounded by the socket's own timeout)."""
    got = 0
    while got < len(into):
        if deadline is not None and got and time.monotonic() > deadline:
            raise TimeoutError(f"a message did not arrive in time ({got} of {len(into)} bytes)")
        n = sock.recv_into(into[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _plain(n: int) -> memoryview:
    return np.empty(n, dtype=np.uint8).data


def recv_message(sock: socket.socket, alloc: Alloc = _plain,
                 deadline: float | None = None) -> tuple[Header, Body, memoryview]:
    """One checked message: its header, decoded body and the raw payload buffer (which the
    body's views point into; from ``alloc`` so callers can land pages in registered memory).
    With a ``deadline`` (monotonic) a message still arriving after it fails (TimeoutError),
    however the sender paces it."""
    raw = memoryview(bytearray(HEADER_BYTES))
    recv_exact(sock, raw, deadline)
    header, checksum = decode_header(raw)
    payload = alloc(header.length) if header.length else memoryview(b"")
    if header.length:
        recv_exact(sock, payload, deadline)
    check_payload(raw, checksum, payload)
    return header, decode_body(header.kind, payload), payload
