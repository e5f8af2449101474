"""Aligned host buffers: private mappings, and the scratch pool coded tiers reuse."""

from __future__ import annotations

import numpy as np
import pytest

from tierkv.errors import InputError
from tierkv.tiers import aligned
from tierkv.tiers.aligned import ALIGN, ScratchPool, aligned_empty, is_aligned
from tierkv.tiers.hugepages import HUGE_PAGE, private_huge_mode


def _mapping_flags(addr: int) -> str:
    """The permission flags of the mapping holding ``addr`` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line.split()[1]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _smaps_field(addr: int, field: str) -> list[str]:
    """The words after ``field`` in /proc/self/smaps for the mapping holding ``addr``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == field:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def huge_kib(addr: int) -> int:
    """AnonHugePages (KiB) of the mapping holding ``addr``, from /proc/self/smaps."""
    return int(_smaps_field(addr, "AnonHugePages:")[0])


needs_thp = pytest.mark.skipif(private_huge_mode() in ("unknown", "never"),
                               reason="the kernel gives no transparent huge pages here")


def test_aligned_buffers_are_private_page_aligned_zeros() -> None:
    buf = aligned_empty(3 * ALIGN + 5)
    assert buf.size == 3 * ALIGN + 5 and is_aligned(buf) and not buf.any()
    # rw-p: private anonymous memory (a shared mapping, rw-s, faults through shmem)
    assert _mapping_flags(int(buf.ctypes.data)) == "rw-p"
    with pytest.raises(InputError, match="positive size"):
        aligned_empty(0)


def test_scratch_pool_reuses_its_buffers_and_drops_oversized_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []

    def counting(nbytes: int, huge: bool = False) -> np.ndarray:
        made.append(nbytes)
        return aligned_empty(nbytes, huge=huge)

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


@needs_thp
def test_huge_buffers_start_on_a_huge_page_and_get_huge_pages_for_their_whole_ones() -> None:
    buf = aligned_empty(3 * HUGE_PAGE + 5 * ALIGN, huge=True)
    addr = int(buf.ctypes.data)
    assert buf.size == 3 * HUGE_PAGE + 5 * ALIGN and addr % HUGE_PAGE == 0 and not buf.any()
    assert _mapping_flags(addr) == "rw-p"
    buf[:] = 7
    # the three whole 2 MiB pages, not the 20 KiB tail (nothing past the buffer is taken)
    assert huge_kib(addr) == 3 * HUGE_PAGE // 1024
    assert "hg" in _smaps_field(addr, "VmFlags:")
    # the tail and the slack past it are marked never huge ("nh"), whatever the kernel's mode
    assert "nh" in _smaps_field(addr + 3 * HUGE_PAGE, "VmFlags:")
    assert (buf == 7).all()
    small = aligned_empty(HUGE_PAGE - ALIGN, huge=True)   # under 2 MiB: an ordinary buffer
    small[:] = 1
    assert is_aligned(small) and small.size == HUGE_PAGE - ALIGN
    if private_huge_mode() == "madvise":   # ("always" would give unadvised memory huge pages too)
        assert huge_kib(int(small.ctypes.data)) == 0
        plain = aligned_empty(2 * HUGE_PAGE)
        plain[:] = 1
        assert huge_kib(int(plain.ctypes.data)) == 0


@needs_thp
def test_a_huge_scratch_pool_cuts_small_buffers_out_of_one_huge_page() -> None:
    size = 300_000   # not a multiple of 4 KiB: six fit in 2 MiB at 303,104-byte strides
    pool = ScratchPool(size, keep=6, huge=True)
    first = pool.take(size)
    base = int(first.ctypes.data)
    assert base % HUGE_PAGE == 0 and first.size == size
    rest = [pool.take(1) for _ in range(5)]
    assert [int(b.ctypes.data) - base for b in rest] == [k * 303_104 for k in range(5, 0, -1)]
    bufs = [first, *rest]
    for k, b in enumerate(bufs):
        assert b.size == size and is_aligned(b)
        b[:] = k + 1
    assert all((b == k + 1).all() for k, b in enumerate(bufs))   # disjoint
    assert huge_kib(base) == HUGE_PAGE // 1024
    for b in bufs:
        pool.give(b)
    assert {id(pool.take(1)) for _ in range(6)} == {id(b) for b in bufs}   # reused, none new
    seventh = pool.take(size)   # all six out: another huge page
    assert int(seventh.ctypes.data) % HUGE_PAGE == 0 and int(seventh.ctypes.data) != base
    lean = ScratchPool(HUGE_PAGE // 2, keep=0, huge=True)   # keeps nothing: the second half is dropped
    a, b = lean.take(1), lean.take(1)
    assert int(a.ctypes.data) % HUGE_PAGE == 0 and int(b.ctypes.data) % HUGE_PAGE == 0
    whole = ScratchPool(HUGE_PAGE + ALIGN, keep=1, huge=True).take(1)   # 2 MiB or more: a buffer of its own
    assert whole.size == HUGE_PAGE + ALIGN and int(whole.ctypes.data) % HUGE_PAGE == 0
    oversized = ScratchPool(size, keep=1, huge=True).take(3 * HUGE_PAGE)   # used once: no huge pages
    oversized[:] = 1
    assert oversized.size == 3 * HUGE_PAGE
    if private_huge_mode() == "madvise":
        assert huge_kib(int(oversized.ctypes.data)) == 0
    few = ScratchPool(size, keep=2, huge=True)   # six would fit: three cut (one out, two kept)
    out = few.take(1)
    assert len(few._idle) == 2 and [int(b.ctypes.data) - int(out.ctypes.data) for b in few._idle] == [303_104, 606_208]
