"""Store-level DRAM benchmark: ``Store.put``/``Store.get`` against a numpy copy of the same bytes.

Measures what an engine sees through the API (keys, lookup, placement and the copy),
not just the tier's copy loop; and that loop alone where the slots of a batch are
scattered, as they are in a store whose pages come and go (``tier_scattered_*``): a
DRAM-only store whose batch fills it, as here, gets consecutive slots, which large
batches copy with one memcpy. Called by :mod:`tierkv.bench.headline`.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tierkv.store.api import Store
from tierkv.config import DramConfig, StoreConfig
from tierkv.layout import DType, KVLayout
from tierkv.tiers.dram import DramTier


def _layout_for(page_bytes: int) -> KVLayout:
    # One layer, one head: head_dim carries the size. 16 tokens per page, BF16, K and V.
    per_token = page_bytes // 16
    if per_token * 16 != page_bytes or per_token % 4:
        raise ValueError(f"page_bytes {page_bytes} must be a multiple of 64")
    return KVLayout(1, 1, per_token // 4, DType.BF16, 16)


def _median_gbps(fn: Callable[[int], None], nbytes: int, runs: int) -> tuple[float, list[float]]:
    fn(-1)  # warm-up: page faults, first allocations
    rates = []
    for r in range(runs):
        t0 = time.perf_counter()
        fn(r)
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates), rates


def bench_store_dram(page_bytes: int, pages: int, runs: int) -> dict[str, object]:
    """DRAM-tier put and get GB/s through the Store API, and their ratio to np.copyto."""
    layout = _layout_for(page_bytes)
    nbytes = page_bytes * pages
    src = np.random.default_rng(0).integers(0, 256, (pages, page_bytes), dtype=np.uint8)
    dst = np.empty_like(src)
    tokens = [np.arange(pages * 16, dtype=np.int64) + (r + 2) * pages * 16 for r in range(-1, runs)]
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-") as tmp:
        cfg = StoreConfig(path=tmp, model_id="bench", layout=layout, dram=DramConfig(nbytes))
        with Store.open(cfg) as store:
            def put(r: int) -> None:
                assert store.put(tokens[r + 1], src).stored == pages

            def get(r: int) -> None:
                assert store.get(tokens[runs], dst).pages == pages

            put_gbps, put_all = _median_gbps(put, nbytes, runs)
            get_gbps, get_all = _median_gbps(get, nbytes, runs)
            if not np.array_equal(dst, src):
                raise AssertionError("DRAM tier returned bytes that differ from what was put")
    copy_gbps, _ = _median_gbps(lambda r: np.copyto(dst, src), nbytes, runs)
    rows = bench_tier_rows(src, runs)
    return {
        "page_bytes": page_bytes, "pages": pages,
        "dram_put_gbps": put_gbps, "dram_get_gbps": get_gbps, "memcpy_gbps": copy_gbps,
        "dram_put_vs_memcpy": put_gbps / copy_gbps, "dram_get_vs_memcpy": get_gbps / copy_gbps,
        "dram_put_runs": put_all, "dram_get_runs": get_all,
        **rows, "tier_scattered_put_vs_memcpy": rows["tier_scattered_put_gbps"] / copy_gbps,
        "tier_scattered_get_vs_memcpy": rows["tier_scattered_get_gbps"] / copy_gbps,
    }


def bench_tier_rows(src: np.ndarray, runs: int) -> dict[str, Any]:
    """GB/s of a DRAM tier's copy loop alone: the rows of ``src`` written to slots drawn
    at random from twice as many (a new draw each run), and read from the last run's
    slots (the same each run); the bytes read are compared with ``src`` once, after the
    last read (ValueError where they differ)."""
    pages, page_bytes = src.shape
    tier = DramTier(2 * pages, page_bytes, name="bench-rows")
    try:
        tier.buffer[:] = 0   # faulted in before the clock runs
        rng = np.random.default_rng(1)
        picks = [rng.permutation(2 * pages)[:pages].tolist() for _ in range(runs + 1)]
        back = np.empty_like(src)
        put_gbps, put_all = _median_gbps(lambda r: tier.write(picks[r + 1], src), src.nbytes, runs)
        get_gbps, get_all = _median_gbps(lambda r: tier.read(picks[runs], back), src.nbytes, runs)
        if not np.array_equal(back, src):
            raise ValueError("a DRAM tier read back bytes that differ from what was written")
    finally:
        tier.close()
    return {"tier_scattered_put_gbps": put_gbps, "tier_scattered_get_gbps": get_gbps,
            "tier_scattered_put_runs": put_all, "tier_scattered_get_runs": get_all}
