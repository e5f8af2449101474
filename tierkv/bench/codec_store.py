"""``tierkv bench codec-store``: the codec inside a store, ``codec = "none"`` against ``"lossless"``.

Real KV pages (``--kv``, else ``$TIERKV_KV_DIR``, else ``../shared/data/kv`` beside the
checkout: :func:`tierkv.bench.codec.load_kv`), cut as the store forms them, go through an
NVMe-only store (O_DIRECT file, 4 I/O threads) twice in one run, once per codec: put
and get GB/s of raw page bytes (median of ``runs``; a put includes the fdatasync and the
index commit, a get the checksum of every page), every page read back checked byte for
byte; and capacity: how many raw-page equivalents of the tier the
pages take, and how many pages a tier sized for ``capacity_pages`` raw pages holds
before its first eviction; what ``codec = "auto"`` chooses on this disk, and why; and,
with ``device_mbps``, the same at each of those disk rates (the kernel's block throttle,
:mod:`tierkv.bench.throttle`), which shows where coding makes reads faster. Called by
the CLI; returns one JSON-ready dict.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tierkv.store.api import Store
from tierkv.bench import check_dir
from tierkv.bench.codec import kv_pages, load_kv
from tierkv.config import NvmeConfig, StoreConfig
from tierkv.errors import InputError
from tierkv.layout import DType, KVLayout
from tierkv.progress import task_progress
from tierkv.tiers.aligned import round_up

MODES = ("none", "lossless")
MAX_DEVICE_MBPS = 100_000   # --device-mbps: a cap far above any disk caps nothing


def _store(directory: str, layout: KVLayout, pages: int, codec: str) -> Store:
    cfg = StoreConfig(path=directory, model_id="bench", layout=layout,
                      nvme=NvmeConfig(pages * round_up(layout.page_bytes), codec=codec, io_threads=4))
    return Store.open(cfg)


def _tokens(n: int, tpp: int, seed: int) -> np.ndarray:
    return np.arange(n * tpp, dtype=np.int64) + seed * 100_003


def _throughput(layout: KVLayout, rows: np.ndarray, codec: str, runs: int, where: str | None) -> dict[str, float]:
    n = rows.shape[0]
    put: list[float] = []
    get: list[float] = []
    used = 0
    for r in range(runs):
        with tempfile.TemporaryDirectory(dir=where) as d, _store(d, layout, 2 * n, codec) as s:
            toks = _tokens(n, layout.tokens_per_page, r)
            t = time.perf_counter()
            if s.put(toks, rows).stored != n:
                raise RuntimeError(f"codec {codec}: the store dropped pages of the benchmark")
            put.append(rows.nbytes / (time.perf_counter() - t) / 1e9)
            out = np.empty_like(rows)
            t = time.perf_counter()
            got = s.get(toks, out).pages
            get.append(rows.nbytes / (time.perf_counter() - t) / 1e9)
            if got != n or not np.array_equal(out, rows):
                raise RuntimeError(f"codec {codec}: pages read back differ from the pages stored")
            tier = s.stats().tiers["nvme"]
            used = tier.used_slots
    return {"put_gbps": statistics.median(put), "get_gbps": statistics.median(get),
            "raw_page_equivalents_used": used / n}


def _capacity(layout: KVLayout, rows: np.ndarray, codec: str, capacity_pages: int, where: str | None) -> int:
    """Pages a tier of ``capacity_pages`` raw slots holds before its first eviction."""
    with tempfile.TemporaryDirectory(dir=where) as d, _store(d, layout, capacity_pages, codec) as s:
        for i in range(rows.shape[0]):
            s.put(_tokens(1, layout.tokens_per_page, 1_000 + i), rows[i:i + 1])
            if s.stats().evictions:
                return i
    return rows.shape[0]


def _auto_choice(layout: KVLayout, rows: np.ndarray, where: str | None) -> dict[str, object]:
    """What ``codec = "auto"`` (no bandwidth hint) decides here: a put and a get of half
    the pages measure the tier both ways, then a put of the rest is decided on them."""
    half = rows.shape[0] // 2
    with tempfile.TemporaryDirectory(dir=where) as d, _store(d, layout, 2 * rows.shape[0], "auto") as s:
        toks = _tokens(rows.shape[0], layout.tokens_per_page, 7)
        first = toks[:half * layout.tokens_per_page]
        s.put(first, rows[:half])
        s.get(first, np.empty_like(rows[:half]))
        s.put(toks, rows)
        choice = s.stats().tiers["nvme"].codec
    return dict(choice or {})


def _throttled(layout: KVLayout, rows: np.ndarray, runs: int, where: str | None, mbps: float) -> dict[str, object]:
    """Both codecs (and auto's choice) with this process's I/O on the disk under
    ``where`` capped at ``mbps`` MB/s by the kernel (tierkv.bench.throttle)."""
    from tierkv.bench.throttle import device_throttle

    rate = int(mbps * 1e6)
    # a second of raw reads at the capped rate (at most 512 MiB): the throttle lets a
    # burst through at the start of each busy period, which a short run would mostly be
    reps = max(1, -(-min(rate, 512 << 20) // rows.nbytes))
    batch = np.ascontiguousarray(np.tile(rows, (reps, 1)))
    out: dict[str, object] = {"device_mbps": mbps, "pages": batch.shape[0]}
    with device_throttle(where or tempfile.gettempdir(), rate) as cap:
        out["device"] = cap["device"]
        for codec in MODES:
            out[codec] = _throughput(layout, batch, codec, runs, where)
        out["auto"] = _auto_choice(layout, batch, where)
    none, lossless = out["none"], out["lossless"]
    assert isinstance(none, dict) and isinstance(lossless, dict)
    out["put_ratio"] = lossless["put_gbps"] / none["put_gbps"]
    out["get_ratio"] = lossless["get_gbps"] / none["get_gbps"]
    return out


def run_codec_store_bench(kv_path: str | Path | None = None, page_tokens: int = 16, runs: int = 3,
                          where: str | None = None, copies: int = 8, capacity_pages: int = 16,
                          device_mbps: Sequence[float] = ()) -> dict[str, object]:
    """Both codecs over the same pages in one run; ``copies`` tiles the file's pages.
    ``where`` (``--dir``, None: a temporary directory) must be a writable directory.
    ``device_mbps`` adds, per rate, both codecs (and what ``auto`` chooses) on the same
    disk capped at that many MB/s by the kernel's block throttle (``throttled``)."""
    check_dir(where)
    for mbps in device_mbps:
        if not 1 <= mbps <= MAX_DEVICE_MBPS:
            raise InputError(f"--device-mbps: rates must be between 1 and {MAX_DEVICE_MBPS:,} MB/s, got {mbps}")
    path, layers = load_kv(kv_path)
    layout, rows = kv_pages(layers, page_tokens, DType.BF16)
    sample = rows
    rows = np.ascontiguousarray(np.tile(rows, (copies, 1)))
    out: dict[str, object] = {"kv_file": str(path), "page_bytes": layout.page_bytes, "pages": rows.shape[0],
                              "capacity_pages": capacity_pages}
    with task_progress("tierkv bench codec-store", total=len(MODES) + 1 + len(device_mbps)) as step:
        for codec in MODES:
            figures = _throughput(layout, rows, codec, runs, where)
            figures["pages_before_first_eviction"] = _capacity(layout, rows, codec, capacity_pages, where)
            out[codec] = figures
            step()
        out["auto"] = _auto_choice(layout, rows, where)
        step()
        throttled: list[dict[str, object]] = []
        for mbps in device_mbps:
            throttled.append(_throttled(layout, sample, runs, where, mbps))
            step()
    none, lossless = out["none"], out["lossless"]
    assert isinstance(none, dict) and isinstance(lossless, dict)
    out["capacity_gain"] = lossless["pages_before_first_eviction"] / max(1, none["pages_before_first_eviction"])
    out["space_ratio"] = lossless["raw_page_equivalents_used"] / none["raw_page_equivalents_used"]
    out["put_ratio"] = lossless["put_gbps"] / none["put_gbps"]
    out["get_ratio"] = lossless["get_gbps"] / none["get_gbps"]
    out["throttled"] = throttled
    return out
