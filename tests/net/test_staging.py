"""The RDMA resend and staging logic on its own, with a real slot store, pool and window:
pushes land in staging and reach a slot only when newer; a resend that already landed
is DUPLICATE without moving bytes; an attempt retired by a lost QP frees its blocks and
its operation goes out again, once, in order; a deadline resolves an operation once."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from tests.net.peers import pages
from tierkv.net.inflight import Op
from tierkv.net.pool import PagePool
from tierkv.net.server import SlotStore
from tierkv.net.staging import Pushes
from tierkv.net.window import SendWindow
from tierkv.net.wire import PageMeta, Stage, WriteAck, WriteStatus, page_checksum
from tierkv.tiers.dram import DramTier

W = 4096


def metas_of(slots: list[int], gen: int, src: np.ndarray) -> tuple[PageMeta, ...]:
    return tuple(PageMeta(s, gen, W, page_checksum(src[i].data)) for i, s in enumerate(slots))


def push(p: Pushes, seq: int, metas: tuple[PageMeta, ...], src: np.ndarray) -> WriteAck:
    """What the client does: SEND the metas, WRITE the bytes into the granted block, immediate."""
    got = p.begin(seq, metas, time.monotonic())
    if isinstance(got, WriteAck):
        return got
    assert got.length == src.nbytes
    off = got.addr - p.base_addr
    p.pool.buffer[off:off + src.nbytes] = src.reshape(-1)  # the RDMA WRITE
    return p.land(seq)


def make() -> tuple[SlotStore, Pushes]:
    store = SlotStore(DramTier(16, W))
    return store, Pushes(store, PagePool(2 << 20), base_addr=1 << 40)


def test_push_lands_via_staging_and_resend_is_duplicate_without_bytes() -> None:
    store, p = make()
    src = pages(4, W, 1)
    m = metas_of([3, 4, 5, 6], 7, src)
    assert push(p, 1, m, src).statuses == (WriteStatus.STORED,) * 4
    assert p.pool.in_use_bytes == 0 and len(p) == 0
    assert bytes(store.tier.buffer[4]) == src[1].tobytes()
    again = p.begin(2, m, time.monotonic())  # the resend after a QP reset: no staging granted
    assert again == WriteAck((WriteStatus.DUPLICATE,) * 4) and p.pool.in_use_bytes == 0
    older = metas_of([3], 6, pages(1, W, 9))
    assert p.begin(3, older, time.monotonic()) == WriteAck((WriteStatus.STALE,))


def test_racing_pushes_leave_the_newest_generation() -> None:
    store, p = make()
    a, b = pages(1, W, 2), pages(1, W, 3)
    ga, gb = p.begin(1, metas_of([0], 5, a), 0.0), p.begin(2, metas_of([0], 6, b), 0.0)
    assert isinstance(ga, Stage) and isinstance(gb, Stage) and ga.addr != gb.addr  # both granted
    for g, src in ((ga, a), (gb, b)):
        off = g.addr - p.base_addr
        p.pool.buffer[off:off + W] = src.reshape(-1)
    assert p.land(2).statuses == (WriteStatus.STORED,)
    assert p.land(1).statuses == (WriteStatus.STALE,)  # the older one lands last: the slot is untouched
    assert bytes(store.tier.buffer[0]) == b.tobytes() and store.meta(0).generation == 6
    assert p.pool.in_use_bytes == 0


def test_bad_bytes_never_reach_the_slot_and_full_staging_is_refused() -> None:
    store, p = make()
    src = pages(1, W, 4)
    assert push(p, 1, metas_of([2], 1, src), src).statuses == (WriteStatus.STORED,)
    m = metas_of([2], 2, pages(1, W, 5))
    assert push(p, 2, m, src).statuses == (WriteStatus.BAD_CHECKSUM,)  # bytes do not match the meta
    assert bytes(store.tier.buffer[2]) == src.tobytes() and store.meta(2).generation == 1
    big = PageMeta(1, 1, W, 0)
    assert p.begin(3, (PageMeta(99, 1, W, 0), big), 0.0) == WriteAck((WriteStatus.OUT_OF_RANGE, WriteStatus.FAILED))
    grants = [p.begin(10 + i, metas_of([i], 1, pages(1, W, i)), float(i)) for i in range(16)]
    assert all(isinstance(g, Stage) and g.length == W for g in grants)
    tiny = Pushes(store, PagePool(1 << 20, min_class_bytes=W), 0)
    many = [tiny.begin(i, metas_of([0], 9, pages(1, W, 0)) * 200, 0.0) for i in range(2)]
    assert many[0] == Stage(0, 200 * W) and many[1] == Stage(0, 0) and tiny.refused == 1
    assert p.oldest() == 0.0 and p.drop() == 16 and p.pool.in_use_bytes == 0  # a dropped QP frees its staging


def op(deadline: float) -> Op:
    return Op(deadline, lambda why: ("failed", why), Future(), lambda link, o: None, credits=2)


def test_retired_attempts_free_blocks_and_the_window_resends_in_order() -> None:
    pool = PagePool(4 << 20)
    w: SendWindow[Op] = SendWindow(8)
    far = time.monotonic() + 60
    ops = [op(far) for _ in range(3)]
    for o in ops:
        assert w.reserve(o, far) is not None
    link: Any = object()
    for _ in ops:  # the first QP takes all three and allocates for them
        e = w.next_unsent(0)
        assert e is not None
        e.item.seq = e.seq
        e.item.begin(link)
        b = pool.allocate(3 * W)
        assert b is not None
        e.item.blocks.append(b)
    stale_attempt = ops[0].attempt
    assert ops[0].resolve(lambda: "answered") and w.ack(ops[0].seq) is not None
    ops[0].retire(pool)
    for o in ops[1:]:  # the QP is lost: its attempts are retired after it is destroyed
        o.retire(pool)
    assert pool.in_use_bytes == 0 and ops[0].attempt != stale_attempt
    assert w.rewind() == 2  # the next QP: only the unanswered go out again, in order, once
    again = [w.next_unsent(0), w.next_unsent(0), w.next_unsent(0.01)]
    assert [e.item for e in again if e] == ops[1:] and again[2] is None and w.resends == 2
    assert ops[0].future.result(0) == "answered"


def test_an_operation_resolves_once_and_a_late_answer_is_dropped() -> None:
    o = op(time.monotonic() - 1)
    w: SendWindow[Op] = SendWindow(2)
    w.reserve(o, o.deadline)
    [gone] = w.expire(time.monotonic())
    copied: list[int] = []
    assert gone.item.resolve(lambda: o.fail("deadline"))
    assert not o.resolve(lambda: copied.append(1))  # a read's late verify never copies into dst
    assert copied == [] and o.done and o.future.result(0) == ("failed", "deadline")
    broken = op(time.monotonic() + 5)
    assert broken.resolve(lambda: 1 / 0) and broken.future.result(0)[0] == "failed"
