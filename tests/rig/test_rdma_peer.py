"""Node-to-node page handoff over real RDMA (soft-RoCE ``rxe0`` in the rig guest).

Two processes as two nodes: a :class:`tierkv.net.PeerServer` with ``rdma=True`` in a
spawned child on the rig address, and RDMA transports in the test process. Checks round
trips bit-exact (pushes through granted staging by WRITE_WITH_IMM, pulls by one-sided
READ, lookup by SEND/RECV), incast with credits (no RNR NAKs in rxe's counters), the
server moving every QP to ERR mid-batch (operations resent on new QPs: every write
stored, every page exact, no wrong page read meanwhile), two writers racing pushes with
interleaved generations on the same slots (the newest generation's bytes win, never a
torn or older page), and the peer killed mid-transfer (misses within the timeout, never
wrong bytes, recovery when it returns).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.net.peers import free_port, key, kill_mid_read, pages, reset_event, server_process
from tests.rig.conftest import RIG_ADDR

pytest.importorskip("pyverbs")

from tierkv.net import NetConfig, WriteStatus, rdma_available  # noqa: E402
from tierkv.net.rdma_client import RdmaTransport  # noqa: E402
from tierkv.tiers.peer import PeerDramTier  # noqa: E402

pytestmark = [pytest.mark.rdma, pytest.mark.skipif(not rdma_available(), reason="no RDMA device")]
CFG = NetConfig(timeout_s=8.0, links=2, recv_credits=8, window=16, pool_bytes=16 << 20)
COUNTERS = Path("/sys/class/infiniband/rxe0/ports/1/hw_counters")
N, WIDTH = 32, 16384


def rnr_counts() -> dict[str, int]:
    """rxe's RNR counters (``rcvd_rnr_err``, ``send_rnr_err``, ``retry_rnr_exceeded_err``)."""
    out = {}
    for d in (COUNTERS, COUNTERS.parent / "counters"):
        if d.is_dir():
            for f in d.iterdir():
                if "rnr" in f.name:
                    out[f.name] = int(f.read_text().split()[0])
    return out


@pytest.fixture
def peer() -> Iterator[int]:
    port = free_port()
    with server_process(port, 8 * N, WIDTH, stored=N, seed=1, host=RIG_ADDR, rdma=True):
        yield port


def test_rdma_round_trips_bit_exact(peer: int) -> None:
    with RdmaTransport(RIG_ADDR, peer, CFG) as tr:
        src = pages(N, WIDTH, seed=2)
        slots = list(range(N, 2 * N))
        res = tr.write(slots, [1] * N, src).result(30)
        assert res.all_stored, res
        dst = np.full_like(src, 0xA5)
        assert tr.read(slots[::-1], dst).result(30).all_ok
        np.testing.assert_array_equal(dst, src[::-1])
        narrow = np.zeros((3, 1000), np.uint8)
        assert tr.read([slots[5], slots[0], slots[9]], narrow).result(30).all_ok
        np.testing.assert_array_equal(narrow, src[[5, 0, 9], :1000])
        assert tr.write([slots[0]], [1], src[:1]).result(30).statuses[0].name == "DUPLICATE"
    with PeerDramTier(RdmaTransport(RIG_ADDR, peer, CFG)) as tier:  # lookup over SEND/RECV, pages by READ
        metas = tier.lookup([key(i) for i in range(N)] + [key(10**6)])
        assert metas[-1] is None and all(m is not None for m in metas[:-1])
        dst = np.empty((N, WIDTH), np.uint8)
        assert tier.fetch_remote(metas[:-1], dst).all_ok  # type: ignore[arg-type]
        np.testing.assert_array_equal(dst, pages(N, WIDTH, seed=1))


def test_rdma_incast_with_credits_has_no_rnr(peer: int) -> None:
    before = rnr_counts()
    exact: list[bool] = []

    def sender(i: int) -> None:
        with RdmaTransport(RIG_ADDR, peer, CFG) as tr:
            src = pages(8, WIDTH, seed=10 + i)
            slots = [2 * N + i * 8 + b for b in range(8)]
            ws = [tr.write([s], [1], src[b:b + 1], channel=b) for b, s in enumerate(slots)]
            ok = all(f.result(60).all_stored for f in ws)
            dst = np.zeros_like(src)
            rs = [tr.read([s], dst[b:b + 1], channel=b) for b, s in enumerate(slots)]
            ok = ok and all(f.result(60).all_ok for f in rs)
            exact.append(ok and bool((dst == src).all()))

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = rnr_counts()
    print("rxe RNR counters before", before, "after", after)
    assert exact == [True] * 4
    assert all(after[k] == before.get(k, 0) for k in after), (before, after)


def test_rdma_qp_reset_mid_batch_resends_every_write() -> None:
    """The server moves every QP to ERR while writes and reads are in flight: the client
    rebuilds its QPs and resends; every write ends STORED or DUPLICATE (a resend of one
    that had landed), every page reads back exactly, and no read returned a wrong page."""
    cfg = NetConfig(timeout_s=20.0, links=2, recv_credits=8, window=16, pool_bytes=16 << 20)
    port, reset = free_port(), reset_event()
    n = 4 * N
    old, new = pages(n, WIDTH, seed=21), pages(n, WIDTH, seed=22)
    with server_process(port, 8 * N, WIDTH, host=RIG_ADDR, rdma=True, reset=reset), \
            RdmaTransport(RIG_ADDR, port, cfg) as tr:
        assert tr.write(list(range(n)), [1] * n, old).result(60).all_stored
        dst = np.full((n, WIDTH), 0xA5, np.uint8)
        t0 = time.monotonic()
        writes, reads = [], []
        for s in range(n):  # one page per op over 8 channels (2 QPs); the reset lands mid-batch
            writes.append((time.monotonic(), tr.write([s], [2], new[s:s + 1], channel=s % 8)))
            reads.append(tr.read([s], dst[s:s + 1], channel=(s + 3) % 8))
            if s == 24:
                reset.set()
        statuses = [f.result(60) for _, f in writes]
        read_res = [f.result(60) for f in reads]
        slowest = max(time.monotonic() - t for t, _ in writes)
        wrong = [s for s, r in enumerate(read_res)
                 if r.ok[0] and not np.array_equal(dst[s], (old if r.metas[0].generation == 1 else new)[s])]
        st = tr.stats()
        dups = sum(r.statuses[0] == WriteStatus.DUPLICATE for r in statuses)
        print(f"QP reset mid-batch: {n} writes + {n} reads in {time.monotonic() - t0:.1f} s, slowest write "
              f"{slowest:.2f} s; resent {sum(x.resent for x in st)}, reconnects {sum(x.reconnects for x in st)}, "
              f"DUPLICATE {dups}, reads missed {sum(not r.ok[0] for r in read_res)}, wrong {len(wrong)}")
        assert not wrong
        assert all(r.all_stored for r in statuses), [r.error for r in statuses if not r.all_stored][:3]
        assert sum(x.reconnects for x in st) >= 1 and sum(x.resent for x in st) >= 1
        back = np.zeros_like(new)
        res = tr.read(list(range(n)), back).result(60)
        assert res.all_ok and {m.generation for m in res.metas} == {2}
        np.testing.assert_array_equal(back, new)


def test_rdma_two_writers_race_newest_generation_wins(peer: int) -> None:
    """Two clients push the same slots with interleaved generations (one odd, one even),
    many pushes in flight over several QPs, while a third reads: every page read is
    exactly the version its generation names; at the end each slot holds the newest."""
    slots = list(range(6 * N, 6 * N + 8))
    rounds = 12
    data = {(w, r): pages(len(slots), WIDTH, seed=1000 + 100 * w + r) for w in (0, 1) for r in range(rounds)}
    by_gen = {2 * r + w + 1: data[w, r] for (w, r) in data}
    statuses: list[WriteStatus] = []
    wrong: list[tuple[int, int]] = []
    seen = [0, 0]
    stop = threading.Event()

    def writer(w: int) -> None:
        with RdmaTransport(RIG_ADDR, peer, CFG) as tr:
            futs = [tr.write(slots, [2 * r + w + 1] * len(slots), data[w, r], channel=(r + w) % 4)
                    for r in range(rounds)]
            for f in futs:
                statuses.extend(f.result(60).statuses)

    def reader() -> None:
        with RdmaTransport(RIG_ADDR, peer, CFG) as tr:
            dst = np.empty((len(slots), WIDTH), np.uint8)
            while not stop.is_set():
                res = tr.read(slots, dst).result(60)
                for i, ok in enumerate(res.ok):
                    seen[ok] += 1
                    if ok and not np.array_equal(dst[i], by_gen[res.metas[i].generation][i]):
                        wrong.append((i, res.metas[i].generation))

    rt = threading.Thread(target=reader)
    rt.start()
    ws = [threading.Thread(target=writer, args=(w,)) for w in (0, 1)]
    for t in ws:
        t.start()
    for t in ws:
        t.join(180)
    stop.set()
    rt.join(60)
    counts = {s.name: statuses.count(s) for s in set(statuses)}
    print(f"two writers racing: statuses {counts}; concurrent reads ok {seen[1]}, missed {seen[0]}, wrong {len(wrong)}")
    assert not wrong
    assert len(statuses) == 2 * rounds * len(slots)
    assert set(statuses) <= {WriteStatus.STORED, WriteStatus.STALE, WriteStatus.DUPLICATE}, counts
    with RdmaTransport(RIG_ADDR, peer, CFG) as tr:
        dst = np.empty((len(slots), WIDTH), np.uint8)
        res = tr.read(slots, dst).result(60)
        assert res.all_ok and {m.generation for m in res.metas} == {2 * rounds}
        np.testing.assert_array_equal(dst, data[1, rounds - 1])


def test_rdma_peer_killed_mid_transfer_then_back() -> None:
    port = free_port()
    expected = pages(N, WIDTH, seed=3)
    with server_process(port, N, WIDTH, stored=N, seed=3, host=RIG_ADDR, rdma=True) as proc:
        tier = PeerDramTier(RdmaTransport(RIG_ADDR, port, CFG))
        metas = tier.lookup([key(i) for i in range(N)])
        seen = kill_mid_read(tier, metas, expected, proc, first_batch_s=60, settle_s=3, poll_s=0.05)
        print(f"peer killed: {len(seen.good)} good pages, {len(seen.miss_s)} missed reads, "
              f"slowest miss {max(seen.miss_s or [0]):.2f} s")
        assert seen.good and not seen.wrong and seen.miss_s
        assert max(seen.miss_s) < CFG.timeout_s + 2.0
    with server_process(port, N, WIDTH, stored=N, seed=3, host=RIG_ADDR, rdma=True):
        assert tier.transport.wait_connected(30)
        metas2 = tier.lookup([key(i) for i in range(N)])
        dst = np.empty((N, WIDTH), np.uint8)
        assert tier.fetch_remote(metas2, dst).all_ok  # type: ignore[arg-type]
        np.testing.assert_array_equal(dst, expected)
    tier.close()


def test_rdma_vs_tcp_numbers(peer: int) -> None:
    """Not a timing claim: prints the page-fetch benchmark for docs (tierkv.bench.net)."""
    from tierkv.bench.net import run_net_bench

    for line in run_net_bench(RIG_ADDR, peer, kinds=("rdma", "tcp"), page_bytes=WIDTH, pages=N, fetches=120, senders=4):
        print("BENCH", line)
    assert os.environ.get("TIERKV_RIG_GUEST") == "1"
