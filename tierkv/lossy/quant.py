"""Group quantization of float32 KV: the arithmetic the lossy format stores.

A group (a key channel across a page's kept tokens, or one token's values in one head)
is coded at a bit width from :data:`BITS`:

- ``2``, ``4``, ``8``: uniform asymmetric quantization, ``q = round((x - lo) / scale)``
  with ``scale = (hi - lo) / (2**b - 1)``; ``lo`` and ``scale`` are stored as float16 (and
  the codes are computed against the float16 values, so what is decoded is what was
  measured);
- ``16``: the element as bfloat16 (exact for bf16 pages);
- ``0``: for a key channel, its mean (float16) alone; for a token, the token is evicted.

All functions take float32 arrays whose last axis is the group and are vectorized
over the leading axes. Pure numpy; no state.
"""

from __future__ import annotations

import numpy as np

#: The bit widths a group may have, in the order their codes index them.
BITS = (0, 2, 4, 8, 16)
#: Bytes of parameters a group carries at each width (lo and scale; the mean; none).
PARAM_BYTES = {0: 2, 2: 4, 4: 4, 8: 4, 16: 0}


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even), as uint16."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = u + (0x7FFF + ((u >> 16) & 1))
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def params(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``lo`` and ``scale`` (float16, as stored) of each group of ``x`` at ``bits`` in {2, 4, 8};
    infinite where a group's range is beyond float16's (:func:`finite` tells)."""
    low = x.min(axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        lo = low.astype(np.float16)
        lo = np.where(lo.astype(np.float32) > low, np.nextafter(lo, np.float16(-np.inf)), lo).astype(np.float16)
    hi = x.max(axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = ((hi - lo.astype(np.float32)) / np.float32(2 ** bits - 1)).astype(np.float16)
        # A scale that float16 rounds to 0 (a flat group, or one below float16's range) decodes
        # every element to lo; one that rounds down is nudged up so the top code still reaches hi.
        scale = np.where(scale.astype(np.float32) * np.float32(2 ** bits - 1) + lo.astype(np.float32) < hi,
                         np.nextafter(scale, np.float16(np.inf)), scale).astype(np.float16)
    return lo, scale


def finite(*arrays: np.ndarray) -> np.ndarray:
    """Where every one of the stored parameters ``arrays`` is finite (a group float16 can code)."""
    out = np.ones(np.shape(arrays[0]), bool)
    for a in arrays:
        out &= np.isfinite(a.astype(np.float32))
    return out


def mean16(x: np.ndarray) -> np.ndarray:
    """Each group's mean as stored at width 0 (float16; infinite beyond its range)."""
    with np.errstate(over="ignore"):
        return x.mean(axis=-1).astype(np.float16)


def codes(x: np.ndarray, bits: int, lo: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The codes of ``x`` against stored ``lo``/``scale`` (uint8 for b <= 8)."""
    s = scale.astype(np.float32)[..., None]
    safe = np.where(s > 0, s, np.float32(1))
    q = np.rint((x - lo.astype(np.float32)[..., None]) / safe)
    q = np.where(s > 0, q, 0)
    return np.clip(q, 0, 2 ** bits - 1).astype(np.uint8)


def dequantize(q: np.ndarray, lo: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return (lo.astype(np.float32)[..., None] + q.astype(np.float32) * scale.astype(np.float32)[..., None])


def roundtrip(x: np.ndarray, bits: int) -> np.ndarray:
    """What the format decodes for every group of ``x`` at width ``bits`` (0: the mean)."""
    if bits == 16:
        return from_bf16_bits(to_bf16_bits(x))
    if bits == 0:
        mean = mean16(x).astype(np.float32)
        return np.broadcast_to(mean[..., None], x.shape).copy()
    lo, scale = params(x, bits)
    ok = finite(lo, scale)
    if ok.all():
        return dequantize(codes(x, bits, lo, scale), lo, scale)
    lo, scale = np.where(ok, lo, 0).astype(np.float16), np.where(ok, scale, 0).astype(np.float16)
    return np.where(ok[..., None], dequantize(codes(x, bits, lo, scale), lo, scale), np.float32(np.inf))


def errors(x: np.ndarray, widths: tuple[int, ...] = BITS[1:]) -> np.ndarray:
    """The squared error of each group of ``x`` at each width: ``[len(widths), *x.shape[:-1]]``
    (infinite where the width cannot code the group: its range is beyond float16's)."""
    return np.stack([((roundtrip(x, b) - x) ** 2).sum(axis=-1) for b in widths])
