"""Losing the peer mid-transfer: a real server process killed with SIGKILL.

The client must get misses within its timeout (never wrong or partial pages), and must
recover by itself when a new server comes up on the same port.
"""

from __future__ import annotations

import time

import numpy as np

from tests.net.peers import free_port, key, kill_mid_read, pages, server_process
from tierkv.errors import TierIOError
from tierkv.net import NetConfig, TcpTransport
from tierkv.tiers.peer import PeerDramTier

N, WIDTH = 64, 256 << 10  # 16 MiB a batch: the kill lands mid-transfer
TIMEOUT_S = 2.0
CFG = NetConfig(timeout_s=TIMEOUT_S, links=2, backoff_initial_s=0.05, backoff_max_s=0.5)


def test_peer_killed_mid_read_gives_misses_then_recovers() -> None:
    port = free_port()
    expected = pages(N, WIDTH, seed=11)
    with server_process(port, N, WIDTH, stored=N, seed=11) as proc:
        tier = PeerDramTier(TcpTransport("127.0.0.1", port, CFG))
        metas = tier.lookup([key(i) for i in range(N)])
        assert all(m is not None for m in metas)
        seen = kill_mid_read(tier, metas, expected, proc, first_batch_s=30, settle_s=1.0)
        assert seen.good and not seen.wrong
        assert seen.miss_s and max(seen.miss_s) < TIMEOUT_S + 1.0

    with server_process(port, N, WIDTH, stored=N, seed=11):  # the peer returns on the same port
        assert tier.transport.wait_connected(10)
        metas2 = tier.lookup([key(i) for i in range(N)])
        dst = np.empty((N, WIDTH), np.uint8)
        assert tier.fetch_remote(metas2, dst).all_ok  # type: ignore[arg-type]
        np.testing.assert_array_equal(dst, expected)
    tier.close()


def test_pages_written_before_a_restart_are_misses_not_zeros() -> None:
    port = free_port()
    src = pages(8, 4096, 12)
    with server_process(port, 16, 4096) as proc:
        tier = PeerDramTier(TcpTransport("127.0.0.1", port, CFG))
        tier.write(list(range(8)), src)
        dst = np.zeros_like(src)
        tier.read(list(range(8)), dst)
        np.testing.assert_array_equal(dst, src)
        proc.kill()
        proc.join(10)
        t0 = time.monotonic()
        try:
            tier.read(list(range(8)), dst)
            raise AssertionError("a read from a dead peer succeeded")
        except TierIOError:
            assert time.monotonic() - t0 < TIMEOUT_S + 1.0
    with server_process(port, 16, 4096):
        assert tier.transport.wait_connected(10)
        res = tier.fetch(list(range(8)), np.full_like(src, 0xA5))
        assert res.misses == 8  # the new peer's memory is empty: misses, never its zeros
        tier.write([0, 1], src[:2])
        dst = np.zeros((2, 4096), np.uint8)
        tier.read([0, 1], dst)
        np.testing.assert_array_equal(dst, src[:2])
    tier.close()
