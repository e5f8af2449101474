"""The TCP transport against races, garbled peers and clients that misbehave.

Each case was a reproduced failure: a read racing a slot's reuse killed the client's
reader thread (the request never resolved), a truncated lookup body cost the server a
receive credit and got no reply, a garbled lookup reply crashed ``Store.get``'s peer
fetch, a client that stopped reading held every server worker, a client that trickled
a message in kept it open forever, and bad arguments raised ``struct.error``. On the
client side: a peer trickling its WELCOME held ``Store.get`` (and the store lock) past
every timeout, a close during a reconnect's handshake left its socket and reader
running, and a peer that welcomed then dropped each connection drew thousands of
reconnects a second.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.net.peers import pages
from tierkv.errors import InputError, TierUnavailableError
from tierkv.net import NetConfig, PeerServer, TcpTransport
from tierkv.net.framing import recv_message, send_message
from tierkv.net.wire import (Call, Hello, Kind, ProtocolError, ReadPages, Reply, Welcome, decode_keys, decode_metas,
                             encode_header, encode_keys)
from tierkv.tiers.dram import DramTier

CFG = NetConfig(timeout_s=1.0, links=1)
W = 4096


@pytest.fixture
def server() -> Iterator[PeerServer]:
    with DramTier(8, W) as tier, PeerServer(tier, config=CFG) as srv:
        srv.store.store([b"a", b"b"], pages(2, W, 1))
        yield srv


@pytest.fixture
def thread_errors() -> Iterator[list[str]]:
    errors: list[str] = []
    old = threading.excepthook
    threading.excepthook = lambda a: errors.append(f"{a.thread.name if a.thread else '?'}: {a.exc_value!r}")
    yield errors
    threading.excepthook = old


def raw_client(srv: PeerServer) -> socket.socket:
    sock = socket.create_connection(srv.address, timeout=5)
    send_message(sock, Kind.HELLO, 0, 0, 0, Hello(7).encode())
    recv_message(sock)
    return sock


def test_a_read_racing_a_reuse_is_a_miss_and_the_link_lives_on(server: PeerServer, thread_errors: list[str]) -> None:
    server.store.unseal([b"b"], [1])        # the owner is about to reuse slot 1
    with TcpTransport(*server.address, CFG) as tr:
        dst = np.zeros((2, W), np.uint8)
        r = tr.read([0, 1], dst).result(5)
        assert r.ok == (True, False)
        np.testing.assert_array_equal(dst[0], pages(2, W, 1)[0])
        assert tr.read([0], dst[:1]).result(5).all_ok   # the same link still serves
    assert thread_errors == []


def test_a_reply_that_does_not_add_up_fails_its_request_only(server: PeerServer, thread_errors: list[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # A server (an older one, or a broken one) naming a length it does not send.
    real = server.store.read

    def lying_read(slots: list[int], keys: object = None, scope: object = None) -> tuple[tuple[object, ...],
                                                                                         list[memoryview]]:
        metas, parts = real(slots, keys, scope)  # type: ignore[arg-type]
        return metas, parts[:-1]

    monkeypatch.setattr(server.store, "read", lying_read)
    with TcpTransport(*server.address, CFG) as tr:
        dst = np.zeros((2, W), np.uint8)
        r = tr.read([0, 1], dst).result(5)
        assert r.ok == (False, False) and "malformed" in (r.error or "")
        assert [s.bad_replies for s in tr.stats()] == [1]
        monkeypatch.setattr(server.store, "read", real)
        assert tr.read([0, 1], dst).result(5).all_ok
    assert thread_errors == []


@pytest.mark.parametrize("body, why", [
    (struct.pack("<I", 5), "ends before key 0"),
    (b"\x01", "has no count"),
    (encode_keys([b"a"]) + b"!", "after the 1 keys"),
    (struct.pack("<IH", 1, 9) + b"abc", "runs past"),
])
def test_a_malformed_lookup_gets_an_error_reply_and_keeps_its_credit(server: PeerServer, body: bytes,
                                                                     why: str) -> None:
    sock = raw_client(server)
    with sock:
        for seq in range(2 * CFG.recv_credits):    # more than the credits: each must be returned
            send_message(sock, Kind.CALL, 0, 0, seq, Call("lookup", body).encode())
            header, reply, _ = recv_message(sock)
            assert header.kind == Kind.REPLY and isinstance(reply, Reply)
            assert not reply.ok and why in reply.body.decode()
        send_message(sock, Kind.CALL, 0, 0, 99, Call("lookup", encode_keys([b"a"])).encode())
        header, reply, _ = recv_message(sock)
        assert header.kind == Kind.REPLY and isinstance(reply, Reply) and reply.ok


def test_wire_key_and_meta_lists_refuse_garbage() -> None:
    assert decode_keys(encode_keys([b"ab", b""])) == [b"ab", b""]
    with pytest.raises(ProtocolError, match="meta list"):
        decode_metas(b"\x02\x00")
    with pytest.raises(InputError, match="65535"):
        encode_keys([b"x" * 70_000])
    with pytest.raises(InputError, match="bytes"):
        encode_keys(["text"])  # type: ignore[list-item]


def test_lists_longer_than_a_message_may_carry_are_refused_before_they_are_built() -> None:
    # A 4 MiB READ naming 1M+1 slots (or a lookup of 1M+1 empty keys) would otherwise
    # make the server build a reply or a list many times the frame's size.
    from tierkv.net.wire import MAX_LOOKUP_KEYS, MAX_PAGES_PER_MESSAGE
    n = MAX_PAGES_PER_MESSAGE + 1
    with pytest.raises(ProtocolError, match="at most"):
        ReadPages.decode(memoryview(struct.pack("<I", n) + b"\xff\xff\xff\xff" * n))
    n = MAX_LOOKUP_KEYS + 1
    with pytest.raises(ProtocolError, match="at most"):
        decode_keys(struct.pack("<I", n) + b"\0\0" * n)
    ok = MAX_PAGES_PER_MESSAGE
    assert len(ReadPages.decode(memoryview(struct.pack("<I", ok) + b"\0" * 4 * ok)).slots) == ok


def test_bad_arguments_name_what_was_expected(server: PeerServer) -> None:
    with TcpTransport(*server.address, CFG) as tr:
        row = np.zeros((1, W), np.uint8)
        with pytest.raises(InputError, match="outside the peer's 8 slots"):
            tr.read([8], row)
        with pytest.raises(InputError, match="outside the peer's 8 slots"):
            tr.read([-1], row)
        with pytest.raises(InputError, match="2 slots but 1 generations"):
            tr.write([0, 1], [3], np.zeros((2, W), np.uint8))
        with pytest.raises(InputError, match="generation 0"):
            tr.write([0], [0], row)
        with pytest.raises(InputError, match="method name"):
            tr.call("m" * 70_000, b"")
        assert tr.read([0], row).result(5).all_ok
    assert server.tcp is not None and server.tcp.stats().connections == 1   # no reconnect storm


def test_a_client_that_stops_reading_does_not_stall_the_others() -> None:
    wide = 65536
    with DramTier(2, wide) as tier, PeerServer(tier, config=CFG) as srv:
        srv.store.store([b"a"], pages(1, wide, 2))
        evil = raw_client(srv)
        evil.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        with evil, TcpTransport(*srv.address, CFG) as good:
            for seq in range(8):                  # 32 MiB of reply each, and never a byte read
                send_message(evil, Kind.READ, 0, 0, seq, ReadPages(tuple([0] * 512)).encode())
            time.sleep(CFG.timeout_s)
            dst = np.zeros((1, wide), np.uint8)
            end = time.monotonic() + 5 * CFG.timeout_s
            while not good.read([0], dst).result(10).all_ok:   # stuck sends are cut within timeout_s
                assert time.monotonic() < end, "the server stayed stalled by a client that does not read"


def test_clients_that_read_slowly_never_hold_the_workers_from_others() -> None:
    # Four clients each take their 32 MiB replies 64 KiB at a time, never idle for
    # timeout_s, so no socket timeout fires: they must not hold the four workers that
    # every other client's requests need.
    wide, n = 4 << 20, 8
    stop = threading.Event()
    with DramTier(n, wide) as tier, PeerServer(tier, config=CFG) as srv:
        srv.store.store([bytes([i]) * 16 for i in range(n)], pages(n, wide, 3))

        def slow() -> None:
            with raw_client(srv) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
                for seq in range(8):
                    send_message(sock, Kind.READ, 0, 0, seq + 1, ReadPages(tuple(range(n))).encode())
                while not stop.is_set():
                    try:
                        sock.recv(65536)
                    except OSError:
                        return
                    stop.wait(0.4 * CFG.timeout_s)

        slow_clients = [threading.Thread(target=slow, daemon=True) for _ in range(4)]
        for t in slow_clients:
            t.start()
        try:
            time.sleep(CFG.timeout_s)
            with TcpTransport(*srv.address, CFG) as good:
                for _ in range(3):
                    assert good.call("lookup", encode_keys([b"\0" * 16])).result(10).ok
        finally:
            stop.set()
            for t in slow_clients:
                t.join(10)


def test_a_message_trickled_in_is_cut_at_the_deadline(server: PeerServer) -> None:
    sock = raw_client(server)
    with sock:
        head = b"TK\x01" + bytes([Kind.CALL]) + b"\0" * 12 + struct.pack("<I", 1 << 20) + b"\0" * 8
        sock.sendall(head)
        end = time.monotonic() + 6 * CFG.timeout_s
        with pytest.raises(OSError):
            while time.monotonic() < end:                      # a byte at a time, never finishing
                sock.sendall(b"x")
                time.sleep(CFG.timeout_s / 4)
            raise AssertionError("the server kept a trickling message open past its deadline")


def test_a_lookup_never_vouches_for_a_page_that_replaced_the_one_asked_for() -> None:
    """The owner reuses a slot for another key (another tenant's page) while lookups run:
    every meta a lookup returns for key A is A's page or empty, never the new page's."""
    import sys

    from tierkv.net.server import SlotStore
    from tierkv.net.wire import page_checksum

    with DramTier(1, W) as tier:
        store = SlotStore(tier)
        a, b = pages(1, W, 3)[0], pages(1, W, 4)[0]
        sums = {page_checksum(a.data): b"A", page_checksum(b.data): b"B"}
        stop = threading.Event()

        def owner() -> None:
            gen = 1
            while not stop.is_set():
                for key, page in ((b"A", a), (b"B", b)):
                    store.unseal([b"A", b"B"], [0, 0])
                    tier.buffer[0] = page
                    gen += 1
                    store.seal([key], [0], gen, W)

        class Yielding:
            """The store's lock, giving the other thread a turn after every release."""

            def __init__(self) -> None:
                self._lock = threading.Lock()

            def __enter__(self) -> None:
                self._lock.acquire()

            def __exit__(self, *exc: object) -> None:
                self._lock.release()
                time.sleep(0.0001)

        store._lock = Yielding()  # type: ignore[assignment]
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        t = threading.Thread(target=owner)
        t.start()
        try:
            for _ in range(1500):
                (meta,) = decode_metas(store.call(Call("lookup", encode_keys([b"A"]))).body)
                assert meta.generation == 0 or sums[meta.checksum] == b"A"
        finally:
            stop.set()
            t.join()
            sys.setswitchinterval(old)


def test_an_rdma_server_without_pyverbs_is_a_config_error() -> None:
    try:
        import pyverbs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("pyverbs is installed here")
    from tierkv.errors import ConfigError
    from tierkv.net import PeerServer
    from tierkv.tiers.dram import DramTier
    with pytest.raises(ConfigError, match="needs pyverbs"):
        PeerServer(DramTier(2, 4096), rdma=True)


class FakePeer:
    """A listening socket whose every connection is handled by ``handle(conn, n)``."""

    def __init__(self, handle: object) -> None:
        self.lsn = socket.create_server(("127.0.0.1", 0))
        host, port = self.lsn.getsockname()[:2]
        self.address: tuple[str, int] = (host, port)
        self.accepted = 0
        self._handle = handle
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.lsn.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._handle, args=(conn, self.accepted), daemon=True).start()  # type: ignore[arg-type]

    def close(self) -> None:
        self.lsn.close()


def welcome(conn: socket.socket) -> None:
    header, _, _ = recv_message(conn)
    send_message(conn, Kind.WELCOME, 0, 0, header.seq, Welcome(1, 8, W, 16).encode())


def test_a_welcome_trickled_in_fails_the_connect_at_its_deadline() -> None:
    def trickle(conn: socket.socket, n: int) -> None:
        try:
            recv_message(conn)
            body = Welcome(1, 8, W, 16).encode()
            msg = encode_header(Kind.WELCOME, 0, 0, 0, body) + body[0]
            for b in msg:                   # a byte per 0.3 s: each receive meets its timeout
                conn.sendall(bytes([b]))
                time.sleep(0.3)
        except OSError:
            pass

    peer = FakePeer(trickle)
    try:
        t0 = time.monotonic()
        with pytest.raises(TierUnavailableError, match="did not arrive in time"):
            TcpTransport(*peer.address, NetConfig(timeout_s=1.0, connect_timeout_s=1.0, links=1))
        assert time.monotonic() - t0 < 5, "the handshake ran past its deadline"
    finally:
        peer.close()


def test_a_close_during_a_reconnect_handshake_keeps_no_socket_or_reader() -> None:
    def handle(conn: socket.socket, n: int) -> None:
        header, _, _ = recv_message(conn)
        if n > 1:
            time.sleep(1.0)                 # the reconnect's handshake is slow
        send_message(conn, Kind.WELCOME, 0, 0, header.seq, Welcome(1, 8, W, 16).encode())
        if n == 1:
            time.sleep(0.2)
            conn.shutdown(socket.SHUT_RDWR)  # drop the first connection

    def readers() -> int:
        return sum(t.name == "tierkv-peer-read" for t in threading.enumerate())

    peer = FakePeer(handle)
    before = readers()
    try:
        tr = TcpTransport(*peer.address, NetConfig(links=1, connect_timeout_s=3.0))
        time.sleep(0.6)                     # dropped; the reconnect is mid-handshake
        tr.close()
        time.sleep(1.5)
        link = tr._links[0]
        assert link._sock is None and not link.connected
        assert readers() <= before
    finally:
        peer.close()


def test_a_peer_that_drops_every_connection_draws_backoff_not_a_storm() -> None:
    def handle(conn: socket.socket, n: int) -> None:
        try:
            welcome(conn)
            conn.close()                    # welcomes, then drops at once
        except OSError:
            pass

    peer = FakePeer(handle)
    try:
        tr = TcpTransport(*peer.address, NetConfig(links=1, backoff_initial_s=0.05, backoff_max_s=1.0))
        time.sleep(1.5)
        tr.close()
        assert peer.accepted <= 10, f"{peer.accepted} connections in 1.5 s"
    finally:
        peer.close()


def test_no_connection_thread_outlives_the_server() -> None:
    """Issue 28 item 11: two tierkv-peer-send threads were still alive after close()."""
    earlier = set(threading.enumerate())    # other tests' threads may still be ending

    def conn_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate()
                if t.name in ("tierkv-peer-send", "tierkv-peer-conn") and t not in earlier]

    with DramTier(8, W) as tier:
        srv = PeerServer(tier, config=CFG)
        clients = [raw_client(srv) for _ in range(2)]
        deadline = time.monotonic() + 5
        while len(conn_threads()) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(conn_threads()) == 4
        srv.close()
        assert conn_threads() == []
        for c in clients:
            c.close()
