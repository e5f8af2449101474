"""Staging of RDMA pushes at the server: bytes land in a granted buffer, never in a slot.

A client pushes a WRITE in three steps: a SEND with the pages' metas (seq S); the
server's answer, either the :class:`~tierkv.net.wire.WriteAck` at once (every page is
decided without its bytes: a resend that already landed is DUPLICATE, an older
generation STALE) or a :class:`~tierkv.net.wire.Stage` granting a staging block of the
pages' total length, taken from the server's registered
:class:`~tierkv.net.pool.PagePool`; then one RDMA WRITE_WITH_IMM of the bytes into that
block, the immediate carrying S. On the immediate the server checks every page (slot,
generation, checksum) and copies it into its slot only when it is newer
(:meth:`SlotStore.put <tierkv.net.server.SlotStore.put>`), frees the block and acknowledges
with the statuses. So a stale push, or two writers racing on one slot, can never touch a
slot's bytes: the slot keeps the newest generation.

:class:`Pushes` is one QP's table of pushes granted and not yet landed. A block is freed
when its push lands, or by :meth:`Pushes.drop` once the QP is destroyed (no DMA can reach
the block after that). Not thread-safe: the RDMA server's progress thread owns it.
Pure Python (no pyverbs): the tests drive it with a real store and pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tierkv.net.pool import Block, PagePool
from tierkv.net.server import SlotStore
from tierkv.net.wire import PageMeta, Stage, WriteAck, WriteStatus


@dataclass(frozen=True)
class _Pending:
    metas: tuple[PageMeta, ...]
    block: Block
    since: float


class Pushes:
    """Pushes of one QP between their grant and their immediate."""

    def __init__(self, store: SlotStore, pool: PagePool, base_addr: int = 0) -> None:
        self.store, self.pool, self.base_addr = store, pool, base_addr
        self._pending: dict[int, _Pending] = {}
        self.granted = 0
        self.refused = 0
        self.answered_early = 0

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, seq: int) -> bool:
        return seq in self._pending

    def begin(self, seq: int, metas: Sequence[PageMeta], now: float) -> WriteAck | Stage:
        """The answer to WRITE ``seq``: its acknowledgement when no page needs its bytes
        (or a page is malformed: the others then FAILED), else a grant of staging for all
        of them back to back (``Stage(addr, 0)``: the pool is full, send it again later)."""
        metas = tuple(metas)
        decided = [self.store.decide(m) for m in metas]
        if WriteStatus.OUT_OF_RANGE in decided:
            return WriteAck(tuple(d if d is not None else WriteStatus.FAILED for d in decided))
        if all(d is not None for d in decided):
            self.answered_early += 1
            return WriteAck(tuple(d for d in decided if d is not None))
        old = self._pending.pop(seq, None)
        if old is not None:  # the same seq again on one QP: its earlier grant is dead
            self.pool.free(old.block)
        block = self.pool.allocate(sum(m.length for m in metas))
        if block is None:
            self.refused += 1
            return Stage(0, 0)
        self._pending[seq] = _Pending(metas, block, now)
        self.granted += 1
        return Stage(self.base_addr + block.offset, block.length)

    def land(self, seq: int) -> WriteAck:
        """The immediate of ``seq`` arrived (every byte of its push is in the block): store
        each page that is newer than its slot, free the block. An unknown ``seq`` gets an
        empty ack (the client fails that write)."""
        p = self._pending.pop(seq, None)
        if p is None:
            return WriteAck(())
        try:
            data = self.pool.view(p.block).data
            out, at = [], 0
            for m in p.metas:
                out.append(self.store.put(m.slot, m.generation, data[at:at + m.length], m.checksum))
                at += m.length
            return WriteAck(tuple(out))
        finally:
            self.pool.free(p.block)

    def oldest(self) -> float | None:
        """When the oldest push still waiting was granted (None: none waits)."""
        return min((p.since for p in self._pending.values()), default=None)

    def drop(self) -> int:
        """Free every granted block; call only once the QP is destroyed. Returns how many."""
        n = len(self._pending)
        for p in self._pending.values():
            self.pool.free(p.block)
        self._pending.clear()
        return n
