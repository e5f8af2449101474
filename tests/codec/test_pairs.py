"""Pages decoded together (``decode_pages``: each page's rANS symbols interleaved with
its batch neighbours', up to four at a time at ``_codec.set_simd`` level 5, two at level
6) against one page at a time (level 3): the same bytes and the same verdict for every
page, whatever its partners, including groups whose planes part ways (different
repeated rows, sign coding, table widths, contexts of more than 64 symbols) and groups
with damaged or raw pages."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.codec.conftest import normal_pages, real_pages, requires_native
from tests.codec.test_corruption import reseal
from tierkv.codec import HEADER_BYTES, Codec
from tierkv.codec.format import geometry
from tierkv.codec.portable.common import ctx_main, geometry_of
from tierkv.codec.portable.decode import Opened, open_payload
from tierkv.codec.portable.encode import encode_page as portable_encode
from tierkv.layout import DType, KVLayout, LayoutKind

pytestmark = requires_native

# _codec.set_simd: up to four pages at once (with VBMI2 where the CPU has it, without), two, one (search)
GROUPS, GROUPS_NO_VBMI2, PAIRS, ALONE = 5, 7, 6, 3


@pytest.fixture
def codec_module() -> Iterator[object]:
    from tierkv.codec import _codec  # type: ignore[attr-defined]

    yield _codec
    _codec.set_simd(True)


def decode_at(codec_module: object, level: int, layout: KVLayout,
              blobs: Sequence[bytes]) -> tuple[list[int], np.ndarray]:
    """Statuses and rows of ``blobs`` decoded as one batch at SIMD ``level``."""
    codec_module.set_simd(level)  # type: ignore[attr-defined]
    out = np.zeros((len(blobs), layout.page_bytes), np.uint8)
    status = np.zeros(len(blobs), np.int32)
    codec_module.decode_rows(list(blobs), out, status, *geometry(layout))  # type: ignore[attr-defined]
    return status.tolist(), out


def assert_alike(codec_module: object, layout: KVLayout, blobs: Sequence[bytes]) -> list[int]:
    """Decodes ``blobs`` in groups (both renormalisations), in pairs and one at a time:
    same statuses, same rows for every page that decoded; returns the statuses."""
    alone, out1 = decode_at(codec_module, ALONE, layout, blobs)
    ok = [i for i, s in enumerate(alone) if s == 0]
    for level in (GROUPS, GROUPS_NO_VBMI2, PAIRS):
        status, out = decode_at(codec_module, level, layout, blobs)
        assert status == alone, level
        np.testing.assert_array_equal(out[ok], out1[ok])
    return alone


def encode(layout: KVLayout, rows: np.ndarray) -> list[bytes]:
    with Codec(layout, native=True) as codec:
        return [bytes(b) for b in codec.encode(rows)]


def opened(layout: KVLayout, blob: bytes) -> Opened:
    """The portable decoder's view of a coded blob's payload (parameters, tables, rows)."""
    assert blob[5] == 1, "expected a coded blob"
    return open_payload(geometry_of(*geometry(layout)), blob[HEADER_BYTES:])


def present_main(layout: KVLayout, blob: bytes, kc: int = 0) -> int:
    return sum(1 for f in opened(layout, blob).tables.freq[ctx_main(kc)] if f)


def test_real_pages_in_pairs_decode_exactly(kv_layers: dict, codec_module: object) -> None:
    for dtype in (DType.BF16, DType.FP16, DType.FP8_E4M3, DType.FP8_E5M2):
        layout, rows = real_pages(kv_layers, dtype)
        blobs = encode(layout, rows)
        for n in (2, 3, 4, 5, 6, 7, len(blobs)):   # groups of 4, 3 and 2; the last page alone
            for level in (GROUPS, GROUPS_NO_VBMI2, PAIRS):
                status, out = decode_at(codec_module, level, layout, blobs[:n])
                assert status == [0] * n
                np.testing.assert_array_equal(out, rows[:n])


def test_pairs_whose_planes_part_ways(kv_layers: dict, codec_module: object) -> None:
    """Partners with different coded rows (repeated rows in one), sign coding (random
    signs in one) and main tables: every plane's runs end at different symbols."""
    layout, rows = real_pages(kv_layers, DType.BF16)
    pages = rows[:4].copy().view(np.uint16).reshape(4, *layout.page_shape)   # [layers, 2, tokens, heads, dim]
    pages[1, :, :, 1::2] = pages[1, :, :, 0::2]               # every other row repeats the one before
    pages[2, :, 0, 5:] = pages[2, :, 0, 4:5]                  # K of layer 0: rows 5.. repeat row 4
    rng = np.random.default_rng(3)
    pages[3] ^= (rng.integers(0, 2, pages[3].shape) << 15).astype(np.uint16)   # random signs: stored raw
    flat = pages.reshape(4, -1).view(np.uint8)
    blobs = encode(layout, flat)
    nrows = [tuple(opened(layout, b).nrows) for b in blobs]
    assert len(set(nrows)) >= 3, nrows
    flags = [opened(layout, b).pr.sign_coded for b in blobs]
    assert flags[3] != flags[0], flags
    for order in ([0, 1, 2, 3], [1, 0, 3, 2], [3, 1, 2, 0], [2, 3, 0, 1]):
        batch = [blobs[i] for i in order]
        assert assert_alike(codec_module, layout, batch) == [0, 0, 0, 0]
        _, out = decode_at(codec_module, GROUPS, layout, batch)
        np.testing.assert_array_equal(out, flat[order])


def _skewed_page(layout: KVLayout, rng: np.random.Generator, top_bits: int) -> np.ndarray:
    """A BF16 page whose exponents sit 0..14 below their channel's maximum and whose top
    ``top_bits`` mantissa bits are skewed (mostly zero, every value present): worth coding
    with the exponent, so the main alphabet holds 15 x 2^top_bits symbols."""
    n = layout.page_bytes // 2
    chans = layout.num_kv_heads * layout.head_dim
    e = 120 - rng.integers(0, 15, n)
    e[:chans] = 120
    top = np.where(rng.random(n) < 0.6, 0, rng.integers(0, 1 << top_bits, n))
    m = top << (7 - top_bits) | rng.integers(0, 1 << (7 - top_bits), n)
    v = rng.integers(0, 2, n) << 15 | e << 7 | m
    return v.astype(np.uint16).view(np.uint8)


def test_pairs_of_narrow_wide_and_oversized_tables(codec_module: object) -> None:
    """Main tables of at most 32 symbols (one register), 33 to 64 (two) and more than 64
    (the paired search cannot hold them: each page goes on alone), in every pairing. The
    C encoder codes one mantissa bit with the exponent; the format allows more (``hi``),
    and the portable encoder writes them."""
    layout = KVLayout(1, 1, 64, DType.BF16, 32)
    g = geometry_of(*geometry(layout))
    rng = np.random.default_rng(11)
    rows = np.stack([_skewed_page(layout, rng, bits) for bits in (1, 2, 3)])
    blobs = [portable_encode(g, rows[i], hi=bits) for i, bits in enumerate((1, 2, 3))]
    sizes = [present_main(layout, b) for b in blobs]
    assert sizes[0] <= 32 < sizes[1] <= 64 < sizes[2], sizes
    orders = [[a, b] for a in range(3) for b in range(3)] + [[0, 1, 2], [2, 0, 1], [1, 2, 0, 0], [2, 2, 1, 0]]
    for order in orders:
        batch = [blobs[i] for i in order]
        assert assert_alike(codec_module, layout, batch) == [0] * len(order)
        _, out = decode_at(codec_module, GROUPS, layout, batch)
        np.testing.assert_array_equal(out, rows[order])


def test_damaged_and_raw_partners(kv_layers: dict, codec_module: object) -> None:
    """A page refused for its header, its checksum, its length or (under a valid
    checksum) its structure, or stored raw, beside a good page in either place: the good
    page decodes exactly, the bad one fails as it does alone."""
    layout, rows = real_pages(kv_layers, DType.BF16)
    good = encode(layout, rows[:2])
    rng = np.random.default_rng(5)
    raw_row = rng.integers(0, 256, layout.page_bytes, dtype=np.uint8)
    raw = encode(layout, raw_row[None])[0]
    assert raw[5] == 0   # stored raw
    flipped = bytearray(good[1])
    flipped[HEADER_BYTES + 200] ^= 4
    bad = [b"TK" + good[1][2:3] + bytes([9]) + good[1][4:],   # unknown version
           bytes(flipped),                                  # checksum mismatch
           good[1][:len(good[1]) // 2],                     # cut short
           raw]
    for pos in range(HEADER_BYTES + 40, len(good[1]), 97):   # structure damage under a valid checksum
        resealed = bytearray(good[1])
        resealed[pos] ^= 1 << (pos % 8)
        bad.append(reseal(resealed))
    refused = []
    for b in bad:
        for batch in ([good[0], b], [b, good[0]]):
            status = assert_alike(codec_module, layout, batch)
            at = batch.index(good[0])
            assert status[at] == 0
            _, out = decode_at(codec_module, GROUPS, layout, batch)
            np.testing.assert_array_equal(out[at], rows[0])
            if b is raw:
                np.testing.assert_array_equal(out[1 - at], raw_row)
            refused.append(status[1 - at] != 0)
    assert all(refused[:6]) and not any(refused[6:8])   # header, checksum, length; raw decodes
    assert sum(refused[8:]) > len(refused[8:]) // 4     # many flips break the structure (raw bits do not)


@st.composite
def page_groups(draw: st.DrawFn) -> tuple[KVLayout, np.ndarray]:
    """A layout (64 | channels mostly, where groups run) and two to five pages of it, each
    of its own kind: Gaussian, sparse, constant, random bits, or Gaussian with repeated
    rows."""
    dtype = draw(st.sampled_from([DType.BF16, DType.FP16, DType.FP8_E4M3, DType.FP8_E5M2, DType.FP32]))
    latent = draw(st.booleans())
    head_dim = draw(st.one_of(st.sampled_from([64, 128]), st.integers(1, 80)))
    layout = KVLayout(draw(st.integers(1, 3)), 1 if latent else draw(st.integers(1, 2)), head_dim, dtype,
                      draw(st.integers(1, 40)), LayoutKind.LATENT if latent else LayoutKind.KV)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = []
    for _ in range(draw(st.integers(2, 5))):
        kind = draw(st.sampled_from(["gauss", "sparse", "constant", "random", "repeats"]))
        page = normal_pages(layout, 1, int(rng.integers(1 << 30)))[0]
        if kind == "sparse":
            page = np.where(rng.random(page.size) < 0.9, 0, page).astype(np.uint8)
        elif kind == "constant":
            page = np.full_like(page, int(rng.integers(256)))
        elif kind == "random":
            page = rng.integers(0, 256, page.size, dtype=np.uint8)
        elif kind == "repeats" and layout.tokens_per_page > 1:
            planes = layout.num_layers * (1 if latent else 2)
            shaped = page.reshape(planes, layout.tokens_per_page, -1)
            t = int(rng.integers(1, layout.tokens_per_page))
            shaped[:, t] = shaped[:, t - 1]
        rows.append(page)
    return layout, np.stack(rows)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(page_groups(), st.lists(st.integers(0, 2**31), max_size=5))
def test_any_group_decodes_as_each_page_alone(codec_module: object, case: tuple[KVLayout, np.ndarray],
                                              damage: list[int]) -> None:
    """Some pages of the group with a payload bit flipped under a valid checksum (a page
    refused in its third plane leaves the rest to go on as a smaller group)."""
    layout, rows = case
    blobs = encode(layout, rows)
    hurt = set()
    for where in damage:
        i = where % len(blobs)
        b = bytearray(blobs[i])
        if len(b) > HEADER_BYTES:
            pos = HEADER_BYTES + (where >> 3) % (len(b) - HEADER_BYTES)
            b[pos] ^= 1 << (where % 8)
            blobs[i] = reseal(b)
            hurt.add(i)
    status = assert_alike(codec_module, layout, blobs)
    _, out = decode_at(codec_module, GROUPS, layout, blobs)
    for i in range(len(blobs)):
        if i not in hurt:
            assert status[i] == 0
            np.testing.assert_array_equal(out[i], rows[i])
