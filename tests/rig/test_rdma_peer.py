"""Node-to-node page handoff over real RDMA (soft-RoCE ``rxe0`` in the rig guest).

Two processes as two nodes: a :class:`tierkv.net.PeerServer` with ``rdma=True`` in a
spawned child on the rig address, and RDMA transports in the test process. Checks round
trips bit-exact (pushes by WRITE_WITH_IMM, pulls by one-sided READ, lookup by SEND/RECV),
incast with credits (no RNR NAKs in rxe's counters), and the peer killed mid-transfer
(misses within the timeout, never wrong bytes, recovery when it returns).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.net.peers import free_port, key, pages, server_process
from tests.rig.conftest import RIG_ADDR

pytest.importorskip("pyverbs")

from tierkv.net import NetConfig, rdma_available  # noqa: E402
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


def test_rdma_peer_killed_mid_transfer_then_back() -> None:
    port = free_port()
    expected = pages(N, WIDTH, seed=3)
    with server_process(port, N, WIDTH, stored=N, seed=3, host=RIG_ADDR, rdma=True) as proc:
        tier = PeerDramTier(RdmaTransport(RIG_ADDR, port, CFG))
        metas = tier.lookup([key(i) for i in range(N)])
        wrong: list[int] = []
        good: list[int] = []
        miss_s: list[float] = []
        stop = threading.Event()

        def reader() -> None:
            dst = np.empty((N, WIDTH), np.uint8)
            while not stop.is_set():
                dst.fill(0xA5)
                t0 = time.monotonic()
                res = tier.fetch_remote(metas, dst)  # type: ignore[arg-type]
                for i, ok in enumerate(res.ok):
                    if ok:
                        (good if np.array_equal(dst[i], expected[i]) else wrong).append(i)
                if not res.all_ok:
                    miss_s.append(time.monotonic() - t0)

        t = threading.Thread(target=reader)
        t.start()
        end = time.monotonic() + 60
        while len(good) < N and time.monotonic() < end:
            time.sleep(0.05)
        proc.kill()
        proc.join(10)
        time.sleep(3)
        stop.set()
        t.join(60)
        print(f"peer killed: {len(good)} good pages, {len(miss_s)} missed reads, slowest miss {max(miss_s or [0]):.2f} s")
        assert good and not wrong and miss_s
        assert max(miss_s) < CFG.timeout_s + 2.0
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
