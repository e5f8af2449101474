"""The node service's wire format: length-prefixed binary frames over a Unix socket.

A frame is an 8-byte header ``<IHH`` (body length, op, status) and a body. A client
sends one request and reads one reply on a connection at a time; a connection is one
thread's. Page bytes never travel in frames: they lie in shared-memory segments the
client created (``memfd``, sealed against shrinking) and registered with ``SEGMENT``,
whose file descriptor rides in the frame's ancillary data (``SCM_RIGHTS``), and given
back with ``UNREGISTER``. A request names its pages by segment, offset and row count;
the daemon copies between the segment and its tiers, once.

Token ops carry the tenant's salt (``<H`` length, bytes) and the tokens as
little-endian uint32: in the body (up to :data:`INLINE_TOKENS`), or in a registered
segment the body names (``<QQQ`` segment, offset, count). The daemon copies them out
before the store reads them (a lookup reads them in place: a client that changes them
meanwhile misleads only itself) and derives the page keys itself, so a client names
tokens, never keys. Replies with status ``ERROR`` carry JSON
``{"type": ..., "message": ...}``, raised on the client as the same tierkv error.
"""

from __future__ import annotations

import array
import json
import socket
import struct
import time
from enum import IntEnum

from tierkv.errors import InputError

#: Bumped on any incompatible change; HELLO refuses a mismatch. 2: UNREGISTER. 3: GET_LAYERED, DRAM_POOL,
#: LEND, END_LEND. 4: derived pages (accept="derived") on LOOKUP and GET, counted in their replies.
#: 5: ORIGINS. 6: lossy pages (a budget on LOOKUP, GET and PUT; lossy counts in the replies).
#: 7: LOOKUP_KEYS retired (the daemon hashes a lookup's tokens a stretch at a time, stopping at a miss).
#: 8: streamed lookups (FLAG_STREAMED: the client writes a long prompt's ids while the daemon hashes them).
VERSION = 8

HEADER = struct.Struct("<IHH")
#: The largest body either side accepts. Bodies are small: page bytes and long prompts
#: travel in segments, so a frame holds at most the inline tokens, a salt and some JSON.
MAX_BODY = 1 << 20
SALT_LEN = struct.Struct("<H")


class Op(IntEnum):
    HELLO = 1      # JSON both ways: {"version", "pid"} -> {"version", "layout", "model_id", "pid"}
    SEGMENT = 2    # <QQ segment id, bytes; the memfd in SCM_RIGHTS -> empty
    LOOKUP = 3     # <Bd flags, budget [<Q progress word: FLAG_STREAMED], salt, tokens -> <QQQQQ cached pages,
                   # cached tokens, total pages, derived, lossy + tier ranks
    GET = 4        # <QQQqB segment, offset, rows, requested (-1: rows), flags, salt, tokens -> <QQQ pages, tokens,
                   # derived + ranks
    PUT = 5        # <QQQQB segment, offset, rows, unfilled, announce, salt, tokens -> <QQQ stored, present, dropped
    PREFETCH = 6   # salt, tokens -> <Q pages in the fastest tier
    PIN = 7        # salt, tokens -> <Q pages pinned
    UNPIN = 8      # salt, tokens -> <Q pages unpinned
    STATS = 9      # empty -> JSON of StoreStats.to_dict()
    FLUSH = 10     # empty -> empty
    STATUS = 11    # empty -> JSON: the daemon, its clients (for users that may use every tenant), the stats
    # 12: LOOKUP_KEYS until version 7 (keys hashed in the client)
    UNREGISTER = 13   # <Q segment id -> empty: the daemon unmaps it (a client gives a page buffer back)
    GET_LAYERED = 14  # <QQQqQQ as GET + the landing record's segment, offset (tierkv.store.landed) -> as GET
    DRAM_POOL = 15    # empty -> <QQQ slots, slot bytes, pool id, the DRAM tier's memfd in SCM_RIGHTS; only for connections
                      # that may use every tenant (the pool holds every tenant's pages)
    LEND = 16         # <QqB want, requested, whole, salt, tokens -> <QQqQ pages, tokens, lend token, pool id + <u4 slot per page
    END_LEND = 17     # <q lend token -> empty (a connection's lends end with it)
    SPLICE = 18       # <QQIIBB start, end, head_dim, frequencies, pairing, rope type, then the frequencies (<f4),
                      # the rope type's name, the replacement's tokens (<u4 each, SPLICE_LEN), salt, tokens
                      # -> <QQQQQq prefill_from, prefill_to, first_derived, derived, stored, delta
    ORIGINS = 19      # <QQ skip, limit, salt, tokens -> JSON {"total", "origins": [Origin.to_dict or null, at
                      # most ORIGINS_PER_REPLY of them, from the skip-th derived page on]}


class Status(IntEnum):
    OK = 0
    ERROR = 1


LOOKUP_REQ = struct.Struct("<Bd")     # flags: FLAG_COUNT, FLAG_DERIVED; the lossy budget accepted (0: none)
LOOKUP_REP = struct.Struct("<QQQQQ")  # pages, tokens, total pages, derived pages, lossy pages; then a rank per page
GET_REQ = struct.Struct("<QQQqBd")    # segment, offset, rows, requested (-1: none), flags: FLAG_DERIVED, lossy budget
GET_REP = struct.Struct("<QQQQ")      # pages, tokens, derived pages, lossy pages (their blobs, as stored); ranks
SPLICE_REQ = struct.Struct("<QQIIBB")  # start, end, head_dim, n frequencies, interleaved, len(rope type name)
SPLICE_LEN = struct.Struct("<Q")       # replacement tokens
ORIGINS_REQ = struct.Struct("<QQ")
#: Origins per ORIGINS reply (each a few hundred bytes of JSON: well inside MAX_BODY).
ORIGINS_PER_REPLY = 1024
SPLICE_REP = struct.Struct("<QQQQQq")
#: Flags of LOOKUP_REQ and GET_REQ. FLAG_STREAMED (LOOKUP only): STREAM_REQ follows
#: LOOKUP_REQ, and the tokens, in a segment, are still being written: the uint64 word at
#: STREAM_REQ's offset in that segment counts those in place (written with release
#: ordering after them), or is STREAM_ABANDONED (the client found an id out of range).
#: The word after it is the daemon's: it writes 1 there when it takes the lookup up (the
#: client, which set it to 0, polls for the reply only once it reads 1: a daemon not yet
#: running may be queued on the client's own core, behind its polling); the tokens must
#: not overlap either word.
FLAG_COUNT, FLAG_DERIVED, FLAG_STREAMED = 1, 2, 4
STREAM_REQ = struct.Struct("<Q")
STREAM_ABANDONED = (1 << 64) - 1
GET_LAYERED_REQ = struct.Struct("<QQQqQQ")   # exact pages only
POOL_REP = struct.Struct("<QQQ")
LEND_REQ = struct.Struct("<QqB")
LEND_REP = struct.Struct("<QQqQ")
END_LEND_REQ = struct.Struct("<q")
PUT_REQ = struct.Struct("<QQQQBd")   # segment, offset, rows, unfilled, announce, lossy budget (0: exact pages)
PUT_REP = struct.Struct("<QQQ")
COUNT = struct.Struct("<Q")
SEGMENT_REQ = struct.Struct("<QQ")
UNREGISTER_REQ = struct.Struct("<Q")


class ProtocolError(Exception):
    """The peer broke the framing (or closed mid-frame): the connection cannot go on."""


#: Prompts of up to this many tokens travel in the frame; longer ones in the client's
#: token segment (a 128K-token prompt is 512 KiB: through the socket that costs a
#: millisecond, through shared memory a copy of 20 us).
INLINE_TOKENS = 4096
TOKEN_REF = struct.Struct("<QQQ")   # segment, offset, tokens
_INLINE, _REF = 0, 1


def token_body(salt: bytes, tokens: bytes, prefix: bytes = b"") -> bytes:
    """``prefix``, the salt and the tokens themselves, as token ops carry them."""
    return b"".join((prefix, _salt(salt), bytes((_INLINE,)), tokens))


def token_ref(salt: bytes, segment: int, offset: int, count: int, prefix: bytes = b"") -> bytes:
    """``prefix``, the salt and where in a registered segment ``count`` tokens lie."""
    return b"".join((prefix, _salt(salt), bytes((_REF,)), TOKEN_REF.pack(segment, offset, count)))


def _salt(salt: bytes) -> bytes:
    if len(salt) > 0xFFFF:
        raise InputError(f"tenant salt is {len(salt)} bytes; at most 65535")
    return SALT_LEN.pack(len(salt)) + salt


def split_token_body(body: memoryview, at: int) -> tuple[bytes, memoryview | None, tuple[int, int, int] | None]:
    """(salt, inline tokens or None, (segment, offset, count) or None) of a token op's body
    whose fixed part ends at ``at``."""
    if len(body) < at + SALT_LEN.size:
        raise ProtocolError(f"a token request of {len(body)} bytes is shorter than its header")
    (n,) = SALT_LEN.unpack_from(body, at)
    start = at + SALT_LEN.size
    if len(body) < start + n + 1:
        raise ProtocolError("a token request's salt is cut short")
    salt, mode, rest = bytes(body[start:start + n]), body[start + n], body[start + n + 1:]
    if mode == _INLINE:
        if len(rest) % 4:
            raise ProtocolError("a token request's tokens are cut short")
        return salt, rest, None
    if mode == _REF and len(rest) == TOKEN_REF.size:
        return salt, None, TOKEN_REF.unpack(rest)
    raise ProtocolError(f"a token request's tokens are neither inline nor a segment reference (mode {mode})")


def send_frame(sock: socket.socket, op: int, body: bytes = b"", status: int = Status.OK,
               fds: tuple[int, ...] = ()) -> None:
    header = HEADER.pack(len(body), op, status)
    if fds:
        frame = header + body
        sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        if sent < len(frame):
            sock.sendall(frame[sent:])
    else:
        sock.sendall(header + body if len(body) < 65536 else header)
        if len(body) >= 65536:
            sock.sendall(body)


def _recv_exact(sock: socket.socket, n: int, first: bool = False, deadline: float | None = None) -> memoryview:
    """``n`` bytes; ``deadline`` (monotonic): all of them by then, however slowly they trickle."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if not k:
            if first and got == 0:
                raise EOFError("the peer closed the connection")
            raise ProtocolError(f"the peer closed the connection mid-frame ({got} of {n} bytes)")
        got += k
    return view


def recv_frame(sock: socket.socket, *, body_timeout: float | None = None,
               want_fds: bool = False) -> tuple[int, int, memoryview, list[int]]:
    """Read one frame: (op, status, body, received fds). Waits for the header as long as
    the socket's timeout allows; the body must follow within ``body_timeout``. Raises
    EOFError on a clean close between frames, ProtocolError on a broken frame."""
    fds: list[int] = []
    if want_fds:
        msg, anc, _flags, _addr = sock.recvmsg(HEADER.size, socket.CMSG_SPACE(4 * 4))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(data[:len(data) - len(data) % 4])
                fds.extend(got)
        if not msg:
            _close_all(fds)
            raise EOFError("the peer closed the connection")
        head = bytearray(msg)
        if len(head) < HEADER.size:
            try:
                head += _recv_exact(sock, HEADER.size - len(head))
            except BaseException:
                _close_all(fds)
                raise
        header = memoryview(head)
    else:
        header = _recv_exact(sock, HEADER.size, first=True)
    length, op, status = HEADER.unpack(header)
    if length > MAX_BODY:
        _close_all(fds)
        raise ProtocolError(f"a frame of {length} bytes is over the {MAX_BODY}-byte limit")
    if not length:
        return op, status, memoryview(b""), fds
    old = sock.gettimeout()
    try:
        body = _recv_exact(sock, length, deadline=None if body_timeout is None else time.monotonic() + body_timeout)
    except (TimeoutError, socket.timeout):
        _close_all(fds)
        raise ProtocolError(f"a frame's {length}-byte body did not arrive within {body_timeout} s") from None
    except BaseException:
        _close_all(fds)
        raise
    finally:
        sock.settimeout(old)
    return op, status, body, fds


def _close_all(fds: list[int]) -> None:
    import os
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def error_body(exc: BaseException) -> bytes:
    return json.dumps({"type": type(exc).__name__, "message": str(exc)}).encode()
