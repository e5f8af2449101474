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
operation with device synchronizations and is the median of ``--runs`` after one
untimed warm-up (the first-layer latency too). Ratios are higher-is-better; the target
is 0.9 for 64 or more scattered blocks, both directions. The headline takes, per
operation, the one configuration (path and CTA count) whose worst ratio over the cases
is best, and names it.

Every measured result is checked after its timed runs, outside them, against a
reference built with plain torch indexing from the source tensors (page format:
:class:`~tierkv.engine.geometry.PageGeometry`): gathers against the pages, scatters and
tier copies against the whole destination, so untargeted blocks and slots must be
untouched. Source rows are bit-flipped before each copy, so a copy that does nothing
cannot pass. Each case reports ``verified`` (and ``error`` when false); the result's
``verified`` is false and :func:`main` exits 1 on any mismatch. ``--device cpu`` runs
the same code on tiny shapes as a smoke test (figures meaningless, checks real).
Called by ``tools/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tierkv.engine import CopyPath, CopyStream, EngineKV, EngineLayout, EngineLayoutKind, load_layers
from tierkv.engine.cuda import default_ctas, kernel_available
from tierkv.layout import DType, KVLayout, LayoutKind
from tierkv.tiers.dram import DramTier
from tierkv.tiers.hbm import HbmTier, dram_rows, dram_to_hbm, hbm_to_dram

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


def _block_view(kind: EngineLayoutKind, t: torch.Tensor, chunk: int) -> torch.Tensor:
    """``t`` (one contiguous layer) as ``uint8 [num_blocks, planes, chunk]``, by plain views."""
    b = t.view(torch.uint8)
    if kind is EngineLayoutKind.FLASH:
        return b.view(2, -1, chunk).transpose(0, 1)
    return b.view(b.shape[0], 2 if kind is EngineLayoutKind.BLOCKS_FIRST else 1, chunk)


def _ref_gather(kind: EngineLayoutKind, layers: list[torch.Tensor], ids: np.ndarray, k: int,
                chunk: int) -> torch.Tensor:
    """The pages of blocks ``ids`` (``k`` a page): per layer, per plane, the ``k`` chunks in order."""
    idx = torch.from_numpy(ids).to(layers[0].device)
    n = len(ids) // k
    return torch.cat([_block_view(kind, t, chunk)[idx].reshape(n, k, -1, chunk).transpose(1, 2).reshape(n, -1)
                      for t in layers], dim=1)


def _ref_scatter(kind: EngineLayoutKind, layers: list[torch.Tensor], pages: torch.Tensor, ids: np.ndarray, k: int,
                 chunk: int) -> list[torch.Tensor]:
    """Copies of ``layers`` with ``pages`` (``[n, page_bytes]``, on their device) written into blocks ``ids``."""
    idx = torch.from_numpy(ids).to(layers[0].device)
    n, per, out = len(ids) // k, pages.shape[1] // len(layers), []
    for j, t in enumerate(layers):
        want = t.clone()
        part = pages[:, j * per:(j + 1) * per].reshape(n, -1, k, chunk).transpose(1, 2).reshape(n * k, -1, chunk)
        _block_view(kind, want, chunk)[idx] = part
        out.append(want)
    return out


def _flip(pages: torch.Tensor, rows: np.ndarray, device: torch.device) -> None:
    """Invert every bit of ``pages`` rows ``rows`` (through ``device``: host buffers are large)."""
    t = pages.to(device)
    idx = torch.from_numpy(rows).to(device)
    t[idx] = torch.bitwise_not(t[idx])
    if t.data_ptr() != pages.data_ptr():
        pages.copy_(t)


@dataclass(frozen=True)
class _Batch:
    """One case's engine KV, page buffers and scattered indices; times a copy, then checks it."""

    kind: EngineLayoutKind
    layers: list[torch.Tensor]
    ids: np.ndarray
    k: int  # engine blocks a page
    chunk: int
    host: torch.Tensor  # pinned on CUDA
    rows: np.ndarray
    slots: torch.Tensor  # on the device
    slot_rows: np.ndarray
    nbytes: int
    runs: int
    device: torch.device

    def gather(self, fn: Callable[[], object], pages: torch.Tensor, rows: np.ndarray) -> tuple[float, bool]:
        """GB/s of ``fn`` (blocks ``ids`` into ``pages`` rows ``rows``); whether those rows hold the reference."""
        _flip(pages, rows, self.device)
        rate = _gbps(fn, self.nbytes, self.runs, self.device)
        want = _ref_gather(self.kind, self.layers, self.ids, self.k, self.chunk)
        return rate, torch.equal(pages.to(self.device)[torch.from_numpy(rows).to(self.device)], want)

    def scatter(self, fn: Callable[[], object], pages: torch.Tensor, rows: np.ndarray) -> tuple[float, bool]:
        """GB/s of ``fn`` (``pages`` rows ``rows`` into blocks ``ids``); whether every layer is the reference."""
        _flip(pages, rows, self.device)
        src = pages.to(self.device)[torch.from_numpy(rows).to(self.device)]
        want = _ref_scatter(self.kind, self.layers, src, self.ids, self.k, self.chunk)
        rate = _gbps(fn, self.nbytes, self.runs, self.device)
        # as bytes: random bits include NaNs, which never compare equal as bf16
        return rate, all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                         for a, b in zip(self.layers, want, strict=True))


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
    k = store.tokens_per_page // engine.block_size
    batch = _Batch(kind, layers, ids, k, engine.chunk_bytes, host, rows, slots, slot_rows, nbytes, runs, device)
    results: dict[str, dict[str, float]] = {}
    bad: list[str] = []
    for path in paths:
        for ctas in (ctas_options if path is CopyPath.KERNEL and device.type == "cuda" else [None]):
            kv = EngineKV(engine, layers, store, path=path, max_ctas=ctas)
            label = path.value if ctas is None else f"{path.value}-ctas{ctas}"
            results[label], failed = _bench_path(kv, batch)
            bad += [f"{label} {op}" for op in failed]
    _verdict(out, bad)
    out["gbps"] = {k: _round(v) for k, v in results.items()}
    out["ratios"] = {k: _round(_ratios(v, base)) for k, v in results.items()}
    return out


def _bench_path(kv: EngineKV, b: _Batch) -> tuple[dict[str, float], list[str]]:
    """Every engine copy on one path: GB/s (and the first layer's ms), and the copies that failed their check."""
    timed = {"gather_d2h": b.gather(lambda: kv.gather(b.ids, out=b.host, rows=b.rows), b.host, b.rows),
             "scatter_h2d": b.scatter(lambda: kv.scatter(b.host, b.ids, rows=b.rows), b.host, b.rows),
             "gather_d2d": b.gather(lambda: kv.gather(b.ids, out=b.slots, rows=b.slot_rows), b.slots, b.slot_rows),
             "scatter_d2d": b.scatter(lambda: kv.scatter(b.slots, b.ids, rows=b.slot_rows), b.slots, b.slot_rows)}
    timed["layerwise_h2d"], first_ms = _layerwise(kv, b)
    rates = {op: rate for op, (rate, _) in timed.items()}
    rates["layerwise_first_layer_ms"] = first_ms
    return rates, [op for op, (_, ok) in timed.items() if not ok]


def _verdict(out: dict[str, object], bad: list[str]) -> None:
    out["verified"] = not bad
    if bad:
        out["error"] = "differs from the plain-indexing reference: " + ", ".join(bad)


def _layerwise(kv: EngineKV, b: _Batch) -> tuple[tuple[float, bool], float]:
    """``load_layers`` from the host pages: (GB/s, checked) until the last layer is in, and the
    median ms until the first layer is, over the timed runs only."""
    with CopyStream(b.device) as copier:
        first: list[float] = []

        def load() -> None:
            t0 = time.perf_counter()
            done = load_layers(kv, b.host, b.ids, copier, rows=b.rows)
            done.layer(0).result()
            first.append(time.perf_counter() - t0)
            done.result()
        timed = b.scatter(load, b.host, b.rows)
    # _gbps calls load once untimed (the cold warm-up) before its timed runs
    return timed, 1e3 * statistics.median(first[1:])


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
    bad: list[str] = []
    with DramTier(4 * n, page_bytes) as dram:
        for path in paths:
            with HbmTier(4 * n, page_bytes, device=device, path=path) as hbm:
                hbm.pool.random_(0, 256)
                hs = [int(s) for s in rng.choice(4 * n, n, replace=False)]
                ds = [int(s) for s in rng.choice(4 * n, n, replace=False)]
                gbps[path.value], failed = _tier_path(hbm, hs, dram, ds, page_bytes, runs, device)
                bad += [f"{path.value} {op}" for op in failed]
    _verdict(out, bad)
    out["gbps"] = {k: _round(v) for k, v in gbps.items()}
    out["ratios"] = {k: _round(_ratios(v, base)) for k, v in gbps.items()}
    return out


def _tier_path(hbm: HbmTier, hs: list[int], dram: DramTier, ds: list[int], page_bytes: int, runs: int,
               device: torch.device) -> tuple[dict[str, float], list[str]]:
    """Both copy-table entries on one path: GB/s, and those whose destination (every slot)
    differs from the reference."""
    host, pool = dram_rows(dram), hbm.pool
    h_idx, d_idx = torch.tensor(hs, device=device), torch.tensor(ds, device=device)
    nbytes, failed = len(hs) * page_bytes, []
    want = host.to(device, copy=True)
    want[d_idx] = pool[h_idx]
    down = _gbps(lambda: hbm_to_dram(hbm, hs, dram, ds, page_bytes), nbytes, runs, device)
    if not torch.equal(host.to(device), want):
        failed.append("hbm_to_dram")
    _flip(host, np.asarray(ds), device)
    want = pool.clone()
    want[h_idx] = host.to(device)[d_idx]
    up = _gbps(lambda: dram_to_hbm(dram, ds, hbm, hs, page_bytes), nbytes, runs, device)
    if not torch.equal(pool, want):
        failed.append("dram_to_hbm")
    return {"hbm_to_dram": down, "dram_to_hbm": up}, failed


def _round(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in d.items()}


def _headline(cases: list[dict[str, object]]) -> dict[str, object]:
    """Per operation, the one configuration (path, CTA count) whose worst ratio over every
    case is best, with that worst ratio. A configuration's figure in a case is the median
    of its runs, as the baseline's is; one configuration is held across the cases, so the
    headline is something a deployment could run. ``by_config`` has every configuration's
    worst ratio."""
    per_config: dict[str, dict[str, float]] = {}  # op -> config -> worst ratio over the cases
    for case in cases:
        ratios = case["ratios"]
        assert isinstance(ratios, dict)
        for label, r in ratios.items():
            for op, v in r.items():
                worst = per_config.setdefault(op, {})
                worst[label] = min(v, worst.get(label, v))
    config = {op: max(c, key=lambda label: c[label]) for op, c in per_config.items()}
    worst = {op: per_config[op][label] for op, label in config.items()}
    directional = [op for op in worst if op.endswith(("h2d", "d2h", "_to_dram", "_to_hbm")) and "layerwise" not in op]
    return {"worst_ratio": _round(worst), "config": config, "target": TARGET,
            "meets_target": all(worst[op] >= TARGET for op in directional),
            "by_config": {op: _round(c) for op, c in per_config.items()}}


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
    errors = [f"{c.get('layout', 'tiers')} x {c['blocks']}: {c['error']}" for c in [*cases, *tiers] if "error" in c]
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "kernel_available": kernel_available(), "runs": runs,
           "verified": not errors, "headline": _headline([*cases, *tiers]), "engine": cases, "tiers": tiers}
    if errors:
        out["error"] = "; ".join(errors)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m tierkv.bench.gpu``: the JSON object or a table; 1 when a copy failed its check."""
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
    if not result["verified"]:
        print(f"tierkv.bench.gpu: FAILED verification: {result['error']}", file=sys.stderr)
        return 1
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
