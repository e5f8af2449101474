"""The lossy page format, version 1: a page at the bit widths an allocation chose.

A page is ``[layers, 2 (K, V), tokens, kv_heads, head_dim]`` elements. Keys are coded per
channel (a group is one layer's, one head's channel across the page's kept tokens),
values per token (a group is one layer's, one kept token's, one head's channels; every
head of a token in a layer at the same width); a token at width 0 is evicted: compacted
out of keys and values alike, its position kept in the bitmap. See
:mod:`tierkv.lossy.quant` for what each width stores.

Blob: a 48-byte header, then the payload.

| offset | size | field |
| --- | --- | --- |
| 0 | 2 | magic ``TL`` |
| 2 | 1 | format version, 1 |
| 3 | 1 | source dtype: 1 bf16, 2 fp16, 3 fp32 |
| 4 | 4x4 | layers, tokens, kv_heads, head_dim |
| 20 | 4 | kept tokens |
| 24 | 4 | budget (float32: the average bits per element it was allocated for) |
| 28 | 4 | payload length |
| 32 | 8 | reserved, 0 |
| 40 | 8 | checksum: xxh3-64 of the payload, seeded with xxh3-64 of bytes 0..39 |

Payload, in order: the kept bitmap (``ceil(tokens / 8)`` bytes, LSB first); key widths
(one byte per (layer, head, channel): an index into :data:`~tierkv.lossy.quant.BITS`);
value widths (one byte per (layer, kept token)); key parameters (per key group, in that
order: float16 ``lo`` and ``scale`` at 2, 4, 8 bits, the float16 mean at 0, nothing at
16); value parameters (per (layer, kept token, head) at 2, 4, 8 bits); then four code
streams, 2-, 4-, 8- and 16-bit, each the codes of every group at that width in the same
order (keys before values), LSB first, padded to a byte. Decoding checks the magic,
version, geometry (at most :data:`MAX_PAGE_ELEMENTS`) and length, then the checksum,
before it reads anything else, and refuses sections that do not fill the payload
exactly or a bitmap with padding set; bytes past the payload are ignored.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from tierkv.errors import CorruptPageError, InputError
from tierkv.lossy.quant import BITS, codes, finite, from_bf16_bits, mean16, params, to_bf16_bits

MAGIC = b"TL"
VERSION = 1
_HEADER = struct.Struct("<2sBBIIIIIfI8s")
HEADER_BYTES = _HEADER.size + 8
_DTYPES = {"bf16": 1, "fp16": 2, "fp32": 3}
_INDEX = {b: i for i, b in enumerate(BITS)}
#: The most elements a page may have (a blob's header naming more is refused before
#: anything is allocated for it): 2**27, 512 MiB as float32.
MAX_PAGE_ELEMENTS = 1 << 27


@dataclass(frozen=True)
class Allocation:
    """Bit widths for one page: ``key_bits[layer, head, channel]`` and
    ``value_bits[layer, token]`` (values of :data:`BITS`); a token whose value width is 0
    in every layer is evicted (a token may not be kept in some layers only)."""

    key_bits: np.ndarray
    value_bits: np.ndarray

    @property
    def kept(self) -> np.ndarray:
        return np.asarray((self.value_bits > 0).any(axis=0))

    def check(self, layers: int, tokens: int, heads: int, dim: int) -> None:
        if self.key_bits.shape != (layers, heads, dim) or self.value_bits.shape != (layers, tokens):
            raise InputError(f"an allocation for {layers} layers, {tokens} tokens, {heads} heads of {dim}: key "
                             f"widths {self.key_bits.shape}, value widths {self.value_bits.shape}")
        for name, w in (("key", self.key_bits), ("value", self.value_bits)):
            bad = ~np.isin(w, BITS)
            if bad.any():
                raise InputError(f"{name} widths must be in {BITS}, got {np.unique(w[bad]).tolist()}")
        kept = self.kept
        if (self.value_bits[:, kept] == 0).any():
            raise InputError("a kept token has value width 0 in some layer: a token is kept or evicted in all")


def _pack(codes_: np.ndarray, bits: int) -> bytes:
    """LSB-first packing of uint codes (``bits`` in 2, 4, 8, 16)."""
    if bits == 16:
        return codes_.astype("<u2").tobytes()
    if bits == 8:
        return codes_.astype(np.uint8).tobytes()
    per = 8 // bits
    c = codes_.astype(np.uint8)
    pad = (-c.size) % per
    if pad:
        c = np.concatenate([c, np.zeros(pad, np.uint8)])
    c = c.reshape(-1, per)
    out = np.zeros(c.shape[0], np.uint8)
    for i in range(per):
        out |= c[:, i] << np.uint8(i * bits)
    return out.tobytes()


def _unpack(buf: memoryview, n: int, bits: int) -> np.ndarray:
    if bits == 16:
        return np.frombuffer(buf, "<u2", n).astype(np.uint16)
    if bits == 8:
        return np.frombuffer(buf, np.uint8, n)
    per = 8 // bits
    raw = np.frombuffer(buf, np.uint8, -(-n // per))
    mask = np.uint8(2 ** bits - 1)
    out = np.stack([(raw >> np.uint8(i * bits)) & mask for i in range(per)], axis=1).reshape(-1)
    return out[:n]


def _stream_bytes(n: int, bits: int) -> int:
    return n * 2 if bits == 16 else -(-n * bits // 8)


def _groups(groups: np.ndarray, widths: np.ndarray, streams: dict[int, list[np.ndarray]]) -> bytes:
    """The parameters of ``groups`` (float32 ``[n, size]``) at ``widths`` (``[n]``), group by
    group; each width's codes appended to ``streams``."""
    n = groups.shape[0]
    par = np.zeros((n, 2), np.float16)
    npar = np.zeros(n, np.int64)
    for b in BITS:
        sel = np.flatnonzero(widths == b)
        if not sel.size:
            continue
        g = groups[sel]
        if not g.shape[-1]:   # no tokens kept: the groups are empty (their parameters zero)
            npar[sel] = 0 if b == 16 else 1 if b == 0 else 2
            continue
        if b == 16:
            streams[16].append(to_bf16_bits(g).reshape(-1))
        elif b == 0:
            mean = mean16(g)
            if not finite(mean).all():
                raise InputError("a group's mean is beyond float16's range: code it at 16 bits, not 0")
            par[sel, 0] = mean
            npar[sel] = 1
        else:
            lo, scale = params(g, b)
            if not finite(lo, scale).all():
                raise InputError(f"a group's range is beyond float16's: code it at 16 bits, not {b}")
            par[sel, 0], par[sel, 1] = lo, scale
            npar[sel] = 2
            streams[b].append(codes(g, b, lo, scale).reshape(-1))
    keep = np.arange(2)[None, :] < npar[:, None]
    return par[keep].astype("<f2").tobytes()


def encode(page: np.ndarray, alloc: Allocation, dtype: str, budget: float) -> bytes:
    """The blob of ``page`` (float32 ``[layers, 2, tokens, heads, dim]``, the values of a
    ``dtype`` page) at the widths of ``alloc``; InputError for a shape or allocation
    that does not fit."""
    if dtype not in _DTYPES:
        raise InputError(f"lossy pages code bf16, fp16 or fp32 pages, not {dtype!r}")
    if page.ndim != 5 or page.shape[1] != 2:
        raise InputError(f"a page is [layers, 2, tokens, heads, dim], got shape {page.shape}")
    L, _, T, H, D = page.shape
    if min(L, T, H, D) < 1 or page.size > MAX_PAGE_ELEMENTS:
        raise InputError(f"a page has 1 to {MAX_PAGE_ELEMENTS:,} elements in every dimension's 1 or more, "
                         f"got shape {page.shape}")
    alloc.check(L, T, H, D)
    page = np.asarray(page, np.float32)
    if not np.isfinite(page).all():
        raise InputError("a lossy page codes finite values only; this page holds NaN or infinity")
    idx = np.flatnonzero(alloc.kept)
    keys = page[:, 0][:, idx].transpose(0, 2, 3, 1).reshape(L * H * D, idx.size)   # per (layer, head, channel)
    vals = page[:, 1][:, idx].reshape(-1, D)                                 # per (layer, kept token, head)
    vwidths = np.repeat(alloc.value_bits[:, idx].reshape(-1), H)
    streams: dict[int, list[np.ndarray]] = {2: [], 4: [], 8: [], 16: []}
    kpar = _groups(keys, alloc.key_bits.reshape(-1), streams)
    vpar = _groups(vals, vwidths, streams)
    index = np.zeros(17, np.uint8)
    index[list(BITS)] = np.arange(len(BITS), dtype=np.uint8)
    body = [np.packbits(alloc.kept, bitorder="little").tobytes(), index[alloc.key_bits.reshape(-1)].tobytes(),
            index[alloc.value_bits[:, idx].reshape(-1)].tobytes(), kpar, vpar]
    body += [_pack(np.concatenate(streams[b]) if streams[b] else np.zeros(0, np.uint8), b) for b in (2, 4, 8, 16)]
    payload = b"".join(body)
    head = _HEADER.pack(MAGIC, VERSION, _DTYPES[dtype], L, T, H, D, int(idx.size), float(budget), len(payload),
                        bytes(8))
    return head + _checksum(head, payload).to_bytes(8, "little") + payload


def _checksum(head: bytes, payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload, seed=xxhash.xxh3_64_intdigest(head[:_HEADER.size]))


@dataclass(frozen=True)
class Decoded:
    """A decoded page: float32 ``[layers, 2, tokens, heads, dim]`` (evicted tokens zero),
    which tokens are ``kept``, the widths they were coded at and the header's ``budget``."""

    page: np.ndarray
    kept: np.ndarray
    alloc: Allocation
    budget: float


def header(blob: bytes | memoryview) -> tuple[int, int, int, int, int, int, float, int]:
    """(dtype code, layers, tokens, heads, dim, kept, budget, payload length) of a blob;
    CorruptPageError where it is not a lossy page of this version."""
    if len(blob) < HEADER_BYTES:
        raise CorruptPageError(f"a lossy page of {len(blob)} bytes is shorter than its header")
    magic, version, dt, L, T, H, D, kept, budget, plen, _ = _HEADER.unpack_from(blob)
    if magic != MAGIC or version != VERSION or dt not in _DTYPES.values():
        raise CorruptPageError(f"not a lossy page of format {VERSION} (magic {magic!r}, version {version}, dtype {dt})")
    if min(L, T, H, D) < 1 or 2 * L * T * H * D > MAX_PAGE_ELEMENTS:
        raise CorruptPageError(f"a lossy page's header names a page of {L}x2x{T}x{H}x{D} elements")
    if kept > T or len(blob) < HEADER_BYTES + plen:
        raise CorruptPageError(f"a lossy page's header says {kept} of {T} tokens kept, {plen} payload bytes; "
                               f"the blob has {len(blob) - HEADER_BYTES}")
    return dt, L, T, H, D, kept, budget, plen


def decode(blob: bytes | memoryview) -> Decoded:
    """The page a blob holds; CorruptPageError for a blob that is damaged or not one."""
    mv = memoryview(blob)
    dt, L, T, H, D, n, budget, plen = header(mv)
    payload = mv[HEADER_BYTES:HEADER_BYTES + plen]
    if _checksum(bytes(mv[:_HEADER.size]), payload) != int.from_bytes(mv[_HEADER.size:HEADER_BYTES], "little"):
        raise CorruptPageError("a lossy page fails its checksum")
    try:
        return _decode(payload, L, T, H, D, n, budget)   # trailing bytes past the payload are ignored (whole blocks)
    except (ValueError, IndexError) as exc:   # lengths the checksum vouched for but the header does not fit
        raise CorruptPageError(f"a lossy page does not parse: {exc}") from None


def _decode(payload: memoryview, L: int, T: int, H: int, D: int, n: int, budget: float) -> Decoded:
    at = 0

    def take(size: int) -> memoryview:
        nonlocal at
        if at + size > len(payload):
            raise ValueError(f"needs {at + size} payload bytes, has {len(payload)}")
        part = payload[at:at + size]
        at += size
        return part

    bits = np.array(BITS)
    bitmap = np.unpackbits(np.frombuffer(take(-(-T // 8)), np.uint8), bitorder="little").astype(bool)
    kept = bitmap[:T]
    if int(bitmap.sum()) != n or int(kept.sum()) != n:
        raise ValueError(f"the bitmap keeps {int(kept.sum())} tokens (padding {int(bitmap[T:].sum())}), the header {n}")
    kw = bits[np.frombuffer(take(L * H * D), np.uint8)]
    vtok = bits[np.frombuffer(take(L * n), np.uint8)].reshape(L, n)
    vw = np.repeat(vtok.reshape(-1), H)
    if (vtok == 0).any():
        raise ValueError("a kept token with value width 0")
    npar = lambda w: np.where(w == 16, 0, np.where(w == 0, 1, 2))   # noqa: E731
    kpar = np.frombuffer(take(2 * int(npar(kw).sum())), "<f2").astype(np.float16)
    vpar = np.frombuffer(take(2 * int(npar(vw).sum())), "<f2").astype(np.float16)
    counts = {b: int((kw == b).sum()) * n + int((vw == b).sum()) * D for b in (2, 4, 8, 16)}
    streams = {b: _unpack(take(_stream_bytes(counts[b], b)), counts[b], b) for b in (2, 4, 8, 16)}
    used = {b: 0 for b in streams}
    if at != len(payload):
        raise ValueError(f"{len(payload) - at} payload bytes past its last section")
    keys = _ungroup(kw, kpar, n, streams, used)
    vals = _ungroup(vw, vpar, D, streams, used)
    page = np.zeros((L, 2, T, H, D), np.float32)
    idx = np.flatnonzero(kept)
    page[:, 0][:, idx] = keys.reshape(L, H, D, n).transpose(0, 3, 1, 2)
    page[:, 1][:, idx] = vals.reshape(L, n, H, D)
    vfull = np.zeros((L, T), np.int64)
    vfull[:, idx] = vtok
    return Decoded(page, kept, Allocation(kw.reshape(L, H, D), vfull), budget)


def _ungroup(widths: np.ndarray, par: np.ndarray, size: int, streams: dict[int, np.ndarray],
             used: dict[int, int]) -> np.ndarray:
    """Groups of ``size`` elements at ``widths`` from their parameters and the streams."""
    out = np.zeros((widths.size, size), np.float32)
    npar = np.where(widths == 16, 0, np.where(widths == 0, 1, 2))
    start = np.concatenate([[0], np.cumsum(npar)[:-1]]).astype(np.int64) if widths.size else np.zeros(0, np.int64)
    for b in BITS:
        sel = np.flatnonzero(widths == b)
        if not sel.size:
            continue
        if b == 0:
            out[sel] = par[start[sel]].astype(np.float32)[:, None]
            continue
        q = streams[b][used[b]:used[b] + sel.size * size].reshape(sel.size, size)
        used[b] += sel.size * size
        if b == 16:
            out[sel] = from_bf16_bits(q)
        else:
            lo, scale = par[start[sel]], par[start[sel] + 1]
            out[sel] = lo.astype(np.float32)[:, None] + q.astype(np.float32) * scale.astype(np.float32)[:, None]
    return out


def size_bits(alloc: Allocation, heads: int, dim: int) -> int:
    """The bits of the blob ``alloc`` makes for a page (header and every section)."""
    L, T = alloc.value_bits.shape
    kept = alloc.kept
    n = int(kept.sum())
    kw, vt = alloc.key_bits.reshape(-1), alloc.value_bits[:, kept].reshape(-1)
    par = sum(quant_params(int(b)) * int((kw == b).sum()) for b in BITS) \
        + heads * sum(quant_params(int(b)) * int((vt == b).sum()) for b in BITS)
    codes_bits = sum(_stream_bytes(int((kw == b).sum()) * n + int((vt == b).sum()) * heads * dim, b) * 8
                     for b in (2, 4, 8, 16))
    return 8 * (HEADER_BYTES + -(-T // 8) + kw.size + vt.size + par) + codes_bits


def min_budget(layers: int, tokens: int, heads: int, dim: int) -> float:
    """The fewest average bits an element a page of this geometry codes at keeping every
    token: each key channel and each token's values at the width whose codes and
    parameters cost least (a key channel's mean, 2-bit values; 16 bits where parameters
    would cost more than they save: short heads, few tokens)."""
    kb = min(BITS, key=lambda b: tokens * b + 8 * quant_params(b))
    vb = min(BITS[1:], key=lambda b: heads * (dim * b + 8 * quant_params(b)))
    narrowest = Allocation(np.full((layers, heads, dim), kb, np.int64), np.full((layers, tokens), vb, np.int64))
    return size_bits(narrowest, heads, dim) / (layers * 2 * tokens * heads * dim)


def quant_params(bits: int) -> int:
    """Parameter bytes per group at ``bits``."""
    return 0 if bits == 16 else 2 if bits == 0 else 4
