"""Corrupted, truncated or foreign blobs are refused, never decoded into wrong data."""

from __future__ import annotations

import numpy as np
import pytest

from tests.codec.conftest import IMPLS, normal_pages, real_pages, requires_native
from tierkv.codec import HEADER_BYTES, Codec, peek_header
from tierkv.errors import CorruptPageError
from tierkv.layout import DType, KVLayout

LAYOUT = KVLayout(1, 2, 16, DType.BF16, 8)


def _blobs(native: bool, layout: KVLayout = LAYOUT, n: int = 2) -> tuple[np.ndarray, list[bytes]]:
    rows = normal_pages(layout, n, 11)
    rows[1] = np.random.default_rng(2).integers(0, 256, layout.page_bytes, dtype=np.uint8)  # a raw page
    with Codec(layout, native=native) as codec:
        return rows, [bytes(b) for b in codec.encode(rows)]


@pytest.mark.parametrize("native", IMPLS)
def test_every_bit_flip_is_detected(native: bool) -> None:
    rows, blobs = _blobs(native)
    rng = np.random.default_rng(0)
    with Codec(LAYOUT, native=native) as codec:
        for blob in blobs:
            positions = list(range(HEADER_BYTES)) + list(rng.integers(HEADER_BYTES, len(blob), 40 if native else 8))
            for pos in positions:
                bad = bytearray(blob)
                bad[pos] ^= 1 << int(rng.integers(8))
                out = np.zeros(LAYOUT.page_bytes, dtype=np.uint8)
                with pytest.raises(CorruptPageError):
                    codec.decode(bytes(bad), out)


@pytest.mark.parametrize("native", IMPLS)
def test_truncated_and_padded_blobs(native: bool) -> None:
    rows, blobs = _blobs(native)
    out = np.zeros(LAYOUT.page_bytes, dtype=np.uint8)
    with Codec(LAYOUT, native=native) as codec:
        for i, blob in enumerate(blobs):
            for cut in (0, 1, HEADER_BYTES - 1, HEADER_BYTES, len(blob) - 1):
                with pytest.raises(CorruptPageError):
                    codec.decode(blob[:cut], out)
            codec.decode(blob + bytes(4096 - len(blob) % 4096), out)   # whole blocks read back
            np.testing.assert_array_equal(out, rows[i])


@pytest.mark.parametrize("native", IMPLS)
def test_blob_of_another_layout_is_refused(native: bool) -> None:
    _, blobs = _blobs(native)
    other = KVLayout(1, 2, 16, DType.FP16, 8)   # same size, another dtype
    with Codec(other, native=native) as codec:
        with pytest.raises(CorruptPageError, match="layout"):
            codec.decode(blobs[0], np.zeros(other.page_bytes, dtype=np.uint8))


@pytest.mark.parametrize("native", IMPLS)
def test_decode_into_reports_only_the_bad_pages(native: bool) -> None:
    rows, blobs = _blobs(native)
    bad = bytearray(blobs[0])
    bad[-1] ^= 0x10
    with Codec(LAYOUT, native=native) as codec:
        out = np.zeros_like(rows)
        report = codec.decode_into([bytes(bad), blobs[1], b"not a page"], np.zeros((3, LAYOUT.page_bytes),
                                                                                    dtype=np.uint8))
        assert report.failed == (0, 2)
        assert "checksum" in report.reasons[0]
        report = codec.decode_into([blobs[1], blobs[0]], out)
        assert report.ok
        np.testing.assert_array_equal(out, rows[::-1])


@requires_native
def test_real_page_bit_flips_are_detected(kv_layers: dict) -> None:
    layout, rows = real_pages(kv_layers, DType.BF16)
    rng = np.random.default_rng(5)
    with Codec(layout) as codec:
        blob = bytes(codec.encode(rows[:1])[0])
        assert HEADER_BYTES + peek_header(blob).payload_bytes == len(blob)
        blobs, expect_failed = [], []
        for i in range(200):
            bad = bytearray(blob)
            bad[int(rng.integers(len(blob)))] ^= 1 << int(rng.integers(8))
            blobs.append(bytes(bad))
            expect_failed.append(i)
        report = codec.decode_into(blobs, np.zeros((200, layout.page_bytes), dtype=np.uint8))
        assert list(report.failed) == expect_failed


def test_peek_header_refuses_foreign_bytes() -> None:
    with pytest.raises(CorruptPageError):
        peek_header(b"\x00" * 64)
    with pytest.raises(CorruptPageError):
        peek_header(b"TK")


def reseal(blob: bytes | bytearray) -> bytes:
    """``blob`` with its header's checksum made to match its (changed) header and payload."""
    import xxhash

    out = bytearray(blob)
    seed = xxhash.xxh3_64_intdigest(bytes(out[:32]))
    out[32:40] = xxhash.xxh3_64_intdigest(bytes(out[HEADER_BYTES:]), seed=seed).to_bytes(8, "little")
    return bytes(out)


def _resealed(blob: bytes, pos: int, bit: int) -> bytes:
    """``blob`` with one payload bit flipped and the checksum made to match again: what
    the decoder's own structure checks, not the checksum, must then refuse."""
    bad = bytearray(blob)
    bad[pos] ^= 1 << bit
    return reseal(bad)


def decode_alike_on_every_path(layout: KVLayout, blobs: list[bytes]) -> tuple[list[int], np.ndarray]:
    """``blobs`` decoded as one batch at every SIMD level (``_codec.set_simd`` 5, 7, 6, 4,
    3, 1, 0): each refuses the same blobs with the same reasons and writes the same bytes
    for the rest (a failed row's bytes are unspecified). Returns the refused and the
    rows."""
    from tierkv.codec import _codec  # type: ignore[attr-defined]

    results = []
    try:
        for level in (5, 7, 6, 4, 3, 1, 0):
            _codec.set_simd(level)
            out = np.zeros((len(blobs), layout.page_bytes), dtype=np.uint8)
            with Codec(layout) as codec:
                report = codec.decode_into(blobs, out)
            results.append((report.failed, report.reasons, out))
    finally:
        _codec.set_simd(True)
    failed, reasons, first = results[0]
    kept = np.setdiff1d(np.arange(len(blobs)), failed)
    for other_failed, other_reasons, out in results[1:]:
        assert other_failed == failed
        assert other_reasons == reasons
        np.testing.assert_array_equal(out[kept], first[kept])
    return list(failed), first


@requires_native
def test_resealed_damage_decodes_alike_on_every_path(kv_layers: dict) -> None:
    """Payload bits flipped under a valid checksum (the structure checks alone stand
    between them and the output): the grouped, paired, gather, search, AVX2 and scalar
    decoders refuse the same blobs with the same reasons and write the same bytes for the
    rest."""
    layout, rows = real_pages(kv_layers, DType.BF16)
    rng = np.random.default_rng(9)
    with Codec(layout) as codec:
        clean = [bytes(b) for b in codec.encode(rows[:4])]
    blobs = [_resealed(b, int(rng.integers(HEADER_BYTES, len(b))), int(rng.integers(8)))
             for b in clean for _ in range(100)]
    failed, _ = decode_alike_on_every_path(layout, blobs)
    assert 50 < len(failed) < len(blobs)   # many flips break the structure, not all


@requires_native
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16, DType.FP8_E4M3, DType.FP32])
def test_plane_bases_out_of_range_decode_alike_on_every_path(kv_layers: dict, dtype: DType) -> None:
    """A plane's base exponent (one payload byte) moved under a valid checksum: channel
    maxima past the dtype's exponent range are refused (the rows' checks refuse most of
    the others), and every path (the SIMD side values included) refuses the same blobs
    and writes the same bytes for the rest."""
    import struct

    layout, rows = real_pages(kv_layers, dtype)
    emax = {DType.BF16: 255, DType.FP16: 31, DType.FP8_E4M3: 15, DType.FP32: 255}[dtype]
    with Codec(layout) as codec:
        clean = [bytes(b) for b in codec.encode(rows[:2])]
    blobs: list[bytes] = []
    past: list[int] = []   # the blobs with a base of 255
    for b in clean:
        assert b[5] == 1   # coded
        bases = HEADER_BYTES + 32 + struct.unpack_from("<I", b, HEADER_BYTES + 4)[0]
        for plane in (0, layout.num_layers * 2 - 1):
            for value in sorted({0, emax, 255, max(b[bases + plane] - 20, 0), min(b[bases + plane] + 20, 255)}):
                bad = bytearray(b)
                bad[bases + plane] = value
                if value == 255:
                    past.append(len(blobs))
                blobs.append(reseal(bad))
    failed, _ = decode_alike_on_every_path(layout, blobs)
    assert failed and len(past) == 4
    if emax < 255:   # a base of 255 puts every channel maximum past the range
        assert set(past) <= set(failed)


@requires_native
def test_a_context_marked_absent_decodes_alike_on_every_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A used context whose table says it holds no symbol (our encoder never writes one,
    a hostile blob may) decodes as symbol 0 with the rANS state unchanged: the scalar
    decoder always did; the AVX-512 search once read tables the page never wrote (a
    review), so the result depended on the page decoded before. Built here with the
    portable encoder: a latent BF16 page whose channels all peak at one exponent M,
    its side context marked absent and the plane's base M + 15, so symbol 0 is M."""
    import tierkv.codec.portable.encode as enc
    from tierkv.codec import _codec  # type: ignore[attr-defined]
    from tierkv.codec.portable.common import ctx_side, geometry_of

    geo = (1, 1, 1, 16, 1, 64)   # bf16, latent, 1 layer, 16 tokens, 1 head of 64 channels
    g = geometry_of(*geo)
    original_model, original_plane = enc._model, enc._Plane.__init__

    def model(g_: object, pr: object, counts: list[np.ndarray]) -> tuple[bytes, list[list[int] | None]]:
        bits, tables = original_model(g_, pr, counts)   # type: ignore[arg-type]
        w = enc.BitWriter()   # the same tables with the side context's presence bit 0
        for ctx, c in enumerate(enc.contexts(g_, pr)):   # type: ignore[arg-type]
            if not c.used:
                continue
            freq = None if ctx == ctx_side(0) else tables[ctx]
            w.put(freq is not None, 1)
            if freq is None:
                continue
            levels = enc.counts_to_levels(np.asarray(counts[ctx][:c.alpha], dtype=np.int64), c.pbits)
            nz = [i for i, v in enumerate(levels) if v]
            nb = enc.bits_for(c.alpha)
            w.put(nz[0], nb)
            w.put(nz[-1] - nz[0], nb)
            for i in range(nz[0], nz[-1] + 1):
                w.put(levels[i], enc.LEVEL_BITS)
        tables[ctx_side(0)] = [1 << enc.contexts(g_, pr)[ctx_side(0)].pbits] + [0] * 31   # type: ignore[arg-type]
        return w.flush(), tables

    def plane(self: enc._Plane, g_: enc.Geometry, pr: enc.Params, u: np.ndarray, dup: np.ndarray) -> None:
        original_plane(self, g_, pr, u, dup)
        self.base = int(self.cmax.max()) + 15
        self.side = np.zeros_like(self.side)

    monkeypatch.setattr(enc, "_model", model)
    monkeypatch.setattr(enc._Plane, "__init__", plane)
    rng = np.random.default_rng(0)
    e = np.full((16, 64), 100, np.uint16)
    e[1:] -= rng.integers(0, 3, (15, 64)).astype(np.uint16)
    page = ((rng.integers(0, 2, (16, 64)) << 15) | (e << 7) | rng.integers(0, 128, (16, 64))).astype(np.uint16)
    page_bytes = page.view(np.uint8).reshape(-1)
    blob = bytes(enc.encode_page(g, page_bytes))
    assert blob[5] == 1   # coded, not stored raw
    other = np.zeros((1, page_bytes.size + 64), np.uint8)   # a page with a full side table, decoded first
    sizes = np.zeros(1, np.int64)
    busy = ((rng.integers(0, 65536, (16, 64)) & 0x807F) | (rng.integers(60, 127, (16, 64)) << 7)).astype(np.uint16)
    _codec.encode_rows(busy.view(np.uint8).reshape(1, -1), other, sizes, *geo)
    try:
        for level in (5, 7, 6, 4, 3, 1, 0):
            _codec.set_simd(level)
            out = np.zeros((2, page_bytes.size), np.uint8)
            status = np.zeros(2, np.int32)
            _codec.decode_rows([bytes(other[0, :int(sizes[0])]), blob], out, status, *geo)
            assert status.tolist() == [0, 0], (level, status)
            np.testing.assert_array_equal(out[1], page_bytes)
    finally:
        _codec.set_simd(True)


@requires_native
def test_a_first_flip_past_the_coded_rows_is_refused_on_every_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first-flip position past a plane's coded rows (a symbol inside the table's
    alphabet, which counts every token, but beyond the rows left after a repeated one) is
    a corrupt page on every path: built with the portable encoder told one channel's
    first flip is row n + 1 of n coded rows."""
    import tierkv.codec.portable.encode as enc
    from tierkv.codec import _codec  # type: ignore[attr-defined]
    from tierkv.codec.format import DecodeStatus
    from tierkv.codec.portable.common import geometry_of

    geo = (1, 1, 1, 16, 1, 64)   # bf16, latent, 1 layer, 16 tokens, 1 head of 64 channels
    g = geometry_of(*geo)
    original_plane = enc._Plane.__init__

    def plane(self: enc._Plane, g_: enc.Geometry, pr: enc.Params, u: np.ndarray, dup: np.ndarray) -> None:
        original_plane(self, g_, pr, u, dup)
        self.fpos[5] = len(self.rows) + 1

    rng = np.random.default_rng(3)
    e = (100 - rng.integers(0, 3, (16, 64))).astype(np.uint16)
    signs = np.repeat(rng.integers(0, 2, (1, 64)), 16, axis=0)   # no channel flips: signs coded
    page = ((signs << 15) | (e << 7) | rng.integers(0, 128, (16, 64))).astype(np.uint16)
    page[15] = page[14]   # a repeated row: 15 coded rows, the flip table's alphabet 16
    page_bytes = page.view(np.uint8).reshape(-1)
    good = bytes(enc.encode_page(g, page_bytes))
    monkeypatch.setattr(enc._Plane, "__init__", plane)
    bad = bytes(enc.encode_page(g, page_bytes))
    assert good[5] == bad[5] == 1 and good != bad   # both coded; they differ in the flips
    try:
        for level in (5, 7, 6, 4, 3, 1, 0):
            _codec.set_simd(level)
            out = np.zeros((3, page_bytes.size), np.uint8)
            status = np.zeros(3, np.int32)
            _codec.decode_rows([good, bad, good], out, status, *geo)
            assert status[0] == status[2] == 0, (level, status)
            assert status[1] == DecodeStatus.STREAM, (level, status)
            np.testing.assert_array_equal(out[0], page_bytes)
    finally:
        _codec.set_simd(True)
