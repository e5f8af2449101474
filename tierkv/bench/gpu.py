"""GPU copy benchmark: engine gather/scatter and DRAM <-> HBM against a contiguous copy of the same bytes.

``python -m tierkv.bench.gpu [--json] [--quick] [--device cuda|cpu]``. For each engine
layout and batch (64 and 256 scattered blocks) it measures, in one run:

- the baselines: a plain contiguous ``copy_`` of the same bytes, pinned host -> device
  (``h2d``), device -> pinned host (``d2h``), device -> device (``d2d``);
- ``gather_d2h`` / ``scatter_h2d``: engine blocks <-> pinned host pages (a store's
  offload and load), against ``d2h`` / ``h2d``;
- ``gather_d2d`` / ``scatter_d2d``: engine blocks <-> scattered HBM slots, against ``d2d``;
- ``layerwise_h2d``: ``load_layers`` from pinned host pages until the last layer is in,
  against ``h2d`` (and the first layer's latency);
- ``hbm_to_dram`` / ``dram_to_hbm``: the copy-table entries between the HBM tier and
  the pinned DRAM tier on scattered slots, against ``d2h`` / ``h2d``.

Each on every path available (``kernel``: one CuPy launch per batch, swept over
thread-block counts; ``torch``: index ops per layer). Every timing brackets the
operation with device synchronizations and is the median of ``--runs``. Ratios are
higher-is-better; the target is 0.9 for 64 or more scattered blocks, both directions.
``--device cpu`` runs the same code on tiny shapes as a smoke test (figures meaningless).
Called by ``tools/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from tierkv.engine import CopyPath, CopyStream, EngineKV, EngineLayout, EngineLayoutKind, load_layers
from tierkv.engine.cuda import default_ctas, kernel_available
from tierkv.layout import DType, KVLayout, LayoutKind
from tierkv.tiers.dram import DramTier
from tierkv.tiers.hbm import HbmTier, dram_to_hbm, hbm_to_dram

TARGET = 0.9
# name, engine kind, store layout: a Llama-3-8B-like FLASH cache, a 4-head BLOCKS_FIRST one, a DeepSeek-like MLA one
LAYOUTS = {
    "flash-l32-h8-d128": (EngineLayoutKind.FLASH, KVLayout(32, 8, 128, DType.BF16, 16)),
    "blocks_first-l28-h4-d128": (EngineLayoutKind.BLOCKS_FIRST, KVLayout(28, 4, 128, DType.BF16, 16)),
    "mla-l60-d576-b64": (EngineLayoutKind.MLA, KVLayout(60, 1, 576, DType.BF16, 64, LayoutKind.LATENT)),
}
CPU_LAYOUTS = {"flash-l4-h2-d64": (EngineLayoutKind.FLASH, KVLayout(4, 2, 64, DType.BF16, 16))}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gbps(fn: Callable[[], object], nbytes: int, runs: int, device: torch.device) -> float:
    """Median GB/s of ``fn`` over ``runs`` timed runs after one warm-up, synchronizing around each."""
    fn()
    rates = []
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def _baselines(nbytes: int, runs: int, device: torch.device) -> dict[str, float]:
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev, dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device), torch.empty(nbytes, dtype=torch.uint8, device=device)
    return {"h2d": _gbps(lambda: dev.copy_(host, non_blocking=True), nbytes, runs, device),
            "d2h": _gbps(lambda: host.copy_(dev, non_blocking=True), nbytes, runs, device),
            "d2d": _gbps(lambda: dev2.copy_(dev), nbytes, runs, device)}


def _bench_case(name: str, kind: EngineLayoutKind, store: KVLayout, n: int, num_blocks: int, runs: int,
                device: torch.device, ctas_options: list[int | None]) -> dict[str, object]:
    pb = store.page_bytes
    nbytes = n * pb
    engine = EngineLayout.for_store(store, kind)
    layers = [torch.empty(engine.layer_shape(num_blocks), dtype=getattr(torch, store.dtype.torch_name), device=device)
              for _ in range(store.num_layers)]
    for t in layers:
        t.view(torch.uint8).random_(0, 256)
    rng = np.random.default_rng(n)
    ids = rng.choice(num_blocks, n, replace=False)
    rows = rng.permutation(n)
    host = torch.empty((n, pb), dtype=torch.uint8, pin_memory=device.type == "cuda")
    slots = torch.empty((2 * n, pb), dtype=torch.uint8, device=device)  # an HBM pool twice the batch
    slot_rows = rng.choice(2 * n, n, replace=False)
    base = _baselines(nbytes, runs, device)
    out: dict[str, object] = {"layout": name, "blocks": n, "page_bytes": pb, "chunk_bytes": engine.chunk_bytes,
                              "mib": round(nbytes / 2**20, 1), "baseline_gbps": _round(base)}
    paths = [CopyPath.TORCH] + ([CopyPath.KERNEL] if device.type == "cpu" or kernel_available() else [])
    results: dict[str, dict[str, float]] = {}
    for path in paths:
        for ctas in (ctas_options if path is CopyPath.KERNEL and device.type == "cuda" else [None]):
            kv = EngineKV(engine, layers, store, path=path, max_ctas=ctas)
            label = path.value if ctas is None else f"{path.value}-ctas{ctas}"
            r = {"gather_d2h": _gbps(lambda: kv.gather(ids, out=host, rows=rows), nbytes, runs, device),
                 "scatter_h2d": _gbps(lambda: kv.scatter(host, ids, rows=rows), nbytes, runs, device),
                 "gather_d2d": _gbps(lambda: kv.gather(ids, out=slots, rows=slot_rows), nbytes, runs, device),
                 "scatter_d2d": _gbps(lambda: kv.scatter(slots, ids, rows=slot_rows), nbytes, runs, device)}
            r.update(_layerwise(kv, host, ids, rows, nbytes, runs, device))
            results[label] = r
    verified = torch.equal(EngineKV(engine, layers, store, path=paths[-1]).gather(ids).cpu(),
                           EngineKV(engine, layers, store, path=CopyPath.TORCH).gather(ids).cpu())
    out["verified_paths_agree"] = verified
    out["gbps"] = {k: _round(v) for k, v in results.items()}
    out["ratios"] = {k: _round(_ratios(v, base)) for k, v in results.items()}
    return out


def _layerwise(kv: EngineKV, host: torch.Tensor, ids: np.ndarray, rows: np.ndarray, nbytes: int, runs: int,
               device: torch.device) -> dict[str, float]:
    with CopyStream(device) as copier:
        first: list[float] = []

        def load() -> None:
            t0 = time.perf_counter()
            done = load_layers(kv, host, ids, copier, rows=rows)
            done.layer(0).result()
            first.append(time.perf_counter() - t0)
            done.result()
        rate = _gbps(load, nbytes, runs, device)
    return {"layerwise_h2d": rate, "layerwise_first_layer_ms": 1e3 * statistics.median(first)}


def _ratios(r: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    against = {"gather_d2h": "d2h", "scatter_h2d": "h2d", "gather_d2d": "d2d", "scatter_d2d": "d2d",
               "layerwise_h2d": "h2d", "hbm_to_dram": "d2h", "dram_to_hbm": "h2d"}
    return {k: v / base[against[k]] for k, v in r.items() if k in against}


def _bench_tiers(page_bytes: int, n: int, runs: int, device: torch.device) -> dict[str, object]:
    """The copy-table entries between the HBM and DRAM tiers, on scattered slots of 4n-slot tiers."""
    base = _baselines(n * page_bytes, runs, device)
    rng = np.random.default_rng(7)
    out: dict[str, object] = {"page_bytes": page_bytes, "blocks": n, "baseline_gbps": _round(base)}
    paths = [CopyPath.TORCH] + ([CopyPath.KERNEL] if device.type == "cpu" or kernel_available() else [])
    gbps: dict[str, dict[str, float]] = {}
    with DramTier(4 * n, page_bytes) as dram:
        for path in paths:
            with HbmTier(4 * n, page_bytes, device=device, path=path) as hbm:
                hs = [int(s) for s in rng.choice(4 * n, n, replace=False)]
                ds = [int(s) for s in rng.choice(4 * n, n, replace=False)]
                gbps[path.value] = {
                    "hbm_to_dram": _gbps(lambda: hbm_to_dram(hbm, hs, dram, ds, page_bytes), n * page_bytes, runs, device),
                    "dram_to_hbm": _gbps(lambda: dram_to_hbm(dram, ds, hbm, hs, page_bytes), n * page_bytes, runs, device)}
    out["gbps"] = {k: _round(v) for k, v in gbps.items()}
    out["ratios"] = {k: _round(_ratios(v, base)) for k, v in gbps.items()}
    return out


def _round(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in d.items()}


def _headline(cases: list[dict[str, object]]) -> dict[str, object]:
    """Per operation, the best path's worst ratio over every case of 64 or more blocks."""
    worst: dict[str, float] = {}
    best_path: dict[str, str] = {}
    for case in cases:
        ratios = case["ratios"]
        assert isinstance(ratios, dict)
        ops = {op for r in ratios.values() for op in r}
        for op in ops:
            label, value = max(((p, r[op]) for p, r in ratios.items() if op in r), key=lambda pv: pv[1])
            if op not in worst or value < worst[op]:
                worst[op], best_path[op] = value, label
    directional = [op for op in worst if op.endswith(("h2d", "d2h", "_to_dram", "_to_hbm")) and "layerwise" not in op]
    return {"worst_ratio": _round(worst), "path": best_path, "target": TARGET,
            "meets_target": all(worst[op] >= TARGET for op in directional)}


def run(args: argparse.Namespace) -> dict[str, object]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tierkv.bench.gpu: no CUDA device here (use --device cpu for a smoke run)")
    layouts = CPU_LAYOUTS if device.type == "cpu" else LAYOUTS
    batches = (64,) if args.quick or device.type == "cpu" else (64, 256)
    runs = args.runs or (3 if args.quick or device.type == "cpu" else 7)
    ctas_options: list[int | None] = [None]
    if device.type == "cuda":
        sms = default_ctas(device) // 4
        ctas_options = [32, sms, 4 * sms] if not args.quick else [4 * sms]
    cases = []
    for name, (kind, store) in layouts.items():
        for n in batches:
            cases.append(_bench_case(name, kind, store, n, 2 * max(batches) if device.type == "cuda" else 128,
                                     runs, device, ctas_options))
            print(f"tierkv.bench.gpu: {name} x {n} done", file=sys.stderr, flush=True)
    first = next(iter(layouts.values()))[1]
    tiers = [_bench_tiers(first.page_bytes, n, runs, device) for n in batches]
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "kernel_available": kernel_available(), "runs": runs,
            "headline": _headline([*cases, *tiers]), "engine": cases, "tiers": tiers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierkv.bench.gpu", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="one batch size, one kernel configuration")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke run")
    parser.add_argument("--runs", type=int, default=0, help="timed runs per figure (median reported)")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _print_table(result)
    return 0


def _print_table(result: dict[str, object]) -> None:
    print(f"device: {result['device']}  torch {result['torch']}  kernel: {result['kernel_available']}")
    for case in [*result["engine"], *result["tiers"]]:  # type: ignore[misc]
        print(f"\n{case.get('layout', 'tiers')} x {case['blocks']} ({case['page_bytes']} B pages); "
              f"baseline GB/s {case['baseline_gbps']}")
        for path, ratios in case["ratios"].items():
            gbps = case["gbps"][path]
            print(f"  {path:>18}: " + ", ".join(f"{op} {gbps[op]:.1f} GB/s ({ratios[op]:.2f}x)" for op in ratios))
    print(f"\nheadline: {json.dumps(result['headline'])}")


if __name__ == "__main__":
    sys.exit(main())
