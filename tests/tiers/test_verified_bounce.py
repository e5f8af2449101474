"""Which rows a direct NVMe transfer moves in place and which through the tier's huge-page
bounce buffers: without checksums every aligned row goes in place; with them (every
transfer of the store's) only rows known to lie on huge pages do, since the copy is the
hash's pass anyway (docs/design.md, "NVMe I/O"). And ``on_huge_pages``, which says which
rows those are."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.tiers.test_aligned import needs_thp
from tests.tiers.test_conformance import pages
from tierkv.store.checksum import checksum64
from tierkv.store.pages import PageList
from tierkv.tiers import aligned
from tierkv.tiers.aligned import aligned_empty, on_huge_pages
from tierkv.tiers.nvme import NvmeTier

WIDTH = 256 << 10
N = 16


@pytest.fixture
def tier(tmp_path: Path) -> NvmeTier:
    t = NvmeTier(tmp_path / "t.dat", N, WIDTH)
    if not t.direct:
        t.close()
        pytest.skip(f"{tmp_path}'s filesystem takes no O_DIRECT")
    return t


def counting(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    borrowed: list[int] = []
    real = tier._bounce.borrow

    def borrow() -> object:
        borrowed.append(1)
        return real()

    monkeypatch.setattr(tier._bounce, "borrow", borrow)
    return borrowed


def moved(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch, rows: Callable[[], np.ndarray], checksums: bool) -> str:
    """'in place' or 'bounced': how a write and a read of the rows went (bytes and sums checked)."""
    borrowed = counting(tier, monkeypatch)
    src = rows()
    src[...] = pages(N, WIDTH, seed=5)
    sums = tier.write(list(range(N)), src, checksums=checksums)
    dst = rows()
    got = tier.read(list(range(N)), dst, checksums=checksums)
    np.testing.assert_array_equal(dst, src)
    if checksums:
        assert sums == got == [checksum64(r) for r in src]
    n = len(borrowed)
    assert n in (0, 2 * N // 4), n   # none, or every chunk (1 MiB: four rows) both ways
    return "bounced" if n else "in place"


def plain() -> np.ndarray:
    return aligned_empty(N * WIDTH).reshape(N, WIDTH)


def huge() -> np.ndarray:
    return aligned_empty(N * WIDTH, huge=True).reshape(N, WIDTH)


def test_aligned_rows_go_in_place_without_checksums(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    with tier:
        assert moved(tier, monkeypatch, plain, checksums=False) == "in place"


def test_aligned_rows_of_unknown_memory_are_bounced_when_checksummed(tier: NvmeTier,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with tier:
        assert moved(tier, monkeypatch, plain, checksums=True) == "bounced"


@needs_thp
def test_rows_on_huge_pages_go_in_place_when_checksummed(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    with tier:
        assert moved(tier, monkeypatch, huge, checksums=True) == "in place"


def test_huge_buffers_are_not_trusted_where_the_kernel_gives_none(tier: NvmeTier,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aligned, "_thp_given", lambda: False)
    with tier:
        assert moved(tier, monkeypatch, huge, checksums=True) == "bounced"


@pytest.mark.parametrize("checked", [False, True])
def test_page_lists_when_checksummed(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch, checked: bool) -> None:
    """A tier's own rows (checked, not scattered) go in place; a caller's plain ones are
    bounced, and so are a tier's marked scattered."""
    with tier:
        borrowed = counting(tier, monkeypatch)
        src = plain()
        src[...] = pages(N, WIDTH, seed=6)
        rows = PageList(list(src), WIDTH, aligned=True, checked=checked)
        assert tier.write(list(range(N)), rows, checksums=True) == [checksum64(r) for r in src]
        assert bool(borrowed) is not checked
        borrowed.clear()
        scattered = PageList(list(src), WIDTH, aligned=True, checked=checked, scattered=True)
        tier.write(list(range(N)), scattered, checksums=True)
        assert borrowed
        dst = plain()
        tier.read(list(range(N)), dst)
        np.testing.assert_array_equal(dst, src)


@needs_thp
def test_a_callers_page_list_on_huge_pages_goes_in_place(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    with tier:
        borrowed = counting(tier, monkeypatch)
        src = huge()
        src[...] = pages(N, WIDTH, seed=7)
        assert tier.write(list(range(N)), PageList(list(src), WIDTH), checksums=True) == [checksum64(r) for r in src]
        assert borrowed == []


# -- on_huge_pages ---------------------------------------------------------------------
@needs_thp
def test_on_huge_pages_knows_live_huge_buffers_and_their_views() -> None:
    a = aligned_empty(8 << 20, huge=True)
    assert on_huge_pages(a) and on_huge_pages(a[100:200]) and on_huge_pages(a[::-1])
    assert on_huge_pages(a.reshape(4, -1)[:, :4096]) and on_huge_pages(a[:0])
    tail = aligned_empty(3 << 20, huge=True)   # its last MiB keeps 4 KiB pages
    assert on_huge_pages(tail[:2 << 20]) and not on_huge_pages(tail) and not on_huge_pages(tail[(2 << 20) - 1:])
    assert not on_huge_pages(aligned_empty(8 << 20))            # asked for none
    assert not on_huge_pages(aligned_empty(1 << 20, huge=True))  # too small to get one
    assert not on_huge_pages(np.empty(1 << 20, np.uint8))
    start = int(a.ctypes.data)
    del a
    gc.collect()
    assert start not in aligned._huge   # forgotten with its mapping


def test_on_huge_pages_claims_nothing_where_the_kernel_gives_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aligned, "_thp_given", lambda: False)
    assert not on_huge_pages(aligned_empty(4 << 20, huge=True))


def test_a_stale_finalizer_leaves_a_newer_buffer_at_the_address_alone() -> None:
    """A mapping is unmapped before its finalizer runs; a buffer made meanwhile at the same
    address keeps its entry, and a dead mapping's entry counts for nothing."""
    import mmap
    import weakref

    old, new = mmap.mmap(-1, 4096), mmap.mmap(-1, 4096)   # stand for the two buffers' mappings
    start = 1 << 46
    old_ref, new_ref = weakref.ref(old), weakref.ref(new)
    with aligned._huge_lock:
        aligned._huge[start] = (start + (4 << 20), new_ref)   # the newer buffer's entry
    try:
        view = np.frombuffer(mmap.mmap(-1, 4096), np.uint8)
        assert not on_huge_pages(view)
        aligned._forget_huge(start, old_ref)                  # the old mapping's late finalizer
        assert aligned._huge[start][1] is new_ref
        del new
        gc.collect()
        assert aligned._huge[start][1]() is None              # dead, its finalizer not run yet
        aligned._forget_huge(start, new_ref)
        assert start not in aligned._huge
    finally:
        with aligned._huge_lock:
            aligned._huge.pop(start, None)


@needs_thp
def test_a_dead_mappings_entry_is_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aligned, "_forget_huge", lambda start, ref: None)   # its finalizer not run yet
    a = aligned_empty(4 << 20, huge=True)
    start = int(a.ctypes.data)

    class Addresses:   # an array naming the same addresses (made without touching them, never read)
        __array_interface__ = {"shape": (4096,), "typestr": "|u1", "data": (start, False), "version": 3}

    same = np.asarray(Addresses())
    assert on_huge_pages(same)
    del a
    gc.collect()
    try:
        listed, trusted = start in aligned._huge, on_huge_pages(same)
        del same   # never shown in a failure's report: its addresses are unmapped now
        assert listed and not trusted
    finally:
        with aligned._huge_lock:
            aligned._huge.pop(start, None)
