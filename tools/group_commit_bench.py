"""NVMe put throughput with per-put durability against group commit, in one run.

    python3 tools/group_commit_bench.py [--dir /var/tmp] [--runs 5] [--batch-mib 128]

For each page size (256 KiB, 2 MiB) and each ``[store] durability`` ("put", "window"),
an NVMe-only store on an O_DIRECT file (the peer harness's setup: a 128 MiB batch per
put, fresh pages every time) is timed over ``--runs`` puts; then the same 128 MiB as
back-to-back puts of ``--small-pages`` pages each, each a prompt of its own (an engine
storing a few pages per request: there a per-put sync costs most). Printed per cell: the
median GB/s of one ``put`` (what the harness times), and the GB/s of all the puts plus
the ``Store.flush()`` that makes them durable (the sustained rate with the same
guarantee at the end). Every page is read back and compared after the flush. The modes
alternate, so both see the same machine. One JSON line per cell, then the ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierkv.bench.store import _layout_for  # noqa: E402
from tierkv.config import DEFAULT_COMMIT_WINDOW_S, NvmeConfig, StoreConfig  # noqa: E402
from tierkv.store.api import Store  # noqa: E402


def one(mode: str, page_bytes: int, batch: int, runs: int, where: str | None, per_put: int = 0,
        window_s: float = DEFAULT_COMMIT_WINDOW_S) -> dict[str, object]:
    """``runs`` timed rounds of ``batch`` bytes, each one put (or puts of ``per_put`` pages)."""
    n = batch // page_bytes
    per_put = per_put or n
    pages = np.random.default_rng(page_bytes).integers(0, 256, (n, page_bytes), dtype=np.uint8)
    listed = list(pages)
    root = Path(tempfile.mkdtemp(prefix=f"tierkv-gc-{mode}-", dir=where))
    cfg = StoreConfig(path=str(root), model_id="gc", layout=_layout_for(page_bytes),
                      nvme=NvmeConfig(batch * 2, io_threads=8), persist_on_close=False, durability=mode,
                      commit_window_s=window_s)
    tokens = [np.arange(n * 16, dtype=np.int64) + r * n * 16 for r in range(runs + 1)]

    def put(toks: np.ndarray) -> None:
        for first in range(0, n, per_put):
            got = store.put(toks[first * 16:(first + per_put) * 16], listed[first:first + per_put], announce=False)
            assert got.stored == min(per_put, n - first)

    try:
        with Store.open(cfg) as store:
            put(tokens[0])                 # warm-up: file allocation, first pages
            store.flush()
            secs = []
            t_all = time.perf_counter()
            for r in range(1, runs + 1):
                t0 = time.perf_counter()
                put(tokens[r])
                secs.append(time.perf_counter() - t0)
            store.flush()
            total = time.perf_counter() - t_all
            out = np.empty_like(pages)
            for first in range(0, n, per_put):  # each small put is a prompt of its own
                rows = out[first:first + per_put]
                assert store.get(tokens[runs][first * 16:(first + per_put) * 16], rows).pages == len(rows)
            assert np.array_equal(out, pages), "pages read back differ from those put"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"mode": mode, "window_s": window_s, "page_bytes": page_bytes, "pages": n, "pages_per_put": per_put,
            "put_gbps": batch / statistics.median(secs) / 1e9,
            "put_and_flush_gbps": batch * runs / total / 1e9,
            "put_runs_s": [round(s, 4) for s in secs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where the stores go (default: the temp dir)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch-mib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two modes")
    ap.add_argument("--window-s", type=float, default=DEFAULT_COMMIT_WINDOW_S, help="commit_window_s")
    ap.add_argument("--small-pages", type=int, default=4, help="pages per put in the small-put cells")
    args = ap.parse_args()
    shapes = [(256 << 10, 0), (2 << 20, 0), (256 << 10, args.small_pages), (2 << 20, args.small_pages)]
    cells: dict[tuple[int, int, str], list[dict[str, object]]] = {}
    for page_bytes, per_put in shapes:
        for _ in range(args.rounds):
            for mode in ("put", "window"):
                res = one(mode, page_bytes, args.batch_mib << 20, args.runs, args.dir, per_put, args.window_s)
                cells.setdefault((page_bytes, per_put, mode), []).append(res)
                print(json.dumps(res), flush=True)
    for page_bytes, per_put in shapes:
        def med(mode: str, field: str) -> float:
            return statistics.median(float(r[field]) for r in cells[(page_bytes, per_put, mode)])  # type: ignore[arg-type]
        what = f"{per_put} pages" if per_put else f"{args.batch_mib} MiB"
        print(f"{page_bytes >> 10} KiB pages, {what} per put: put GB/s put-mode {med('put', 'put_gbps'):.2f}, "
              f"window {med('window', 'put_gbps'):.2f} (x{med('window', 'put_gbps') / med('put', 'put_gbps'):.2f}); "
              f"puts+flush put-mode {med('put', 'put_and_flush_gbps'):.2f}, window "
              f"{med('window', 'put_and_flush_gbps'):.2f} "
              f"(x{med('window', 'put_and_flush_gbps') / med('put', 'put_and_flush_gbps'):.2f})")

if __name__ == "__main__":
    main()
