"""GPU decoder benchmark: codec pages loaded coded and decoded on the device, against
copying the raw pages.

``python -m tierkv.bench.gpu_codec [--json] [--device cuda|cpu] [--pages N] [--runs R]``.
Pages: the real SmolLM2-135M KV sample (``../shared/data/kv``) where present, otherwise
Gaussian BF16 pages with per-channel scales in the same geometry (3 layers x 3 heads x
64, 16 tokens: 36 KiB); a few distinct pages are encoded (the C codec where built, the
portable one otherwise) and repeated to ``--pages``. In one run, each the median of
``--runs`` after a warm-up, the device synchronized around every timing, in GB/s of raw
(decoded) page bytes:

- ``h2d_raw_gbps``: the raw pages from pinned host memory to the device (the baseline);
- ``load_coded_gbps``: the coded blobs from pinned memory to the device and decoded there
  (the prepared batch's arrays and the kernel; the host side timed apart);
- ``kernel_gbps``: the kernel alone on blobs already on the device;
- ``prepare_gbps``: the host side (checks, checksum, descriptors) on one core;
- ``cpu_decode_gbps``: the C decoder on one core on the same blobs (where built);
- ratios: ``load_coded_vs_h2d_raw`` and ``kernel_vs_cpu_decode``.

Every decoded page is compared with its source (``verified``). ``--device cpu`` runs the
kernel through the CPU emulation on a few pages: a smoke test of this script and the
kernel's checks, with meaningless figures. Called by ``tools/gpu_check.sh``.
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

from tierkv.codec import Codec, gpu
from tierkv.codec.codec import native_available
from tierkv.layout import DType, KVLayout


def _pages(distinct: int) -> tuple[KVLayout, np.ndarray, str]:
    from tierkv.bench.codec import DEFAULT_KV_DIR, kv_pages, load_kv

    files = sorted(DEFAULT_KV_DIR.glob("*.safetensors")) if DEFAULT_KV_DIR.is_dir() else []
    if files:
        layout, rows = kv_pages(load_kv(files[0])[1], 16, DType.BF16)
        return layout, rows[:distinct], f"real KV ({files[0].name})"
    layout = KVLayout(3, 3, 64, DType.BF16, 16)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((distinct, *layout.page_shape)) * np.exp(rng.normal(0, 1.5, layout.page_shape[-1]))
    t = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).contiguous().view(torch.uint8)
    return layout, t.reshape(distinct, layout.page_bytes).numpy().copy(), "gaussian BF16 (no KV sample here)"


def _median(fn: Callable[[], object], runs: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(runs):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, object]:
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    if not cpu and not gpu.device_available():
        raise SystemExit("tierkv.bench.gpu_codec: no CUDA device or CuPy here (use --device cpu for a smoke run)")
    n = args.pages or (8 if cpu else 4096)
    layout, distinct, source = _pages(min(16, n))
    with Codec(layout) as codec:
        blobs = [bytes(b) for b in codec.encode(distinct)]
    reps = -(-n // len(blobs))
    blobs = (blobs * reps)[:n]
    rows = np.tile(distinct, (reps, 1))[:n]
    raw_bytes = rows.nbytes
    coded_bytes = sum(len(b) for b in blobs)
    buf, offsets, lengths = gpu.pack(blobs)
    batch = gpu.prepare_buffer(layout, buf, offsets, lengths)
    prep_s = _median(lambda: gpu.prepare_buffer(layout, buf, offsets, lengths), args.runs, lambda: None)
    out: dict[str, object] = {"device": "cpu (emulated kernel)" if cpu else torch.cuda.get_device_name(device),
                              "pages": n, "page_bytes": layout.page_bytes, "source": source,
                              "ratio": round(coded_bytes / raw_bytes, 4), "native_host_side": native_available(),
                              "prepare_gbps": round(raw_bytes / prep_s / 1e9, 3), "runs": args.runs}
    cpu_s = None
    if native_available():
        dst = np.empty_like(rows)
        with Codec(layout) as codec:
            cpu_s = _median(lambda: codec.decode_into(blobs, dst), args.runs, lambda: None)
        out["cpu_decode_gbps"] = round(raw_bytes / cpu_s / 1e9, 3)
    if cpu:
        decoded, report = gpu.emulate(batch)
        out["verified"] = report.ok and bool(np.array_equal(decoded, rows))
        return out

    decoder = gpu.GpuDecoder(layout, device.index)
    sync = torch.cuda.synchronize
    pinned_raw = torch.from_numpy(rows).pin_memory()
    pinned_buf = torch.from_numpy(batch.buf).pin_memory()
    dev_raw = torch.empty_like(pinned_raw, device=device)
    h2d_s = _median(lambda: dev_raw.copy_(pinned_raw, non_blocking=True), args.runs, sync)
    arrays = decoder.upload(batch)
    dev_out = torch.empty((n, layout.page_bytes), dtype=torch.uint8, device=device)
    kernel_s = _median(lambda: decoder.launch(arrays, dev_out), args.runs, sync)

    def load() -> None:
        arrays.buf.copy_(pinned_buf, non_blocking=True)
        decoder.launch(arrays, dev_out)

    load_s = _median(load, args.runs, sync)
    ok = not bool(arrays.status.any()) and torch.equal(dev_out.cpu(), torch.from_numpy(rows))
    kernel_gbps = raw_bytes / kernel_s / 1e9
    out.update({
        "h2d_raw_gbps": round(raw_bytes / h2d_s / 1e9, 3),
        "load_coded_gbps": round(raw_bytes / load_s / 1e9, 3),
        "kernel_gbps": round(kernel_gbps, 3),
        "load_coded_vs_h2d_raw": round(h2d_s / load_s, 3),
        "verified": ok,
    })
    if cpu_s is not None:
        out["kernel_vs_cpu_decode"] = round(kernel_gbps / (raw_bytes / cpu_s / 1e9), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierkv.bench.gpu_codec",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke run")
    parser.add_argument("--pages", type=int, default=0, help="pages per batch (default 4096; 8 on cpu)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per figure (median reported)")
    args = parser.parse_args(argv)
    if args.pages < 0 or args.runs < 1:
        parser.error("--pages must be >= 0 and --runs >= 1")
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for k, v in result.items():
            print(f"{k:>24}: {v}")
    if not result["verified"]:
        print("tierkv.bench.gpu_codec: FAILED: a decoded page differs from its source", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
