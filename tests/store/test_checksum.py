"""tierkv.store.checksum: copy_checksummed (the copy and its checksums in one pass) against
the copy followed by checksum64, on the C path and the fallback."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from tierkv.store import checksum
from tierkv.tiers.aligned import aligned_empty

# Around the one-shot/streaming switch (16 KiB), xxh3's short and mid-size paths (240
# bytes), its stripes (64) and blocks (1024), and a 64-byte store boundary.
WIDTHS = [0, 1, 63, 64, 65, 240, 241, 1024, 1025, 16383, 16384, 16385, 16384 * 3 + 17, 262144, 2 << 20]


def want(rows: np.ndarray) -> list[int]:
    return [xxhash.xxh3_64_intdigest(bytes(r)) for r in rows]


@pytest.fixture(params=["native", "fallback"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        if checksum._native_copy is None:
            pytest.skip("tierkv._native is not built")
    else:
        monkeypatch.setattr(checksum, "_native_copy", None)
    return str(request.param)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("shift", [0, 1, 16, 63])
def test_copies_and_hashes_rows_at_any_alignment(impl: str, width: int, shift: int) -> None:
    rng = np.random.default_rng(width + shift)
    n = 3
    src = rng.integers(0, 256, size=(n, width + 7), dtype=np.uint8)[:, 5:5 + width]   # rows strided
    dst = aligned_empty(n * width + shift + 64)[shift:shift + n * width].reshape(n, width)
    dst[...] = 0xA5
    assert checksum.copy_checksummed(dst, src) == want(src)
    np.testing.assert_array_equal(dst, src)


def test_rows_of_a_wider_buffer_leave_the_rest_alone(impl: str) -> None:
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, size=(4, 40000), dtype=np.uint8)
    big = np.full((4, 50000), 0x5A, dtype=np.uint8)
    assert checksum.copy_checksummed(big[:, 1000:41000], src) == want(src)
    np.testing.assert_array_equal(big[:, 1000:41000], src)
    assert (big[:, :1000] == 0x5A).all() and (big[:, 41000:] == 0x5A).all()


def test_rows_that_are_not_contiguous_take_the_two_passes(impl: str) -> None:
    rng = np.random.default_rng(8)
    src = rng.integers(0, 256, size=(3, 2 * 20000), dtype=np.uint8)[:, ::2]   # every other byte
    dst = np.zeros((3, 20000), dtype=np.uint8)
    assert checksum.copy_checksummed(dst, src) == want(src)
    np.testing.assert_array_equal(dst, src)


def test_shapes_must_match(impl: str) -> None:
    with pytest.raises(ValueError, match="of one shape"):
        checksum.copy_checksummed(np.zeros((4, 64), np.uint8), np.zeros((1, 64), np.uint8))  # no broadcast
    with pytest.raises(ValueError, match="2-D"):
        checksum.copy_checksummed(np.zeros(64, np.uint8), np.zeros(64, np.uint8))
    assert checksum.copy_checksummed(np.zeros((0, 64), np.uint8), np.zeros((0, 64), np.uint8)) == []


def test_the_extension_refuses_bad_buffers_itself() -> None:
    native = checksum._native_copy
    if native is None:
        pytest.skip("tierkv._native is not built")
    ro = np.zeros((2, 64), np.uint8)
    ro.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        native(ro, np.zeros((2, 64), np.uint8))
    with pytest.raises(ValueError, match="contiguous rows"):
        native(np.zeros((2, 64), np.uint8), np.zeros((2, 128), np.uint8)[:, ::2])
    with pytest.raises(ValueError, match="dst is 2 x 64 bytes, src 3 x 64"):
        native(np.zeros((2, 64), np.uint8), np.zeros((3, 64), np.uint8))
    with pytest.raises(ValueError, match="2-D buffer of bytes"):
        native(np.zeros((2, 8), np.uint64), np.zeros((2, 8), np.uint64))


@pytest.mark.parametrize("width", [0, 241, 16385, 262144])
def test_separate_rows_copied_and_hashed(impl: str, width: int) -> None:
    rng = np.random.default_rng(width)
    rows = [rng.integers(0, 256, size=width + 3, dtype=np.uint8)[i % 3:i % 3 + width] for i in range(5)]
    dst = np.full((5, width), 0xA5, dtype=np.uint8)
    assert checksum.copy_checksummed_rows(dst, rows) == want(np.array(rows).reshape(5, width))
    for i, row in enumerate(rows):
        np.testing.assert_array_equal(dst[i], row)


def test_separate_rows_that_are_not_contiguous_take_the_two_passes(impl: str) -> None:
    rng = np.random.default_rng(9)
    rows = [rng.integers(0, 256, size=40000, dtype=np.uint8)[::2] for _ in range(3)]
    dst = np.zeros((3, 20000), dtype=np.uint8)
    assert checksum.copy_checksummed_rows(dst, rows) == want(np.stack(rows))
    np.testing.assert_array_equal(dst, np.stack(rows))


def test_separate_rows_must_fit_the_destination(impl: str) -> None:
    dst = np.zeros((2, 64), np.uint8)
    with pytest.raises(ValueError, match="needs 2 rows of"):
        checksum.copy_checksummed_rows(dst, [np.zeros(64, np.uint8)])
    with pytest.raises(ValueError, match="needs 2 rows of"):
        checksum.copy_checksummed_rows(dst, [np.zeros(64, np.uint8), np.zeros(65, np.uint8)])
    assert (dst == 0).all()


def test_the_extension_checks_separate_rows_itself() -> None:
    native = checksum._native_copy
    if native is None:
        pytest.skip("tierkv._native is not built")
    dst = np.zeros((2, 64), np.uint8)
    with pytest.raises(ValueError, match="dst has 2 rows, src 1"):
        native(dst, [np.zeros(64, np.uint8)])
    with pytest.raises(ValueError, match="src row 1 is not 64 contiguous bytes"):
        native(dst, (np.zeros(64, np.uint8), np.zeros(63, np.uint8)))
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        native(dst, [np.zeros(64, np.uint8), np.zeros(128, np.uint8)[::2]])
    assert native(dst, [b"\x01" * 64, bytearray(64)]) == [xxhash.xxh3_64_intdigest(b"\x01" * 64),
                                                          xxhash.xxh3_64_intdigest(bytes(64))]
    assert bytes(dst[0]) == b"\x01" * 64


def test_overlapping_rows_copy_as_numpy_would(impl: str) -> None:
    rng = np.random.default_rng(10)
    a = rng.integers(0, 256, size=(4, 20000), dtype=np.uint8)
    before = a[:-1].copy()
    assert checksum.copy_checksummed(a[1:], a[:-1]) == want(before)   # rows shifted down by one
    np.testing.assert_array_equal(a[1:], before)
    b = rng.integers(0, 256, size=(1, 40000), dtype=np.uint8)
    inside = b[:, :39000].copy()
    assert checksum.copy_checksummed(b[:, 1000:], b[:, :39000]) == want(inside)   # within one row
    np.testing.assert_array_equal(b[:, 1000:], inside)


def test_other_dtypes_take_numpy_s_copy(impl: str) -> None:
    src = np.array([[1.0], [2.0]], np.float32)
    dst = np.zeros((2, 1), np.uint8)
    assert checksum.copy_checksummed(dst, src) == want(np.array([[1], [2]], np.uint8))


def test_the_extension_refuses_overlap() -> None:
    native = checksum._native_copy
    if native is None:
        pytest.skip("tierkv._native is not built")
    a = np.zeros((4, 64), np.uint8)
    with pytest.raises(ValueError, match="src row 1 overlaps dst"):   # row 0 lies before dst's rows
        native(a[1:], a[:-1])
    with pytest.raises(ValueError, match="src row 1 overlaps dst"):
        native(a[:2], [np.zeros(64, np.uint8), a[1]])
    assert native(a[:2], [a[2], a[3]]) == want(np.zeros((2, 64), np.uint8))   # beside it: fine
