"""The lossy page format (tierkv.lossy.format): every width round-trips to what the
quantizer says, evicted tokens are compacted out and come back zero, the blob's size
is what the allocator budgets, and a damaged or foreign blob is refused."""

from __future__ import annotations

import numpy as np
import pytest

from tierkv.errors import CorruptPageError, InputError
from tierkv.lossy.format import HEADER_BYTES, Allocation, decode, encode, size_bits
from tierkv.lossy.quant import BITS, from_bf16_bits, roundtrip, to_bf16_bits

L, T, H, D = 3, 16, 2, 8


def page(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((L, 2, T, H, D)).astype(np.float32)


def mixed(seed: int = 0) -> Allocation:
    rng = np.random.default_rng(seed)
    vb = rng.choice([2, 4, 8, 16], size=(L, T))
    vb[:, [3, 7, 15]] = 0
    return Allocation(rng.choice(BITS, size=(L, H, D)), vb)


def test_every_group_decodes_to_its_quantization_and_evicted_tokens_are_gone() -> None:
    x, a = page(), mixed()
    blob = encode(x, a, "fp32", 4.0)
    d = decode(blob)
    assert np.array_equal(d.kept, a.kept) and int(d.kept.sum()) == T - 3
    assert np.array_equal(d.alloc.key_bits, a.key_bits) and np.array_equal(d.alloc.value_bits, a.value_bits)
    idx = np.flatnonzero(a.kept)
    for layer in range(L):
        keys = x[layer, 0][idx].transpose(1, 2, 0)                 # [H, D, kept]: per channel
        for h in range(H):
            for c in range(D):
                want = roundtrip(keys[h, c][None], int(a.key_bits[layer, h, c]))[0]
                assert np.array_equal(d.page[layer, 0, idx, h, c], want)
        for t in idx:
            want = roundtrip(x[layer, 1, t], int(a.value_bits[layer, t]))
            assert np.array_equal(d.page[layer, 1, t], want)
    assert (d.page[:, :, [3, 7, 15]] == 0).all()
    assert len(blob) * 8 == size_bits(a, H, D) and d.budget == 4.0


def test_widths_bound_the_error() -> None:
    x = page(1)
    errs = [float(np.abs(roundtrip(x, b) - x).max()) for b in (2, 4, 8)]
    assert errs[0] > errs[1] > errs[2] > 0
    bf = to_bf16_bits(x)
    assert np.array_equal(roundtrip(x, 16), from_bf16_bits(bf))
    # bf16 pages are exact at 16 bits; a flat group decodes exactly at any width.
    exact = from_bf16_bits(bf)
    assert np.array_equal(roundtrip(exact, 16), exact)
    flat = np.full((4, 8), 0.25, np.float32)
    assert np.array_equal(roundtrip(flat, 2), flat)


def test_every_token_evicted_and_none_evicted() -> None:
    x = page(2)
    none = Allocation(np.full((L, H, D), 4), np.zeros((L, T), np.int64))
    d = decode(encode(x, none, "bf16", 1.0))
    assert not d.kept.any() and not d.page.any()
    full = Allocation(np.full((L, H, D), 16), np.full((L, T), 16))
    d = decode(encode(x, full, "bf16", 16.0))
    assert np.array_equal(d.page, from_bf16_bits(to_bf16_bits(x)))


def test_damaged_and_foreign_blobs_are_refused() -> None:
    blob = encode(page(), mixed(), "fp32", 4.0)
    for at in (HEADER_BYTES, len(blob) // 2, len(blob) - 1, 40):
        bad = bytearray(blob)
        bad[at] ^= 0x10
        with pytest.raises(CorruptPageError):
            decode(bytes(bad))
    with pytest.raises(CorruptPageError, match="shorter than its header"):
        decode(blob[:20])
    with pytest.raises(CorruptPageError, match="not a lossy page"):
        decode(b"TK" + blob[2:])
    with pytest.raises(CorruptPageError):
        decode(blob[:-1])


@pytest.mark.parametrize("alloc, message", [
    (Allocation(np.full((L, H, D), 3), np.full((L, T), 4)), "key widths must be in"),
    (Allocation(np.full((L, H, D), 4), np.full((L, T + 1), 4)), "value widths"),
    (Allocation(np.full((L, H, D), 4), np.where(np.arange(L)[:, None] == 0, 0, np.full((L, T), 4))),
     "kept or evicted in all"),
])
def test_allocations_that_do_not_fit_are_refused(alloc: Allocation, message: str) -> None:
    with pytest.raises(InputError, match=message):
        encode(page(), alloc, "fp32", 4.0)


def test_only_float_pages_of_the_right_shape() -> None:
    with pytest.raises(InputError, match="bf16, fp16 or fp32"):
        encode(page(), mixed(), "fp8_e4m3", 4.0)
    with pytest.raises(InputError, match="layers, 2, tokens"):
        encode(page()[:, :1], mixed(), "fp32", 4.0)


def _forge(blob: bytes, **fields: int) -> bytes:
    """``blob`` with header fields changed and its checksum made right again (xxh3 is no MAC)."""
    import struct

    import xxhash

    from tierkv.lossy import format as F
    names = ["magic", "version", "dtype", "layers", "tokens", "heads", "dim", "kept", "budget", "plen", "reserved"]
    vals = dict(zip(names, F._HEADER.unpack_from(blob)))
    vals.update(fields)
    head = F._HEADER.pack(*(vals[n] for n in names))
    payload = blob[F.HEADER_BYTES:F.HEADER_BYTES + vals["plen"]] if "payload" not in fields else b""
    seed = xxhash.xxh3_64_intdigest(head)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload, seed=seed)) + payload


def test_blobs_with_a_valid_checksum_but_wrong_insides_are_refused() -> None:
    import struct

    import xxhash

    from tierkv.lossy import format as F
    blob = encode(page(), mixed(), "fp32", 4.0)
    # A header naming a page too large to allocate, before anything is allocated for it.
    with pytest.raises(CorruptPageError, match="names a page of"):
        decode(_forge(blob, tokens=1 << 20, layers=1 << 10))
    with pytest.raises(CorruptPageError, match="names a page of"):
        decode(_forge(blob, dim=0))
    # A payload longer than its sections, and a bitmap with padding bits set.
    head = bytearray(blob[:F._HEADER.size])
    payload = blob[F.HEADER_BYTES:] + b"\0\0"
    struct.pack_into("<I", head, 28, len(payload))
    seed = xxhash.xxh3_64_intdigest(bytes(head))
    longer = bytes(head) + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload, seed=seed)) + payload
    with pytest.raises(CorruptPageError, match="past its last section"):
        decode(longer)
    small = np.random.default_rng(3).standard_normal((1, 2, 5, 1, 4)).astype(np.float32)
    b5 = bytearray(encode(small, Allocation(np.full((1, 1, 4), 4), np.full((1, 5), 4)), "fp32", 8.0))
    b5[F.HEADER_BYTES] |= 0x80                                       # bit 7 of a 5-token bitmap: padding
    seed = xxhash.xxh3_64_intdigest(bytes(b5[:F._HEADER.size]))
    b5[F._HEADER.size:F.HEADER_BYTES] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(b5[F.HEADER_BYTES:]),
                                                                                    seed=seed))
    with pytest.raises(CorruptPageError, match="padding"):
        decode(bytes(b5))
    # Trailing bytes past the payload (whole blocks read back from a tier) are fine.
    assert np.array_equal(decode(blob + bytes(100)).page, decode(blob).page)


def test_values_float16_cannot_hold_are_coded_wide_or_refused() -> None:
    from tierkv.lossy.alloc import allocate

    x = page(4) * 0.1
    x[1, 0, 5, 1, 3] = 1e6                      # one key beyond float16's range
    x[2, 1, 7, 0, 2] = -7e4                     # one value below it
    with pytest.raises(InputError, match="beyond float16's"):
        encode(x, Allocation(np.full((L, H, D), 4), np.full((L, T), 4)), "fp32", 4.0)
    a = allocate(x, 12.0, evict=False)
    # 1e6 over 3 or 15 steps passes float16's largest scale, over 255 does not; -7e4 is below float16 itself.
    assert a.key_bits[1, 1, 3] in (8, 16) and a.value_bits[2, 7] == 16
    d = decode(encode(x, a, "fp32", 12.0))
    assert np.isfinite(d.page).all() and abs(d.page[1, 0, 5, 1, 3] - 1e6) < 1e4 and abs(d.page[2, 1, 7, 0, 2] + 7e4) < 1e3
    bad = page()
    bad[0, 0, 0, 0, 0] = np.nan
    for call in (lambda: encode(bad, mixed(), "fp32", 4.0), lambda: allocate(bad, 4.0)):
        with pytest.raises(InputError, match="finite values only"):
            call()
