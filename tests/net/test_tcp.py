"""The TCP transport against a real peer server: bit-exact round trips, idempotent writes,
misses for stale or corrupt pages, the lookup RPC, channels over few links, and incast
with and without receive credits."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from tests.net.peers import key, pages
from tierkv.errors import InputError, StoreClosedError, TierUnavailableError
from tierkv.net import NetConfig, PeerServer, TcpTransport, WriteStatus, connect
from tierkv.net.wire import PageMeta, Pages, page_checksum
from tierkv.tiers.dram import DramTier
from tierkv.tiers.peer import PeerDramTier

T = 10  # seconds; futures resolve within NetConfig.timeout_s anyway


@pytest.fixture
def server() -> Iterator[PeerServer]:
    with DramTier(64, 65536) as tier, PeerServer(tier) as srv:
        yield srv


@pytest.fixture
def client(server: PeerServer) -> Iterator[TcpTransport]:
    with TcpTransport(*server.address) as tr:
        yield tr


@pytest.mark.parametrize("width", [1, 4095, 65536])
def test_round_trip_bit_exact(client: TcpTransport, width: int) -> None:
    src = pages(16, width, seed=width)
    slots = [5, 6, 7, 0, 63, 1, 2, 3, 40, 41, 42, 43, 44, 45, 46, 47]
    assert client.write(slots, [1] * 16, src).result(T).all_stored
    dst = np.full_like(src, 0xA5)
    res = client.read(slots[::-1], dst).result(T)
    assert res.all_ok and [m.generation for m in res.metas] == [1] * 16
    np.testing.assert_array_equal(dst, src[::-1])
    kept = src.copy()
    assert (src == kept).all()


def test_writes_are_idempotent_by_slot_and_generation(client: TcpTransport, server: PeerServer) -> None:
    a, b = pages(1, 4096, 1), pages(1, 4096, 2)
    assert client.write([3], [5], a).result(T).statuses == (WriteStatus.STORED,)
    assert client.write([3], [5], a).result(T).statuses == (WriteStatus.DUPLICATE,)  # a resend
    assert client.write([3], [4], b).result(T).statuses == (WriteStatus.STALE,)  # older: ignored
    dst = np.zeros_like(a)
    assert client.read([3], dst).result(T).all_ok
    np.testing.assert_array_equal(dst, a)
    bad = Pages((PageMeta(3, 9, 4096, page_checksum(a.data) ^ 1),), b.data.cast("B"))
    assert server.store.write(bad).statuses == (WriteStatus.BAD_CHECKSUM,)
    assert server.store.meta(3).generation == 5


def test_corrupt_or_unexpected_pages_are_misses(client: TcpTransport, server: PeerServer) -> None:
    src = pages(3, 8192, 3)
    res = client.write([0, 1, 2], [7, 7, 7], src).result(T)
    server.store.tier.buffer[1, 100] ^= 0xFF  # the peer's bytes change behind its meta
    dst = np.full_like(src, 0xA5)
    got = client.read([0, 1, 2, 9], np.full((4, 8192), 0xA5, np.uint8)).result(T)
    assert got.ok == (True, False, True, False)  # slot 9 was never written: generation 0
    expect = list(res.metas)
    expect[2] = PageMeta(2, 6, 8192, expect[2].checksum)  # the caller expected another generation
    got = client.read([0, 2], dst[:2], [expect[0], expect[2]]).result(T)
    assert got.ok == (True, False)
    np.testing.assert_array_equal(dst[0], src[0])
    assert (dst[1] == 0xA5).all()  # a missed row is not written


def test_a_narrower_read_and_a_wider_one(client: TcpTransport) -> None:
    src = pages(1, 4096, 4)
    client.write([8], [1], src).result(T)
    dst = np.zeros((1, 100), np.uint8)
    assert client.read([8], dst).result(T).all_ok and (dst == src[:, :100]).all()
    assert not client.read([8], np.zeros((1, 8192), np.uint8)).result(T).all_ok  # more than stored: a miss


def test_lookup_then_fetch_published_pages(server: PeerServer) -> None:
    src = pages(5, 65536, 5)
    server.store.store([key(i) for i in range(5)], src)
    with PeerDramTier(connect(*server.address, kind="tcp")) as tier:
        metas = tier.lookup([key(3), key(99), key(0)])
        assert metas[1] is None and metas[0] is not None and metas[2] is not None
        dst = np.zeros((2, 65536), np.uint8)
        assert tier.fetch_remote([metas[0], metas[2]], dst).all_ok
        np.testing.assert_array_equal(dst, src[[3, 0]])
        server.store.forget([key(3)])
        assert tier.lookup([key(3)]) == [None]
    with TcpTransport(*server.address) as tr:
        bad = tr.call("no-such-method", b"").result(T)
        assert not bad.ok and "unknown method" in (bad.error or "")


def test_bad_input_and_use_after_close(client: TcpTransport) -> None:
    with pytest.raises(InputError):
        client.read([0, 1], np.zeros((1, 10), np.uint8))
    with pytest.raises(InputError):
        client.write([0], [1], np.zeros((1, 65537), np.uint8))
    client.close()
    with pytest.raises(StoreClosedError):
        client.read([0], np.zeros((1, 10), np.uint8))


def test_unreachable_peer_raises_at_connect() -> None:
    from tests.net.peers import free_port

    with pytest.raises(TierUnavailableError, match="cannot reach"):
        TcpTransport("127.0.0.1", free_port(), NetConfig(connect_timeout_s=0.5))


def test_many_channels_over_two_links(server: PeerServer) -> None:
    with TcpTransport(*server.address, NetConfig(links=2)) as tr:
        src = pages(32, 4096, 6)
        futs = [tr.write([c], [1], src[c:c + 1], channel=c) for c in range(32)]
        assert all(f.result(T).all_stored for f in futs)
        dsts = [np.zeros((1, 4096), np.uint8) for _ in range(32)]
        futs2 = [tr.read([c], dsts[c], channel=c) for c in range(32)]
        assert all(f.result(T).all_ok for f in futs2)
        np.testing.assert_array_equal(np.concatenate(dsts), src)
        assert {s.link for s in tr.mux.stats()} == {0, 1} and len(tr.mux.stats()) == 32
    assert server.stats().connections == 2


def _incast(credits: bool, senders: int = 6, batches: int = 24) -> tuple[int, int, bool]:
    """``senders`` clients each fire ``batches`` writes then reads at once at one server with
    2 receives posted per connection; returns (server NAKs, client NAKs, all bit-exact)."""
    cfg = NetConfig(recv_credits=2, window=32, credits=credits, links=1)
    with DramTier(senders * batches, 16384) as tier, PeerServer(tier, config=cfg, workers=2) as srv:
        exact: list[bool] = []
        naks: list[int] = []

        def sender(i: int) -> None:
            with TcpTransport(*srv.address, cfg) as tr:
                src = pages(batches, 16384, 100 + i)
                slots = [i * batches + b for b in range(batches)]
                ws = [tr.write([s], [1], src[b:b + 1]) for b, s in enumerate(slots)]
                ok = all(f.result(T).all_stored for f in ws)
                dst = np.zeros_like(src)
                rs = [tr.read([s], dst[b:b + 1]) for b, s in enumerate(slots)]
                ok = ok and all(f.result(T).all_ok for f in rs)
                exact.append(ok and bool((dst == src).all()))
                naks.append(sum(s.naks for s in tr.stats()))

        threads = [threading.Thread(target=sender, args=(i,)) for i in range(senders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return srv.stats().naks, sum(naks), len(exact) == senders and all(exact)


def test_incast_with_credits_has_no_naks() -> None:
    server_naks, client_naks, exact = _incast(credits=True)
    assert exact and server_naks == 0 and client_naks == 0


def test_incast_without_credits_naks_and_retries_but_stays_exact() -> None:
    server_naks, client_naks, exact = _incast(credits=False)
    assert exact and server_naks > 0 and client_naks == server_naks


def test_cut_connections_resend_unacknowledged_writes(server: PeerServer) -> None:
    with TcpTransport(*server.address, NetConfig(timeout_s=5, window=8)) as tr:
        src = pages(64, 65536, 7)
        futs = [tr.write([s], [3], src[s:s + 1], channel=s) for s in range(64)]
        assert server.tcp.drop_connections() >= 1  # while writes are in flight
        results = [f.result(T) for f in futs]
        assert all(r.all_stored for r in results)  # STORED, or DUPLICATE for a resent one
        dst = np.zeros_like(src)
        assert tr.read(list(range(64)), dst).result(T).all_ok
        np.testing.assert_array_equal(dst, src)
        assert sum(s.reconnects for s in tr.stats()) >= 1


def test_two_writers_racing_on_slots_leave_the_newest_generation(server: PeerServer) -> None:
    """Interleaved generations from two clients, many writes in flight on 4 server
    workers: every status is STORED or STALE and each slot ends with the newest bytes."""
    slots, rounds = [10, 11, 12, 13], 16
    data = {(w, r): pages(4, 4096, seed=500 + 50 * w + r) for w in (0, 1) for r in range(rounds)}
    statuses: list[WriteStatus] = []

    def writer(w: int) -> None:
        with TcpTransport(*server.address) as tr:
            futs = [tr.write(slots, [2 * r + w + 1] * 4, data[w, r], channel=r) for r in range(rounds)]
            statuses.extend(s for f in futs for s in f.result(T).statuses)

    ts = [threading.Thread(target=writer, args=(w,)) for w in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert len(statuses) == 2 * rounds * 4 and set(statuses) <= {WriteStatus.STORED, WriteStatus.STALE}
    with TcpTransport(*server.address) as tr:
        dst = np.zeros((4, 4096), np.uint8)
        res = tr.read(slots, dst).result(T)
    assert res.all_ok and {m.generation for m in res.metas} == {2 * rounds}
    np.testing.assert_array_equal(dst, data[1, rounds - 1])


@pytest.fixture
def small_messages(monkeypatch: pytest.MonkeyPatch) -> int:
    """Messages of at most 3 pages on both sides (1 GiB of pages in production)."""
    import tierkv.net.tcp as tcp
    import tierkv.net.tcp_server as tcp_server
    monkeypatch.setattr(tcp, "pages_per_message", lambda page_bytes: 3)
    monkeypatch.setattr(tcp_server, "pages_per_message", lambda page_bytes: 3)
    return 3


def test_batches_a_message_cannot_carry_are_split_and_stay_exact(client: TcpTransport, small_messages: int) -> None:
    src = pages(8, 4096, seed=8)
    slots = [9, 1, 2, 30, 31, 4, 5, 60]
    res = client.write(slots, list(range(1, 9)), src).result(T)
    assert res.all_stored and len(res.metas) == 8 and [m.slot for m in res.metas] == slots
    dst = np.zeros_like(src)
    got = client.read(slots, dst).result(T)
    assert got.all_ok and [m.slot for m in got.metas] == slots
    np.testing.assert_array_equal(dst, src)
    expect = list(res.metas)
    expect[4] = PageMeta(31, 99, 4096, 0)               # one wrong expectation: that page only
    got = client.read(slots, np.zeros_like(src), expect).result(T)
    assert got.ok == (True,) * 4 + (False,) + (True,) * 3


def test_a_read_over_the_message_limit_is_refused_by_the_server(server: PeerServer, small_messages: int) -> None:
    import socket

    from tierkv.net.framing import recv_message, send_message
    from tierkv.net.wire import Hello, Kind, ReadPages
    with socket.create_connection(server.address, timeout=5) as sock:
        send_message(sock, Kind.HELLO, 0, 0, 0, Hello(7).encode())
        recv_message(sock)
        send_message(sock, Kind.READ, 0, 0, 1, ReadPages((0, 1, 2, 3)).encode())
        with pytest.raises((ConnectionError, OSError)):
            recv_message(sock)                        # cut, no 4-page reply built


def test_a_lookup_of_more_keys_than_a_message_carries_is_split(server: PeerServer,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import tierkv.net.wire as wire
    import tierkv.tiers.peer as peer
    monkeypatch.setattr(wire, "MAX_LOOKUP_KEYS", 2)   # the server refuses more than 2 keys
    monkeypatch.setattr(peer, "MAX_LOOKUP_KEYS", 2)
    server.store.store([key(i) for i in range(4)], pages(4, 65536, 4))
    with PeerDramTier(connect(*server.address, kind="tcp")) as tier:
        metas = tier.lookup([key(0), key(1), key(77), key(2), key(3)])
        assert [m is not None for m in metas] == [True, True, False, True, True]


def test_a_split_batch_does_not_stall_its_link_behind_a_full_window(server: PeerServer,
                                                                   small_messages: int) -> None:
    # The next part of a split batch waits for room in the send window. Issued from the
    # link's reader (the previous part's callback), that wait stopped the reader: nothing
    # drained the window, every request expired and the link was dropped.
    config = NetConfig(window=2, links=1, timeout_s=2.0)
    with TcpTransport(*server.address, config) as tr:
        assert tr.write(list(range(32)), [1] * 32, pages(32, 4096, seed=3)).result(T).all_stored
        stop = threading.Event()

        def hammer() -> None:
            one = np.empty((1, 4096), np.uint8)
            while not stop.is_set():
                tr.read([5], one).result(T)
        threads = [threading.Thread(target=hammer) for _ in range(12)]
        for t in threads:
            t.start()
        try:
            for _ in range(3):
                res = tr.read(list(range(32)), np.empty((32, 4096), np.uint8)).result(T)
                assert res.all_ok, res.error
        finally:
            stop.set()
            for t in threads:
                t.join(T)
        assert sum(s.expired for s in tr.stats()) == 0 and sum(s.reconnects for s in tr.stats()) == 0


def test_a_peer_tier_waits_for_every_part_and_nothing_lands_after_it_gives_up(
        server: PeerServer, small_messages: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    import tierkv.net.server as srv
    import tierkv.tiers.peer as peer
    monkeypatch.setattr(peer, "pages_per_message", lambda page_bytes: 3)
    monkeypatch.setattr(peer, "_GRACE_S", 0.5)
    config = NetConfig(links=1, timeout_s=1.0)
    with PeerDramTier(connect(*server.address, kind="tcp", config=config), num_slots=16) as tier:
        tier.write(list(range(12)), np.full((12, 65536), 7, np.uint8))
        read = srv.SlotStore.read

        def slow(self: srv.SlotStore, slots: list[int], keys: object = None, scope: object = None) -> object:
            time.sleep(0.6)                             # each part well inside its 1 s deadline
            return read(self, slots, keys, scope)  # type: ignore[arg-type]
        monkeypatch.setattr(srv.SlotStore, "read", slow)
        # Four parts of 0.6 s: past one deadline and its grace together (2.4 s against
        # 1.5 s), yet each part is in time. The tier waits one deadline per part.
        dst = np.zeros((12, 65536), np.uint8)
        assert tier.fetch(list(range(12)), dst).all_ok
        assert (dst == 7).all()
        # A tier that gives up (its own deadline cut short here) does so only once no part
        # is in flight: nothing is written into the caller's buffer after it raised.
        tier._timeout_s = 0.1
        monkeypatch.setattr(peer, "_GRACE_S", 1.0)      # gives up at 1.4 s, in the third part
        dst = np.zeros((12, 65536), np.uint8)
        with pytest.raises(TierUnavailableError):
            tier.fetch(list(range(12)), dst)
        filled = int((dst[:, 0] == 7).sum())
        time.sleep(1.5)
        assert int((dst[:, 0] == 7).sum()) == filled < 12   # the part in flight landed, no later one went
