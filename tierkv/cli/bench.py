"""``tierkv bench``: the benchmark suites of :mod:`tierkv.bench`, each printing ratios
against a baseline measured in the same run.

:func:`add_parser` registers the subcommand, :func:`run` is its handler: one JSON
object with ``--json``, else tables. Exit status 1 when a suite's copies came back
wrong (it measured nothing).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from tierkv.cli.exits import EXIT_FAILED, EXIT_OK
from tierkv.errors import InputError


def add_parser(sub: "argparse._SubParsersAction[Any]") -> argparse.ArgumentParser:
    """Add ``bench`` to ``tierkv``'s subparsers; its handler is :func:`run`."""
    bp = sub.add_parser("bench", help="run the tier and store benchmarks",
                        description="Run the benchmarks of tierkv.bench and print a table or JSON: "
                                    "'store' (default) measures the DRAM and NVMe tiers and the keys, "
                                    "'codec' the lossless KV codec against zipnn and zstd on real KV pages.")
    bp.add_argument("suite", nargs="?", choices=("store", "codec", "codec-store", "net"), default="store",
                    help="what to measure ('codec-store': an NVMe tier with codec none vs lossless; "
                         "'net': peer page fetches and incast over TCP, and RDMA where a device exists)")
    bp.add_argument("--kv", metavar="FILE.safetensors", help="codec: KV tensors layerNN.k/.v "
                    "[kv_heads, tokens, head_dim] (default: ../shared/data/kv/)")
    bp.add_argument("--page-tokens", type=int, default=16, metavar="N", help="codec: tokens per page (default 16)")
    bp.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    bp.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    bp.add_argument("--dir", metavar="DIR", help="directory for the files of the store and codec-store suites "
                    "(default: a temporary one; codec and net write none)")
    bp.add_argument("--runs", type=int, default=None, metavar="N", help="repetitions per measurement")
    bp.set_defaults(handler=run)
    return bp


def run(args: argparse.Namespace) -> int:
    if args.runs is not None and args.runs < 1:
        raise InputError(f"--runs must be >= 1, got {args.runs}")
    if args.page_tokens < 1:
        raise InputError(f"--page-tokens must be >= 1, got {args.page_tokens}")
    if args.suite == "codec":
        from tierkv.bench.codec import run_codec_bench

        result = run_codec_bench(args.kv, args.page_tokens, args.runs or (2 if args.quick else 3))
    elif args.suite == "net":
        from tierkv.bench.net import net_report

        result = net_report(quick=args.quick)
    elif args.suite == "codec-store":
        from tierkv.bench.codec_store import run_codec_store_bench

        result = run_codec_store_bench(args.kv, args.page_tokens, args.runs or (1 if args.quick else 3),
                                       where=args.dir, copies=2 if args.quick else 8)
    else:
        from tierkv.bench.headline import run

        result = run(args)
    # A benchmark whose copies came back wrong measured nothing: say so in the exit status.
    status = EXIT_FAILED if result.get("mismatches") or result.get("verified") is False else EXIT_OK
    if args.json:
        print(json.dumps(result))
        return status
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tierkv bench")
    table.add_column("measurement")
    table.add_column("value", justify="right")
    for key, value in _flatten(result):
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)
    return status


def _flatten(value: object, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(value, Mapping):
        rows: list[tuple[str, object]] = []
        for k, v in value.items():
            rows.extend(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return rows
    return [(prefix, value)]
