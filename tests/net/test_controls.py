"""The controls on their own: credits, the send window, the mux and the page pool."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tierkv.errors import InputError
from tierkv.net.credits import CreditGate, ReceiveLedger
from tierkv.net.mux import Mux
from tierkv.net.pool import PagePool, size_classes
from tierkv.net.window import SendWindow


# -- credits -----------------------------------------------------------------------------
def test_gate_blocks_without_credit_and_wakes_on_grant() -> None:
    gate = CreditGate(1)
    assert gate.acquire(0.01)
    assert not gate.acquire(0.01)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(gate.acquire(5)))
    t.start()
    gate.grant(1)
    t.join(5)
    assert got == [True] and gate.waits >= 2
    gate.reset(3)
    assert gate.available == 3
    gate.close()
    assert not gate.acquire(0.01)


def test_disabled_gate_never_blocks() -> None:
    gate = CreditGate(0, enabled=False)
    assert all(gate.acquire(0) for _ in range(100))


def test_ledger_counts_overruns_and_returns_credits() -> None:
    ledger = ReceiveLedger(2)
    assert ledger.consume() and ledger.consume()
    assert not ledger.consume() and ledger.overruns == 1
    ledger.repost()
    assert ledger.posted == 1 and ledger.take_grants() == 1 and ledger.take_grants() == 0


# -- window ------------------------------------------------------------------------------
def test_window_bounds_orders_acks_and_rewinds() -> None:
    w: SendWindow[str] = SendWindow(2)
    far = time.monotonic() + 60
    a, b = w.reserve("a", far), w.reserve("b", far)
    assert a is not None and b is not None and (a.seq, b.seq) == (1, 2)
    assert w.reserve("c", time.monotonic() + 0.02) is None  # full until the deadline
    assert w.next_unsent(0).item == "a" and w.next_unsent(0).item == "b"  # type: ignore[union-attr]
    assert w.next_unsent(0.01) is None
    assert w.rewind() == 2  # reconnect: both unacknowledged, resent in order
    assert w.next_unsent(0).seq == 1  # type: ignore[union-attr]
    assert w.ack(1) is not None and w.ack(1) is None
    again = w.next_unsent(0)
    assert again is not None and again.seq == 2 and again.sends == 2 and w.resends == 2
    w.retry(2, 0.05)  # a NAK: not before the RNR delay
    assert w.next_unsent(0.001) is None
    assert w.next_unsent(1).seq == 2  # type: ignore[union-attr]


def test_window_expires_and_drains() -> None:
    w: SendWindow[int] = SendWindow(4)
    w.reserve(1, time.monotonic() - 1)
    w.reserve(2, time.monotonic() + 60)
    assert [e.item for e in w.expire(time.monotonic())] == [1]
    assert [e.item for e in w.drain()] == [2] and len(w) == 0
    w.close()
    assert w.reserve(3, time.monotonic() + 1) is None


# -- mux ---------------------------------------------------------------------------------
def test_mux_keeps_a_channel_on_one_link() -> None:
    mux = Mux(["qp0", "qp1", "qp2"])
    assert [mux.route(c) for c in (0, 1, 2, 3, 4, 3)] == ["qp0", "qp1", "qp2", "qp0", "qp1", "qp0"]
    assert [(s.channel, s.link, s.requests) for s in mux.stats()] == [(0, 0, 1), (1, 1, 1), (2, 2, 1), (3, 0, 2), (4, 1, 1)]
    with pytest.raises(InputError):
        mux.route(-1)
    with pytest.raises(InputError):
        Mux([])


# -- pool --------------------------------------------------------------------------------
def test_size_classes() -> None:
    assert size_classes(4096, 65536) == (4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536)


def test_pool_blocks_are_disjoint_and_reused() -> None:
    pool = PagePool(32 << 20, chunk_bytes=1 << 20)
    rng = np.random.default_rng(0)
    blocks = [pool.allocate(int(n)) for n in rng.integers(1, 300_000, 40)]
    assert all(b is not None for b in blocks)
    spans = sorted((b.offset, b.offset + b.size) for b in blocks if b)
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
    for i, b in enumerate(blocks):  # write a pattern into each, check none overlaps
        assert b is not None and b.size >= b.length and b.size == pool.class_for(b.length)
        pool.view(b)[:] = i
    for i, b in enumerate(blocks):
        assert b is not None and (pool.view(b) == i).all()
    for b in blocks:
        assert b is not None
        pool.free(b)
    assert pool.in_use_bytes == 0
    big = pool.allocate((32 << 20) - 5)  # every chunk came back, so one run of all of them fits
    assert big is not None and big.size == 32 << 20
    assert pool.allocate(4096) is None  # exhausted: None, never an exception
    pool.free(big)
    assert pool.allocate(4096) is not None


def test_pool_refuses_foreign_blocks_and_bad_sizes() -> None:
    pool = PagePool(1 << 20, chunk_bytes=1 << 20)
    b = pool.allocate(5000)
    assert b is not None
    with pytest.raises(InputError):
        pool.free(type(b)(b.offset, 4096, 10))
    with pytest.raises(InputError):
        pool.allocate(0)
    with pytest.raises(InputError):
        PagePool(1000, chunk_bytes=1 << 20)
