"""Streamed page copies (``tierkv.tiers._copy``): the same bytes as numpy writes, on every
copy the CPU has, at any alignment; bad arguments write nothing; the DRAM tier uses it.

Skipped where the extension is not built (the tier then copies with numpy).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tierkv.store.pages import PageList
from tierkv.tiers import dram

_copy = pytest.importorskip("tierkv.tiers._copy")


def _kinds() -> list[str]:
    out = []
    for kind in ("memcpy", "sse2", "avx512"):
        try:
            _copy._set_kind(kind)
        except ValueError:
            continue
        out.append(kind)
    return out


KINDS = _kinds()


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> Iterator[str]:
    before = _copy.KIND
    _copy._set_kind(request.param)
    yield request.param
    _copy._set_kind(before)


# Widths over 16 KiB go four 4 KiB pages at a time, then by lines, then a tail: each
# part at an aligned and an unaligned destination.
GROUPED = 3 * 16384 + 4096 + 256 + 64 + 13


@pytest.mark.parametrize("stride, width", [(16384, 16384), (16384 + 24, 16384 + 3), (70000, 1000), (300, 63),
                                           (4096, 0), (GROUPED + 7, GROUPED), (GROUPED + 64, GROUPED)])
def test_rows_land_in_their_slots_and_nothing_else_changes(kind: str, stride: int, width: int) -> None:
    rng = np.random.default_rng(stride + width)
    slots = 9
    pool = rng.integers(0, 256, slots * stride + 7, dtype=np.uint8)
    dst = pool[7:]                                   # a destination off any 64-byte boundary too
    want = dst.copy()
    order = np.array([5, 0, 8, 3], np.int64)
    rows = [rng.integers(0, 256, width + i, dtype=np.uint8) for i in range(len(order))]  # longer rows: width taken
    for slot, row in zip(order.tolist(), rows):
        want[slot * stride:slot * stride + width] = row[:width]
    _copy.scatter_rows(dst, stride, order, rows, width)
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("stride, width", [(4096, 4096), (16384 + 24, 16384 + 3), (300, 63), (4096, 0),
                                           (GROUPED + 7, GROUPED)])
def test_a_block_of_rows_lands_in_its_slots(kind: str, stride: int, width: int) -> None:
    rng = np.random.default_rng(stride * 5 + width)
    pool = rng.integers(0, 256, 9 * stride + 3, dtype=np.uint8)
    dst = pool[3:]                                   # off any 64-byte boundary
    want = dst.copy()
    order = np.array([7, 1, 4], np.int64)
    src_stride = width + 5                           # rows spaced wider than they are copied
    src = rng.integers(0, 256, len(order) * src_stride + 1, dtype=np.uint8)[1:]
    for i, slot in enumerate(order.tolist()):
        want[slot * stride:slot * stride + width] = src[i * src_stride:i * src_stride + width]
    _copy.scatter_block(dst, stride, order, src, src_stride, width)
    assert np.array_equal(dst, want)


def test_a_block_with_bad_bounds_writes_nothing() -> None:
    dst = np.zeros(4 * 1024, np.uint8)
    src = np.ones(2 * 1024, np.uint8)
    for slots, src_stride, width in (([0, 4], 1024, 1024), ([0, -1], 1024, 1024), ([0, 1, 2], 1024, 1024),
                                     ([0, 1], 512, 1024), ([0], 2048, 2048),
                                     ([0, 0, 0], 2**62, 1)):   # (n - 1) * src_stride would overflow
        with pytest.raises(ValueError):
            _copy.scatter_block(dst, 1024, np.array(slots, np.int64), src, src_stride, width)
        assert not dst.any()
    with pytest.raises(ValueError, match="C-contiguous"):
        _copy.scatter_block(dst, 1024, np.zeros(1, np.int64), np.ones((4, 512), np.uint8)[:, ::2], 256, 256)
    with pytest.raises(TypeError):
        _copy.scatter_block(bytes(4096), 1024, np.zeros(1, np.int64), src, 1024, 1024)   # read-only dst


def test_bad_arguments_write_nothing() -> None:
    dst = np.zeros(4 * 1024, np.uint8)
    row = np.ones(1024, np.uint8)
    for slots, rows, width, error in (
            ([0, 4], [row, row], 1024, ValueError),            # slot 4 lies past the buffer
            ([0, -1], [row, row], 1024, ValueError),
            ([0, 1], [row, row[:100]], 1024, ValueError),      # a row shorter than the width
            ([0, 1], [row, np.ones(2048, np.uint8)[::2]], 1024, (BufferError, ValueError)),   # not contiguous
            ([0, 1], [row], 1024, ValueError),                  # rows and slots disagree
            ([0], [row], 2048, ValueError)):                    # width beyond the stride
        with pytest.raises(error):
            _copy.scatter_rows(dst, 1024, np.array(slots, np.int64), rows, width)
        assert not dst.any()
    with pytest.raises(TypeError):
        _copy.scatter_rows(bytes(4096), 1024, np.zeros(1, np.int64), [row], 1024)   # read-only
    with pytest.raises(ValueError, match="not a copy this CPU has"):
        _copy._set_kind("neon")


def _count_rows(monkeypatch: pytest.MonkeyPatch, name: str, rows_arg: int) -> list[int]:
    """Each call of ``_copy.<name>`` that copied, as its number of rows."""
    calls: list[int] = []
    real = getattr(_copy, name)

    def counting(*args: object) -> None:
        real(*args)   # counted only once it copied (did not raise)
        calls.append(len(args[rows_arg]))   # type: ignore[arg-type]
    monkeypatch.setattr(_copy, name, counting)
    return calls


@pytest.mark.parametrize("page", [4096, 16384, 256 * 1024 + 64])
def test_the_dram_tier_streams_pages_in_and_reads_them_back(kind: str, page: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    streamed = _count_rows(monkeypatch, "scatter_rows", 3)
    blocks = _count_rows(monkeypatch, "scatter_block", 3)
    tier = dram.DramTier(8, page)
    try:
        rng = np.random.default_rng(page)
        batch = rng.integers(0, 256, (3, page), dtype=np.uint8)
        tier.write([6, 1, 2], batch)
        listed = [rng.integers(0, 256, page, dtype=np.uint8) for _ in range(2)]
        tier.write([0, 7], PageList(listed, page))
        assert blocks == [3] and streamed == [2]
        out = np.zeros((5, page), np.uint8)
        tier.read([6, 1, 2, 0, 7], out)
        assert np.array_equal(out[:3], batch) and np.array_equal(out[3], listed[0]) and np.array_equal(out[4], listed[1])
    finally:
        tier.close()


@pytest.mark.parametrize("stride, width", [(16384, 16384), (16384 + 24, 16384 + 3), (300, 63),
                                           (GROUPED + 7, GROUPED)])
def test_gathered_rows_are_the_slots_bytes(kind: str, stride: int, width: int) -> None:
    rng = np.random.default_rng(stride * 3 + width)
    src = rng.integers(0, 256, 9 * stride + 5, dtype=np.uint8)[5:]
    order = np.array([8, 2, 2, 0], np.int64)
    out_stride = width + 7
    out = np.zeros(len(order) * out_stride, np.uint8)
    _copy.gather_rows(src, stride, order, out, out_stride, width)
    want = np.zeros_like(out)
    for i, slot in enumerate(order.tolist()):
        want[i * out_stride:i * out_stride + width] = src[slot * stride:slot * stride + width]
    assert np.array_equal(out, want)


def test_a_gather_with_bad_bounds_writes_nothing() -> None:
    src = np.ones(4 * 1024, np.uint8)
    out = np.zeros(2 * 1024, np.uint8)
    for slots, out_stride, width in (([0, 4], 1024, 1024), ([0, -1], 1024, 1024), ([0, 1, 2], 1024, 1024),
                                     ([0, 1], 512, 1024), ([0], 1024, 2048),
                                     ([0, 0, 0], 2**62, 1)):   # (n - 1) * out_stride would overflow
        with pytest.raises(ValueError):
            _copy.gather_rows(src, 1024, np.array(slots, np.int64), out, out_stride, width)
        assert not out.any()
    with pytest.raises(TypeError):
        _copy.gather_rows(src, 1024, np.zeros(1, np.int64), bytes(1024), 1024, 1024)   # read-only out


def test_the_dram_tier_streams_large_reads_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of 4 MiB or more streams; a smaller one stays in the cache for its reader."""
    gathered = _count_rows(monkeypatch, "gather_rows", 2)
    page = 1 << 20
    tier = dram.DramTier(6, page)
    try:
        batch = np.random.default_rng(1).integers(0, 256, (5, page), dtype=np.uint8)
        tier.write([4, 0, 1, 3, 5], batch)
        out = np.zeros((5, page), np.uint8)
        tier.read([4, 0, 1, 3, 5], out)
        assert gathered == [5] and np.array_equal(out, batch)
        tier.read([0, 1], out[:2])
        assert gathered == [5] and np.array_equal(out[:2], batch[1:3])
        monkeypatch.setattr(dram, "_ONE_COPY", 4 * page)   # one run this long is memcpy's to stream
        out[:] = 0
        tier.read([0, 1, 2, 3, 4], out)
        assert gathered == [5] and np.array_equal(out[[0, 1, 3, 4]], batch[[1, 2, 3, 0]])
    finally:
        tier.close()
