"""The GPU decoder: its kernel's own code, run on the CPU by the emulation, decodes what the
C decoder decodes, byte for byte, and refuses what it refuses; the host side in C and in
numpy write the same words. The CUDA build: tests/codec/test_gpu_device.py."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tests.codec.conftest import normal_pages, real_pages, requires_native
from tests.codec.test_corruption import _resealed, reseal
from tests.codec.test_roundtrip import adversarial_pages
from tierkv.codec import HEADER_BYTES, Codec, DecodeReport, gpu
from tierkv.errors import InputError
from tierkv.layout import DType, KVLayout, LayoutKind

pytestmark = requires_native


def some_pages(dtype: DType, tokens: int = 16, n: int = 8) -> tuple[KVLayout, np.ndarray]:
    """Real KV pages where the sample is present, Gaussian ones in the same geometry where
    it is not (CI without the data): the damage tests must never skip."""
    from tests.codec.conftest import KV_FILES
    from tierkv.bench.codec import load_kv

    if KV_FILES:
        layout, rows = real_pages(load_kv(KV_FILES[0])[1], dtype, tokens)
        if len(rows):
            return layout, rows[:n]
    layout = KVLayout(3, 3, 64, dtype, tokens)
    return layout, normal_pages(layout, n, seed=tokens)


def emulated(layout: KVLayout, blobs: list) -> tuple[np.ndarray, DecodeReport]:
    return gpu.emulate(gpu.prepare(layout, blobs))


def check_pages(layout: KVLayout, rows: np.ndarray) -> None:
    with Codec(layout) as codec:
        blobs = codec.encode(rows)
    out, report = emulated(layout, blobs)
    assert report.ok, report
    np.testing.assert_array_equal(out, rows)


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.value)
def test_real_pages_decode_alike(dtype: DType) -> None:
    layout, rows = some_pages(dtype, n=32)
    check_pages(layout, rows)


@pytest.mark.parametrize("tokens", [65, 200, 300])
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16, DType.FP8_E5M2], ids=lambda d: d.value)
def test_real_pages_of_many_tokens(dtype: DType, tokens: int) -> None:
    """Signs over several 64-row words, first flips of 2^11-slot tables (over 128 tokens)
    and escaped first flips (over 256)."""
    layout, rows = some_pages(dtype, tokens, n=2)
    check_pages(layout, rows)


@pytest.mark.parametrize("tokens, flip", [(65, 64), (129, 64), (300, 257), (100, 63), (20, 19)])
def test_first_sign_flips_at_boundaries(tokens: int, flip: int) -> None:
    layout = KVLayout(1, 1, 64, DType.BF16, tokens)
    x = np.abs(np.random.default_rng(1).standard_normal(layout.page_shape)).astype(np.float32) + 0.1
    x[0, 0, flip:, 0, 5] *= -1
    x[0, 1, flip - 1:, 0, 7] *= -1
    rows = torch.from_numpy(x).to(torch.bfloat16).contiguous().view(torch.uint8).reshape(1, -1).numpy().copy()
    check_pages(layout, rows)


def test_repeated_rows_and_low_bit_exceptions() -> None:
    """Repeated rows (sources resolved by the host) and FP16 low mantissa bits dropped
    with exceptions, which the host turns into element indices."""
    layout = KVLayout(2, 2, 48, DType.FP16, 40)
    rows = normal_pages(layout, 3, seed=5)
    pages = rows.reshape(3, 2, 2, 40, 96 * 2)
    pages[:, :, :, 10] = pages[:, :, :, 3]
    pages[:, :, :, 11] = pages[:, :, :, 10]
    pages[:, 1, 0, 30:] = pages[:, 1, 0, 2:3]
    vals = rows.view(np.uint16)
    vals &= np.uint16(0xFFF0)   # low bits zero ...
    vals.reshape(-1)[::997] |= np.uint16(0x5)   # ... but for a few
    check_pages(layout, rows)
    with Codec(layout) as codec:
        blob = bytes(codec.encode(rows[:1])[0])
    assert blob[5] == 1 and blob[HEADER_BYTES + 2] > 0   # coded, with low bits dropped


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(adversarial_pages(native=True))
def test_adversarial_pages(case: tuple[KVLayout, np.ndarray]) -> None:
    """NaN payloads, infinities, denormals, random bytes (stored raw), zeros, constants,
    odd channel counts (partial lane steps) and latent layouts."""
    layout, rows = case
    check_pages(layout, rows)


def test_resealed_damage_is_refused_as_the_c_decoder_refuses_it() -> None:
    """Payload bits flipped under a valid checksum: the host's checks and the kernel's
    stream checks together refuse exactly the blobs the C decoder refuses, and write the
    same bytes for the others (a wrong page is never reported decoded)."""
    layout, rows = some_pages(DType.BF16, n=3)
    rng = np.random.default_rng(11)
    with Codec(layout) as codec:
        clean = [bytes(b) for b in codec.encode(rows[:3])]
    blobs = [_resealed(b, int(rng.integers(HEADER_BYTES, len(b))), int(rng.integers(8)))
             for b in clean for _ in range(40)]
    want = np.zeros((len(blobs), layout.page_bytes), dtype=np.uint8)
    with Codec(layout) as codec:
        expected = codec.decode_into(blobs, want)
    out, report = emulated(layout, blobs)
    assert 20 < len(expected.failed) < len(blobs)
    assert report.failed == expected.failed
    kept = np.setdiff1d(np.arange(len(blobs)), expected.failed)
    np.testing.assert_array_equal(out[kept], want[kept])


@pytest.mark.parametrize("base", [255, 254, 0, 3])
def test_a_plane_base_moved_under_a_valid_checksum(base: int) -> None:
    """A plane's base exponent set near an end of its range (and the checksum made to
    match): the rANS streams stay whole, so only the kernel's checks of the channel
    maxima (out of range) and of the residuals (above their maximum) stand between it and
    wrong bytes. Refused, or decoded to the C decoder's bytes, blob by blob."""
    layout, rows = some_pages(DType.BF16, n=4)
    with Codec(layout) as codec:
        clean = [bytes(b) for b in codec.encode(rows)]
    blobs = []
    for b in clean:
        tables = int.from_bytes(b[HEADER_BYTES + 4:HEADER_BYTES + 8], "little")
        for plane in range(0, 6, 2):
            at = HEADER_BYTES + 32 + tables + plane
            bad = bytearray(b)
            bad[at] = base
            blobs.append(reseal(bad))
    want = np.zeros((len(blobs), layout.page_bytes), dtype=np.uint8)
    with Codec(layout) as codec:
        expected = codec.decode_into(blobs, want)
    out, report = emulated(layout, blobs)
    assert report.failed == expected.failed and len(expected.failed) > 0
    kept = np.setdiff1d(np.arange(len(blobs)), expected.failed)
    np.testing.assert_array_equal(out[kept], want[kept])


def _sections_of(blob: bytes) -> tuple[bytearray, list[int]]:
    o = bytearray(blob[HEADER_BYTES:])
    return o, list(struct.unpack_from("<7I", o, 4))


def _with_payload(blob: bytes, o: bytearray) -> bytes:
    head = bytearray(blob[:HEADER_BYTES])
    struct.pack_into("<I", head, 24, len(o))
    return reseal(head + o)


def _shifted_and_padded(blob: bytes, planes: int) -> list[bytes]:
    """Section boundaries moved (bytes of one section handed to the next) and sections
    grown by a few bytes, each under a valid checksum: whole streams that end in the wrong
    place, which only the checks that every stream is consumed exactly refuse."""
    out = []
    for i in range(6):
        for d in (-4, -2, -1, 1, 2, 4):
            o, lens = _sections_of(blob)
            if lens[i] + d < 0 or lens[i + 1] - d < 0:
                continue
            lens[i] += d
            lens[i + 1] -= d
            struct.pack_into("<7I", o, 4, *lens)
            out.append(_with_payload(blob, o))
    for i in (2, 3, 4, 5):
        for extra in (b"\0", b"\0\0", b"\x01\x00", b"\0" * 4):
            o, lens = _sections_of(blob)
            at = 32 + lens[0] + planes + sum(lens[1:i + 1])
            o[at:at] = extra
            lens[i] += len(extra)
            struct.pack_into("<7I", o, 4, *lens)
            out.append(_with_payload(blob, o))
    return out


@pytest.mark.parametrize("layout", [KVLayout(1, 1, 80, DType.BF16, 65), KVLayout(2, 2, 48, DType.FP16, 40),
                                    KVLayout(1, 1, 24, DType.FP8_E5M2, 300, LayoutKind.LATENT)], ids=str)
def test_sections_shifted_or_padded_are_refused_as_the_c_decoder_refuses_them(layout: KVLayout) -> None:
    rows = normal_pages(layout, 1, seed=7)
    if layout.dtype is DType.FP16:   # low bits dropped, with exceptions: a section of its own
        rows.view(np.uint16)[:] &= np.uint16(0xFFF0)
        rows.view(np.uint16).reshape(-1)[::97] |= np.uint16(0x3)
    with Codec(layout) as codec:
        blob = bytes(codec.encode(rows)[0])
    assert blob[5] == 1
    planes = layout.num_layers * (2 if layout.kind is LayoutKind.KV else 1)
    blobs = [blob, *_shifted_and_padded(blob, planes)]
    want = np.zeros((len(blobs), layout.page_bytes), dtype=np.uint8)
    with Codec(layout) as codec:
        expected = codec.decode_into(blobs, want)
    out, report = emulated(layout, blobs)
    assert report.failed == expected.failed and len(expected.failed) > len(blobs) // 2
    kept = np.setdiff1d(np.arange(len(blobs)), expected.failed)
    np.testing.assert_array_equal(out[kept], want[kept])


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def test_an_exception_count_beyond_its_section_is_refused_before_it_costs_memory() -> None:
    """A 337-byte blob of a 32 MiB FP8 page claiming 2^25 low-bit exceptions: refused by
    both host sides at once (they reserved two words per claimed exception before), and by
    the C decoder."""
    layout = KVLayout(1, 8, 128, DType.FP8_E5M2, 16384)
    secs = [b"\0", b"\0", b"\0" * 256, b"", b"", b"", _varint(layout.page_bytes) + _varint(0)]
    payload = bytes([1, 0, 1, 0]) + b"".join(struct.pack("<I", len(x)) for x in secs)
    payload += secs[0] + b"\0\0" + b"".join(secs[1:])   # two planes' base bytes after the tables
    head = bytearray(b"TK\x01\x01" + bytes([5, 1, 0, 0]) + struct.pack("<6I", 1, 16384, 8, 128, len(payload), 0))
    blob = reseal(head + b"\0" * 8 + payload)
    for native in (True, False):
        assert gpu.prepare(layout, [blob], native=native).status.tolist() == [6]   # inconsistent structure
    with Codec(layout) as codec:
        assert not codec.decode_into([blob], np.zeros((1, layout.page_bytes), dtype=np.uint8)).ok


def test_a_varint_past_64_bits_is_refused_everywhere() -> None:
    """A ten-byte varint whose last byte carries more than the 64th bit: the C decoder took
    it modulo 2^64 while the portable one refused it; now all four readers refuse it."""
    layout = KVLayout(1, 1, 64, DType.BF16, 16)
    with Codec(layout) as codec:
        blob = bytes(codec.encode(normal_pages(layout, 1))[0])
    o, lens = _sections_of(blob)
    at = 32 + lens[0] + 2   # the repeated rows' section, after two planes' bases
    o[at:at + lens[1]] = bytes([0x80] * 9 + [0x02])
    lens[1] = 10
    struct.pack_into("<7I", o, 4, *lens)
    bad = _with_payload(blob, o)
    for native in (True, False):
        with Codec(layout, native=native) as codec:
            assert not codec.decode_into([bad], np.zeros((1, layout.page_bytes), dtype=np.uint8)).ok
        assert gpu.prepare(layout, [bad], native=native).status.tolist() == [6]


def test_host_refusals_match_the_c_decoder() -> None:
    layout = KVLayout(1, 2, 64, DType.BF16, 16)
    rows = normal_pages(layout, 1)
    with Codec(layout) as codec:
        blob = bytes(codec.encode(rows)[0])
    other = KVLayout(1, 2, 64, DType.FP16, 16)
    with Codec(other) as codec:
        foreign = bytes(codec.encode(normal_pages(other, 1))[0])
    flipped = bytearray(blob)
    flipped[HEADER_BYTES + 50] ^= 4
    cases = [blob[:30], blob[:-5], bytes(flipped), foreign, b"XX" + blob[2:], blob + b"\0" * 100]
    want = np.zeros((len(cases), layout.page_bytes), dtype=np.uint8)
    with Codec(layout) as codec:
        expected = codec.decode_into(cases, want)
    batch = gpu.prepare(layout, cases)
    assert tuple(int(i) for i in np.flatnonzero(batch.status)) == expected.failed == (0, 1, 2, 3, 4)
    out, report = gpu.emulate(batch)
    assert report == expected
    np.testing.assert_array_equal(out[5], rows[0])   # trailing bytes are ignored


def test_blobs_in_one_buffer_and_bad_offsets() -> None:
    layout = KVLayout(1, 1, 64, DType.BF16, 16)
    rows = normal_pages(layout, 2)
    with Codec(layout) as codec:
        blobs = [bytes(b) for b in codec.encode(rows)]
    buf = np.frombuffer(b"\0" * 7 + blobs[1] + blobs[0], dtype=np.uint8).copy()
    offsets = np.array([7 + len(blobs[1]), 7])
    lengths = np.array([len(blobs[0]), len(blobs[1])])
    out, report = gpu.emulate(gpu.prepare_buffer(layout, buf, offsets, lengths))
    assert report.ok
    np.testing.assert_array_equal(out, rows)
    with pytest.raises(InputError, match="outside"):
        gpu.prepare_buffer(layout, buf, offsets, lengths + 1)
    with pytest.raises(InputError, match="1-D"):
        gpu.prepare_buffer(layout, buf.reshape(1, -1), offsets, lengths)
    empty, report = gpu.emulate(gpu.prepare(layout, []))
    assert empty.shape == (0, layout.page_bytes) and report.ok


def _same_preparation(layout: KVLayout, blobs: list) -> gpu.Prepared:
    c, py = gpu.prepare(layout, blobs, native=True), gpu.prepare(layout, blobs, native=False)
    assert (c.status != 0).tolist() == (py.status != 0).tolist()
    ok = c.status == 0
    np.testing.assert_array_equal(c.desc[ok], py.desc[ok])
    np.testing.assert_array_equal(c.geo, py.geo)
    np.testing.assert_array_equal(c.side, py.side)
    return py


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.value)
def test_portable_preparation_writes_the_same_words(dtype: DType) -> None:
    """The numpy host side (for GPU machines without the C extension) writes the C one's
    descriptors and side blocks word for word, refuses the same blobs, and its batch
    decodes."""
    layout, rows = some_pages(dtype, 300 if dtype is DType.BF16 else 16, n=2)
    with Codec(layout) as codec:
        clean = [bytes(b) for b in codec.encode(rows)]
    rng = np.random.default_rng(4)
    damaged = [_resealed(b, int(rng.integers(HEADER_BYTES, len(b))), int(rng.integers(8)))
               for b in clean for _ in range(15)]
    batch = _same_preparation(layout, clean + damaged + [clean[0][:-3]])
    out, report = gpu.emulate(batch)
    np.testing.assert_array_equal(out[:len(rows)], rows)


def test_portable_preparation_of_exceptions_and_repeats() -> None:
    layout = KVLayout(2, 2, 48, DType.FP16, 40)
    rows = normal_pages(layout, 2, seed=8)
    pages = rows.reshape(2, 2, 2, 40, 96 * 2)
    pages[:, :, :, 10] = pages[:, :, :, 3]
    pages[:, :, :, 11] = pages[:, :, :, 10]
    vals = rows.view(np.uint16)
    vals &= np.uint16(0xFFF0)
    vals.reshape(-1)[::331] |= np.uint16(0x3)
    with Codec(layout) as codec:
        blobs = codec.encode(rows)
    batch = _same_preparation(layout, blobs)
    assert batch.desc[:, 22].min() > 0   # NEXC: exceptions in every page
    out, report = gpu.emulate(batch)
    assert report.ok
    np.testing.assert_array_equal(out, rows)


def test_latent_pages_with_a_partial_lane_step() -> None:
    layout = KVLayout(3, 1, 72, DType.BF16, 32, LayoutKind.LATENT)
    check_pages(layout, normal_pages(layout, 2, seed=3))


def test_the_benchmark_smoke_run_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m tierkv.bench.gpu_codec --device cpu``: the kernel emulated on a few pages,
    every page compared with its source."""
    import json

    from tierkv.bench import gpu_codec

    assert gpu_codec.main(["--device", "cpu", "--json", "--pages", "3", "--runs", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verified"] is True and result["pages"] == 3
    assert result["prepare_gbps"] > 0 and 0 < result["ratio"] < 1
