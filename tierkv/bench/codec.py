"""``tierkv bench codec``: the lossless codec on real KV pages, against zipnn and zstd.

Cuts a safetensors file of ``layerNN.k`` / ``layerNN.v`` tensors (``[kv_heads, tokens,
head_dim]``) into pages the way the store forms them (every layer in the file,
``page_tokens`` tokens a page, ``[layers, 2, tokens, heads, head_dim]``), in the
file's dtype and cast by torch to FP16 and both FP8 formats, and measures in one run,
single-threaded, per dtype: tierkv's ratio (compressed / original) and compress and
decompress GB/s of original bytes; zipnn's (PyPI) on the same pages one call per page
(its per-page unit, as the store would call it) and on all pages as one buffer
(``zipnn_bulk_*``, its best case); plain zstd (level 3) per page; and, head to head,
tierkv's decode and zipnn's bulk decode alternating in the same minutes (``h2h_*``: the
comparison that holds on a shared machine, where runs minutes apart can differ by
1.5x). Every codec's output is checked to decode to the input. The pages come from ``--kv``, else
``$TIERKV_KV_DIR`` (read by the CLI), else :data:`DEFAULT_KV_DIR`; never from the current
directory. Called by the CLI; ``run_codec_bench``
returns one JSON-ready dict whose top-level figures are the BF16 pages' and whose
``dtypes`` holds every dtype's. Each run is timed by the larger of process CPU time and
wall time (see ``CPU``), and the best run kept.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeGuard

import numpy as np
import torch

from tierkv.codec.codec import Codec, native_available
from tierkv.errors import InputError
from tierkv.layout import DType, KVLayout

#: The environment variable naming the KV file or folder of ``bench codec`` and ``codec-store``
#: when ``--kv`` is not given (read by :mod:`tierkv.cli.bench`).
KV_ENV = "TIERKV_KV_DIR"
_CHECKOUT = Path(__file__).resolve().parents[2]
#: The last default: ``../shared/data/kv`` beside the source checkout this module runs from,
#: wherever the command runs (never the current directory). An installed wheel has no checkout.
DEFAULT_KV_DIR = _CHECKOUT.parent / "shared" / "data" / "kv"
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_ZIPNN_DTYPE = {DType.BF16: "bfloat16", DType.FP16: "float16", DType.FP32: "float32"}
_NAME = re.compile(r"^layer(\d+)\.([kv])$")
BENCH_DTYPES = (DType.BF16, DType.FP16, DType.FP8_E4M3, DType.FP8_E5M2)
#: The head-to-head figures (``_head_to_head``): None where zipnn or its dtype is missing.
H2H_KEYS = ("h2h_decompress_gbps", "h2h_zipnn_bulk_decompress_gbps", "h2h_decompress_vs_zipnn_bulk")


def load_kv(path: str | Path | None) -> tuple[Path, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The K and V tensors of every layer in a safetensors file (or the first such
    file in a directory; None: :data:`DEFAULT_KV_DIR`), keyed by layer number.
    InputError naming what to pass when there is nothing to read."""
    p = Path(path) if path is not None else _default_kv_dir()
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise InputError(f"no .safetensors file in {p}")
        p = files[0]
    if not p.is_file():
        raise InputError(f"KV file {p} does not exist")
    raw = p.read_bytes()
    start, header = _header(p, raw)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, meta in header.items():
        m = _NAME.match(name)
        if m is None:
            continue
        dtype, shape, (lo, hi) = _tensor_meta(p, raw, start, name, meta)
        if dtype not in _ST_DTYPES or len(shape) != 3 or 0 in shape:
            raise InputError(f"{p}: {name} is {dtype} {shape}; expected BF16, F16 or F32 "
                             "[kv_heads, tokens, head_dim]")
        if hi - lo != _ST_DTYPES[dtype].itemsize * int(np.prod(shape)):
            raise _not_safetensors(p, f"{name}: data_offsets [{lo}, {hi}] do not hold {dtype} {shape}")
        buf = bytearray(raw[start + lo:start + hi])
        t = torch.frombuffer(buf, dtype=_ST_DTYPES[dtype]).reshape(shape)
        layers.setdefault(int(m.group(1)), {})[m.group(2)] = t
    if not layers or any(set(kv) != {"k", "v"} for kv in layers.values()):
        raise InputError(f"{p}: expected tensors layerNN.k and layerNN.v for every layer, got "
                         f"{sorted(header)[:8]}")
    shapes = {tuple(t.shape) for kv in layers.values() for t in kv.values()}
    if len(shapes) != 1:
        raise InputError(f"{p}: every layerNN.k/.v must have one shape, got {sorted(shapes)}")
    return p, {n: (kv["k"], kv["v"]) for n, kv in sorted(layers.items())}


def _default_kv_dir() -> Path:
    if DEFAULT_KV_DIR.is_dir():
        return DEFAULT_KV_DIR
    where = (f"the default, {DEFAULT_KV_DIR} (../shared/data/kv beside the source checkout), does not exist"
             if (_CHECKOUT / "pyproject.toml").is_file() else "an installed tierkv has no default")
    raise InputError(f"no KV pages to read: pass --kv FILE.safetensors (or a folder of them) or set {KV_ENV}; "
                     f"{where}")


def _not_safetensors(p: Path, why: str) -> InputError:
    return InputError(f"{p} is not a safetensors file ({why})")


def _header(p: Path, raw: bytes) -> tuple[int, dict[str, object]]:
    """Where the tensor data starts and the parsed JSON header; InputError if ``raw``
    is not laid out as safetensors (8-byte little-endian length, then a JSON object)."""
    if len(raw) < 8:
        raise _not_safetensors(p, f"{len(raw)} bytes, shorter than the 8-byte header length")
    (hlen,) = struct.unpack_from("<Q", raw)
    if hlen > len(raw) - 8:
        raise _not_safetensors(p, f"header length {hlen} past the end of its {len(raw)} bytes")
    try:
        header = json.loads(raw[8:8 + hlen])
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _not_safetensors(p, f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _not_safetensors(p, f"header is JSON {type(header).__name__}, not an object")
    return 8 + hlen, header


def _tensor_meta(p: Path, raw: bytes, start: int, name: str, meta: object) -> tuple[str, list[int], tuple[int, int]]:
    """A header entry's dtype, shape and data offsets, checked to lie inside the file."""
    entry = meta if isinstance(meta, dict) else {}
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(dtype, str) and _counts(shape) and _counts(offsets) and len(offsets) == 2):
        raise _not_safetensors(p, f"{name}: expected dtype, shape and data_offsets, got {meta!r:.200}")
    lo, hi = offsets
    if not lo <= hi <= len(raw) - start:
        raise _not_safetensors(p, f"{name}: data_offsets [{lo}, {hi}] outside its {len(raw) - start} data bytes")
    return dtype, shape, (lo, hi)


def _counts(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)


def kv_pages(layers: dict[int, tuple[torch.Tensor, torch.Tensor]], page_tokens: int,
             dtype: DType) -> tuple[KVLayout, np.ndarray]:
    """Store pages ``uint8 [n, page_bytes]`` (``[layers, 2, tokens, heads, head_dim]``
    each) of every full run of ``page_tokens`` tokens, cast to ``dtype``."""
    heads, tokens, head_dim = next(iter(layers.values()))[0].shape
    if page_tokens < 1 or tokens < page_tokens:
        raise InputError(f"--page-tokens must be between 1 and the file's {tokens} tokens, got {page_tokens}")
    kv = torch.stack([torch.stack(pair) for pair in layers.values()])        # [L, 2, H, T, D]
    kv = kv.permute(0, 1, 3, 2, 4).to(getattr(torch, dtype.torch_name))     # [L, 2, T, H, D]
    n = tokens // page_tokens
    pages = kv[:, :, :n * page_tokens].reshape(len(layers), 2, n, page_tokens, heads, head_dim)
    pages = pages.permute(2, 0, 1, 3, 4, 5).contiguous()
    layout = KVLayout(len(layers), heads, head_dim, dtype, page_tokens)
    return layout, pages.view(torch.uint8).reshape(n, layout.page_bytes).numpy().copy()


# Each run is timed by the larger of process CPU time and wall time, and the best run
# kept. CPU time alone undercounts at times on a shared VM (one run of zipnn's bulk
# decode read 95 us of CPU in 386 us of wall, on its own thread: the best of such runs is
# fiction); wall time alone counts the time other processes hold the core, which the best
# of several runs leaves out; the larger of the two also charges a codec that works on
# more threads than the caller's for all its CPU. The scaling figures (one thread and
# several in alternating turns, _scaling) use the wall clock.
Clock = Callable[[], float]
WALL: Clock = time.perf_counter


def _cpu_or_wall() -> float:   # a marker: _timed takes both clocks
    raise NotImplementedError


CPU: Clock = _cpu_or_wall


def _timed(fn: Callable[[], object], clock: Clock = CPU) -> float:
    if clock is CPU:
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        return max(time.process_time() - c0, time.perf_counter() - w0)
    t0 = clock()
    fn()
    return clock() - t0


def _best_seconds(fn: Callable[[], object], runs: int, clock: Clock = CPU) -> float:
    fn()  # warm-up: first allocations, page faults, lazy imports
    return min(_timed(fn, clock) for _ in range(runs))


def _figures(prefix: str, original: int, compressed: int, t_comp: float, t_dec: float) -> dict[str, float]:
    return {f"{prefix}ratio": compressed / original, f"{prefix}compress_gbps": original / t_comp / 1e9,
            f"{prefix}decompress_gbps": original / t_dec / 1e9}


def _bench_tierkv(layout: KVLayout, rows: np.ndarray, runs: int) -> dict[str, float]:
    """One thread's encode and decode of ``rows``, best of ``runs``, the larger clock."""
    with Codec(layout) as codec:
        out = np.empty((rows.shape[0], codec.max_encoded_bytes), dtype=np.uint8)
        sizes = codec.encode_into(rows, out)
        blobs = [out[i, :int(sizes[i])] for i in range(rows.shape[0])]
        back = np.empty_like(rows)
        if not codec.decode_into(blobs, back).ok or not np.array_equal(back, rows):
            raise AssertionError(f"tierkv codec round trip failed on {layout.dtype.value} pages")
        t_comp = _best_seconds(lambda: codec.encode_into(rows, out), runs)
        t_dec = _best_seconds(lambda: codec.decode_into(blobs, back), runs)
    return _figures("", rows.size, int(sizes.sum()), t_comp, t_dec)


def _bench_zipnn(zipnn: object, dtype: DType, rows: np.ndarray, runs: int) -> dict[str, float]:
    z = zipnn.ZipNN(bytearray_dtype=_ZIPNN_DTYPE[dtype], threads=1)  # type: ignore[attr-defined]
    pages = [rows[i].tobytes() for i in range(rows.shape[0])]
    # zipnn's compress overwrites its input: each timed run gets fresh copies, made untimed.
    copies: list[list[bytearray]] = [[bytearray(p) for p in pages] for _ in range(runs + 1)]
    comp = [z.compress(c) for c in copies.pop()]
    if [bytes(z.decompress(c)) for c in comp] != pages:
        raise AssertionError(f"zipnn round trip failed on {dtype.value} pages")
    t_comp = min(_timed(lambda: [z.compress(c) for c in copies.pop()]) for _ in range(runs))
    t_dec = _best_seconds(lambda: [z.decompress(c) for c in comp], runs)
    out = _figures("zipnn_", rows.size, sum(len(c) for c in comp), t_comp, t_dec)
    whole = rows.tobytes()
    bulk_copies = [bytearray(whole) for _ in range(runs + 1)]
    bulk = z.compress(bulk_copies.pop())
    if bytes(z.decompress(bulk)) != whole:
        raise AssertionError(f"zipnn bulk round trip failed on {dtype.value} pages")
    t_bc = min(_timed(lambda: z.compress(bulk_copies.pop())) for _ in range(runs))
    t_bd = _best_seconds(lambda: z.decompress(bulk), runs)
    out.update(_figures("zipnn_bulk_", rows.size, len(bulk), t_bc, t_bd))
    return out


def _scaling(layout: KVLayout, batch: np.ndarray, runs: int, threads: int) -> dict[str, float]:
    """One thread's and ``threads``' encode and decode of ``batch``, a call of each in
    turn, ``4 * runs`` turns, by the wall clock: the best call of each from the same
    minutes (one after the other, a minute's neighbours moved the one-thread figure
    1.07-1.98 GB/s between runs on the 2-core VM, and the scaling with it)."""
    with Codec(layout) as one, Codec(layout, threads=threads) as par:
        out = np.empty((batch.shape[0], one.max_encoded_bytes), dtype=np.uint8)
        sizes = one.encode_into(batch, out)
        blobs = [out[i, :int(sizes[i])] for i in range(batch.shape[0])]
        back = np.empty_like(batch)
        for codec in (one, par):
            back.fill(0)
            if not codec.decode_into(blobs, back).ok or not np.array_equal(back, batch):
                raise AssertionError(f"tierkv codec round trip failed on {layout.dtype.value} pages")
        spare = np.empty_like(out)
        best = dict.fromkeys(("e1", "en", "d1", "dn"), float("inf"))
        for _ in range(4 * runs):
            best["e1"] = min(best["e1"], _timed(lambda: one.encode_into(batch, spare), WALL))
            best["en"] = min(best["en"], _timed(lambda: par.encode_into(batch, spare), WALL))
            best["d1"] = min(best["d1"], _timed(lambda: one.decode_into(blobs, back), WALL))
            best["dn"] = min(best["dn"], _timed(lambda: par.decode_into(blobs, back), WALL))
    return {"compress_gbps_threads": batch.size / best["en"] / 1e9,
            "decompress_gbps_threads": batch.size / best["dn"] / 1e9,
            "compress_scaling": best["e1"] / best["en"], "decompress_scaling": best["d1"] / best["dn"]}


#: Calls of each codec in a turn of the head-to-head: one call each in turn measures each
#: codec with its caches (tables, scratch, the pages: about 2 MB) emptied by the other.
_H2H_CALLS = 3


def _head_to_head(zipnn: object, layout: KVLayout, rows: np.ndarray, runs: int) -> dict[str, float]:
    """tierkv's decode of the pages (one batch) and zipnn's bulk decode of them (one
    buffer), in turns of ``_H2H_CALLS`` calls each, ``4 * runs`` turns: the best call of
    each from the same minutes, where the figures above come from runs minutes apart (on
    a shared machine a minute's neighbours can move one codec's best by 1.5x)."""
    z = zipnn.ZipNN(bytearray_dtype=_ZIPNN_DTYPE[layout.dtype], threads=1)  # type: ignore[attr-defined]
    whole = rows.tobytes()
    bulk = z.compress(bytearray(whole))
    with Codec(layout) as codec:
        out = np.empty((rows.shape[0], codec.max_encoded_bytes), dtype=np.uint8)
        sizes = codec.encode_into(rows, out)
        blobs = [out[i, :int(sizes[i])] for i in range(rows.shape[0])]
        back = np.empty_like(rows)
        if not codec.decode_into(blobs, back).ok or bytes(z.decompress(bulk)) != whole:
            raise AssertionError(f"head-to-head round trip failed on {layout.dtype.value} pages")
        t_tk = t_zb = float("inf")
        for _ in range(4 * runs):   # a few calls of each in turn: each codec's caches warm, as in use
            t_tk = min(t_tk, *(_timed(lambda: codec.decode_into(blobs, back)) for _ in range(_H2H_CALLS)))
            t_zb = min(t_zb, *(_timed(lambda: z.decompress(bulk)) for _ in range(_H2H_CALLS)))
    tk, zb = rows.size / t_tk / 1e9, rows.size / t_zb / 1e9
    return {"h2h_decompress_gbps": tk, "h2h_zipnn_bulk_decompress_gbps": zb, "h2h_decompress_vs_zipnn_bulk": tk / zb}


def _bench_zstd(zstandard: object, dtype: DType, rows: np.ndarray, runs: int) -> dict[str, float]:
    cctx = zstandard.ZstdCompressor(level=3)  # type: ignore[attr-defined]
    dctx = zstandard.ZstdDecompressor()  # type: ignore[attr-defined]
    pages = [rows[i].tobytes() for i in range(rows.shape[0])]
    comp = [cctx.compress(p) for p in pages]
    if [dctx.decompress(c) for c in comp] != pages:
        raise AssertionError(f"zstd round trip failed on {dtype.value} pages")
    t_comp = _best_seconds(lambda: [cctx.compress(p) for p in pages], runs)
    t_dec = _best_seconds(lambda: [dctx.decompress(c) for c in comp], runs)
    return _figures("zstd_", rows.size, sum(len(c) for c in comp), t_comp, t_dec)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _optional(name: str) -> object | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def bench_dtype(layers: dict[int, tuple[torch.Tensor, torch.Tensor]], page_tokens: int, dtype: DType,
                runs: int, threads: int = 0) -> dict[str, object]:
    """Every codec's figures on one dtype's pages (None where a baseline is missing)."""
    layout, rows = kv_pages(layers, page_tokens, dtype)
    res: dict[str, object] = {"pages": rows.shape[0], "page_bytes": layout.page_bytes}
    res.update(_bench_tierkv(layout, rows, runs))
    if threads > 1:
        # A batch of about 8 MB (the sample's pages repeated), as a store's read of a long
        # prefix is: a 1 MB batch takes well under a millisecond, which the pool's
        # wake-ups would dominate. The scaling compares it with one thread on the same
        # batch, both by the wall clock, in alternating turns.
        batch = np.tile(rows, (max(1, (8 << 20) // rows.nbytes), 1))
        res.update({"threads": threads, "batch_pages": batch.shape[0], **_scaling(layout, batch, runs, threads)})
    zipnn, zstandard = _optional("zipnn"), _optional("zstandard")
    keys = ("ratio", "compress_gbps", "decompress_gbps")
    res.update(_bench_zipnn(zipnn, dtype, rows, runs) if zipnn is not None and dtype in _ZIPNN_DTYPE
               else {f"{p}{k}": None for p in ("zipnn_", "zipnn_bulk_") for k in keys})
    res.update(_head_to_head(zipnn, layout, rows, runs) if zipnn is not None and dtype in _ZIPNN_DTYPE
               else dict.fromkeys(H2H_KEYS))
    res.update(_bench_zstd(zstandard, dtype, rows, runs) if zstandard is not None
               else {f"zstd_{k}": None for k in keys})
    for base in ("zipnn", "zipnn_bulk", "zstd"):
        d = res[f"{base}_decompress_gbps"]
        res[f"decompress_vs_{base}"] = None if d is None else float(res["decompress_gbps"]) / float(d)  # type: ignore[arg-type]
    return res


def run_codec_bench(kv_path: str | Path | None = None, page_tokens: int = 16, runs: int = 3,
                    threads: int | None = None) -> dict[str, object]:
    """The whole benchmark; top-level figures are BF16's, ``dtypes`` has every dtype's.

    ``threads`` adds a multi-threaded tierkv measurement (default: every CPU).
    """
    if runs < 1:
        raise InputError(f"--runs must be >= 1, got {runs}")
    path, layers = load_kv(kv_path)
    threads = (os.cpu_count() or 1) if threads is None else threads
    per = {d.value: bench_dtype(layers, page_tokens, d, runs, threads) for d in BENCH_DTYPES}
    head = per[DType.BF16.value]
    versions = {name: _version(name) for name in ("zipnn", "zstandard")}
    return {**{k: v for k, v in head.items()}, "kv": str(path), "layers": len(layers), "page_tokens": page_tokens,
            "runs": runs, "clock": "the larger of process CPU and wall time a run (multi-threaded figures: wall time)",
            "native": native_available(), "versions": versions, "dtypes": per}
