"""``tierkv bench``: every headline ratio in one run, each against a baseline measured in it.

- DRAM tier: ``Store.put``/``Store.get`` on a DRAM-only store against ``np.copyto`` of
  the same bytes (``dram_put_vs_memcpy``, ``dram_get_vs_memcpy``);
- NVMe tier: O_DIRECT writes (with flush) and cold reads against fio (io_uring,
  direct, same file, block size and queue depth) (``nvme_write_vs_fio``,
  ``nvme_read_vs_fio``);
- keys: chained keys plus index lookup of a 128K-token prompt against a chained
  sha256 plus dict lookup (``keys_vs_sha256``).

Ratios are higher-is-better. The headline ratios come from the first shape; every
shape's figures are under ``shapes``. Called by the CLI.
"""

from __future__ import annotations

import argparse
import tempfile

from tierkv.bench import check_dir
from tierkv.bench.io import bench_nvme
from tierkv.bench.keys import bench_keys
from tierkv.bench.store import bench_store_dram
from tierkv.progress import task_progress

SHAPES = ((2 << 20, 64), (256 << 10, 512))
QUICK_SHAPES = ((1 << 20, 32),)


def run(args: argparse.Namespace) -> dict[str, object]:
    """Run the benchmarks that ``args`` (``--quick``, ``--runs``, ``--dir``) select;
    InputError for a ``--dir`` that is not a writable directory."""
    check_dir(args.dir)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    runs = args.runs or (3 if args.quick else 5)
    per_shape: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-", dir=args.dir) as scratch:
        with task_progress("tierkv bench", total=2 * len(shapes) + 1) as step:
            for page_bytes, pages in shapes:
                dram = bench_store_dram(page_bytes, pages, runs)
                step()
                nvme = bench_nvme(scratch, page_bytes, pages, runs, (16,) if args.quick else (1, 4, 16, 32),
                                  io_threads_options=(4,) if args.quick else (1, 2, 4, 8))
                step()
                per_shape.append({"page_bytes": page_bytes, "pages": pages, "dram": dram, "nvme": nvme})
            keys = bench_keys(runs=runs)
            step()
    head_dram = per_shape[0]["dram"]
    head_nvme = per_shape[0]["nvme"]
    assert isinstance(head_dram, dict) and isinstance(head_nvme, dict)
    return {
        "dram_put_vs_memcpy": head_dram["dram_put_vs_memcpy"],
        "dram_get_vs_memcpy": head_dram["dram_get_vs_memcpy"],
        "nvme_read_vs_fio": head_nvme["nvme_read_vs_fio"],
        "nvme_write_vs_fio": head_nvme["nvme_write_vs_fio"],
        "keys_vs_sha256": keys["keys_vs_sha256"],
        "runs": runs,
        "shapes": per_shape,
        "keys": keys,
    }
