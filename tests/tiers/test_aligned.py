"""Aligned host buffers: private mappings, and the scratch pool coded tiers reuse."""

from __future__ import annotations

import numpy as np
import pytest

from tierkv.errors import InputError
from tierkv.tiers import aligned
from tierkv.tiers.aligned import ALIGN, ScratchPool, aligned_empty, is_aligned


def _mapping_flags(addr: int) -> str:
    """The permission flags of the mapping holding ``addr`` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line.split()[1]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_aligned_buffers_are_private_page_aligned_zeros() -> None:
    buf = aligned_empty(3 * ALIGN + 5)
    assert buf.size == 3 * ALIGN + 5 and is_aligned(buf) and not buf.any()
    # rw-p: private anonymous memory (a shared mapping, rw-s, faults through shmem)
    assert _mapping_flags(int(buf.ctypes.data)) == "rw-p"
    with pytest.raises(InputError, match="positive size"):
        aligned_empty(0)


def test_scratch_pool_reuses_its_buffers_and_drops_oversized_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []

    def counting(nbytes: int) -> np.ndarray:
        made.append(nbytes)
        return aligned_empty(nbytes)

    monkeypatch.setattr(aligned, "aligned_empty", counting)
    pool = ScratchPool(8 * ALIGN, keep=2)
    a, b = pool.take(5 * ALIGN), pool.take(8 * ALIGN)
    assert made == [8 * ALIGN, 8 * ALIGN] and a is not b and is_aligned(a) and is_aligned(b)
    pool.give(a)
    pool.give(b)
    again = [pool.take(ALIGN), pool.take(3)]
    assert made == [8 * ALIGN, 8 * ALIGN] and {id(x) for x in again} == {id(a), id(b)}   # no new buffer
    big = pool.take(8 * ALIGN + 1)   # more than a buffer holds: one of its own size, not kept
    assert big.size == 8 * ALIGN + 1 and made[-1] == 8 * ALIGN + 1
    pool.give(big)
    for x in again:
        pool.give(x)
    pool.give(aligned_empty(8 * ALIGN))   # a third idle buffer: past keep, dropped
    assert [pool.take(1) for _ in range(2)] and len(made) == 3   # the two kept ones
    assert pool.take(1) is not None and len(made) == 4           # then a new one
    pool.clear()
    with pytest.raises(InputError):
        ScratchPool(0, keep=1)
