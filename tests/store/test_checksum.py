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
