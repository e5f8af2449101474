"""The ``tierkv`` command line: ``tierkv replay``, ``bench``, ``sim``, ``plan`` and ``demo``.

``main(argv)`` is the console-script entry point (and ``python -m tierkv``). It
returns the exit status: 0 on success, 2 for bad input (arguments, sizes, trace
lines, config files: one line on stderr, never a traceback), 1 when a run fails
(including a replay page that fails verification). Heavy modules (the store, torch)
are imported inside the handlers so that ``--help`` and argument errors stay fast.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from tierkv.errors import ConfigError, InputError, LayoutError, TierKVError
from tierkv.units import format_size, parse_size

if TYPE_CHECKING:
    from tierkv.config import StoreConfig

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_SYNTHETIC_REQUESTS = 3000


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tierkv", description="A tiered KV-cache store for LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    rp = sub.add_parser(
        "replay", help="drive a serving workload through a real store and report hit rates and bytes moved",
        description="Replay a workload (the built-in synthetic mix, or a Mooncake JSONL trace) through a "
                    "real store: DRAM tier + file-backed O_DIRECT NVMe tier + LMDB index, one page per "
                    "512-token block. Requests run in arrival order as fast as the store allows.")
    src = rp.add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="FILE", help="Mooncake JSONL trace (timestamp, input_length, "
                     "output_length, hash_ids); default: the built-in synthetic mix")
    src.add_argument("--synthetic-requests", type=int, metavar="N", default=None,
                     help=f"requests of the synthetic mix (default {DEFAULT_SYNTHETIC_REQUESTS})")
    rp.add_argument("--limit", type=int, metavar="N", help="replay at most the first N requests")
    rp.add_argument("--seed", type=int, default=None, help="seed of the synthetic mix (default 0; not with --trace)")
    rp.add_argument("--mix", metavar="FIELD=VALUE,...", default=None,
                    help="change the synthetic mix, e.g. conversation_share=1,rag_share=0,agent_share=0 or "
                         "think_time_s_mean=300,system_prompt_blocks=4-16 (fields of tierkv.workload.SyntheticMix; "
                         "ranges as low-high)")
    rp.add_argument("--page-bytes", metavar="SIZE", default="64KiB",
                    help="bytes per 512-token page, a multiple of 2048 (default 64KiB)")
    rp.add_argument("--dram", metavar="SIZE", help="DRAM tier capacity (default: 4%% of the workload's "
                    "distinct blocks, at least twice its largest request)")
    rp.add_argument("--nvme", metavar="SIZE", help="NVMe tier capacity, 0 disables the tier (default: 40%% "
                    "of the distinct blocks, at least four times the largest request)")
    rp.add_argument("--config", metavar="TOML", help="store config to take tiers, capacities and policy "
                    "from; the page layout always comes from --page-bytes, and the store (NVMe data included) "
                    "goes to --workdir or a temporary directory, never to the config's paths")
    rp.add_argument("--workdir", metavar="DIR", help="store directory (kept afterwards); default: a "
                    "temporary directory removed afterwards")
    rp.add_argument("--keep", action="store_true", help="keep the temporary store directory")
    rp.add_argument("--no-verify", action="store_true", help="skip checking loaded pages' bytes")
    rp.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    rp.set_defaults(handler=_cmd_replay)
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
    bp.set_defaults(handler=_cmd_bench)
    from tierkv.plan.cli import add_parser as add_plan_parser

    add_plan_parser(sub)
    from tierkv.demo import add_parser as add_demo_parser

    add_demo_parser(sub)
    from tierkv.sim import add_parser as add_sim_parser

    add_sim_parser(sub)
    from tierkv.rig import add_parser as add_rig_parser

    add_rig_parser(sub)
    from tierkv.doctor import add_parser as add_doctor_parser

    add_doctor_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status instead of exiting."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        code: int = args.handler(args)
        return code
    except (InputError, ConfigError, LayoutError) as exc:
        _fail(f"error: {exc}")
        return EXIT_USAGE
    except TierKVError as exc:
        _fail(f"{type(exc).__name__}: {exc}")
        return EXIT_FAILED
    except OSError as exc:
        _fail(f"error: {exc}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130


def _fail(message: str) -> None:
    print(f"tierkv: {' '.join(message.split())}", file=sys.stderr)


# --------------------------------------------------------------------------------------
# replay


def _size(value: str | None, flag: str) -> int | None:
    return None if value is None else parse_size(value, flag)


def _cmd_replay(args: argparse.Namespace) -> int:
    # Parse every argument before importing the store, so bad input fails fast.
    page_bytes = parse_size(args.page_bytes, "--page-bytes")
    dram, nvme = _size(args.dram, "--dram"), _size(args.nvme, "--nvme")
    for flag, value in (("--limit", args.limit), ("--synthetic-requests", args.synthetic_requests)):
        if value is not None and value < 0:
            raise InputError(f"{flag} must be >= 0, got {value}")
    from tierkv import replay, workload

    layout = replay.replay_layout(page_bytes)
    n = DEFAULT_SYNTHETIC_REQUESTS if args.synthetic_requests is None else args.synthetic_requests
    mix = workload.parse_mix(args.mix) if args.mix is not None else None
    requests, source = workload.load_requests(args.trace, args.limit, n, args.seed, mix)
    if not requests:
        raise InputError("the workload has no requests")
    source["requests"] = len(requests)
    base = None
    if args.config is not None:
        from tierkv.config import load_config

        base = load_config(args.config, layout)   # the replay sets its own layout
        if base.nvmeof is not None or base.peers is not None:
            raise ConfigError(f"{args.config}: replay does not run [tiers.nvmeof] or [peers] (it would write "
                              "synthetic pages to a fabric namespace or to other nodes); use a config without them")
    workdir, temporary = _workdir(args)
    if not temporary and (workdir / "index.lmdb").exists():
        print(f"tierkv: {workdir} already holds a store: the replay starts warm (pages it holds are hits)",
              file=sys.stderr)
        source["warm_start"] = True
    try:
        if base is None:
            base = replay.replay_config(workdir, page_bytes, *replay.default_capacities(requests, page_bytes))
        cfg = _override(replace(base, path=str(workdir), layout=layout), dram, nvme)
        result = replay.run_replay(requests, cfg, progress=sys.stderr.isatty(), verify=not args.no_verify)
    finally:
        if temporary and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif temporary:
            print(f"tierkv: store kept in {workdir}", file=sys.stderr)
    out = {"workload": source, **result.to_json()}
    if args.json:
        print(json.dumps(out))
    else:
        _print_replay(out)
    return EXIT_OK


def _workdir(args: argparse.Namespace) -> tuple[Path, bool]:
    """The store directory and whether it is a temporary one of ours (never a config's
    store.path: a replay must not write synthetic pages into a serving store)."""
    if args.workdir is not None:
        return Path(args.workdir), False
    return Path(tempfile.mkdtemp(prefix="tierkv-replay-")), True


def _override(cfg: StoreConfig, dram: int | None, nvme: int | None) -> StoreConfig:
    """``cfg`` with the tier capacities given on the command line (0 removes a tier).

    The NVMe tier's data always goes to the store directory: a replay writes synthetic
    pages, and must never write them to the device or file a serving config names.
    """
    from tierkv.config import DramConfig, NvmeConfig

    dram_cfg, nvme_cfg = cfg.dram, cfg.nvme
    if nvme_cfg is not None and nvme_cfg.path is not None:
        nvme_cfg = replace(nvme_cfg, path=None)
    if dram is not None:
        dram_cfg = DramConfig(capacity_bytes=dram) if dram else None
    if nvme is not None:
        nvme_cfg = (replace(nvme_cfg, capacity_bytes=nvme) if nvme_cfg else NvmeConfig(nvme)) if nvme else None
    if dram_cfg is None and nvme_cfg is None:
        raise ConfigError("--dram 0 and --nvme 0 leave the store without a tier")
    return replace(cfg, dram=dram_cfg, nvme=nvme_cfg)


def _print_replay(out: Mapping[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cfg = _as_map(out["config"])
    page_bytes = int(_num(cfg.get("page_bytes")))
    tiers = _as_map(_as_map(out["store"]).get("tiers", {}))
    rates = _as_map(out["tier_hit_rate"])
    t = Table(title="tiers")
    for col in ("tier", "capacity", "pages used", "blocks served", "hit rate", "I/O GB/s"):
        t.add_column(col, justify="left" if col == "tier" else "right")
    for name, ts in tiers.items():
        ts = _as_map(ts)
        cap, used = int(_num(ts.get("capacity_slots"))), int(_num(ts.get("used_slots")))
        t.add_row(name, format_size(cap * page_bytes), f"{used}/{cap}",
                  str(int(_num(ts.get("hits")))), f"{_num(rates.get(name, 0.0)):.1%}",
                  f"{_num(ts.get('io_gbps')):.2f}")
    console.print(t)
    m = Table(title="bytes moved")
    for col in ("from -> to", "bytes", "call s", "GB/s"):
        m.add_column(col, justify="left" if col == "from -> to" else "right")
    bw, io_s = _as_map(out["bandwidth_gbps"]), _as_map(out["io_s"])
    for pair, nbytes in _as_map(out["bytes_moved"]).items():
        m.add_row(pair, format_size(_num(nbytes)), f"{_num(io_s.get(pair, 0.0)):.3f}", f"{_num(bw.get(pair, 0.0)):.2f}")
    console.print(m)
    wl = _as_map(out["workload"])
    console.print(
        f"{out['requests']} requests ({wl.get('source')}), {out['blocks_requested']} full blocks: "
        f"prefix hit rate {_num(out['prefix_hit_rate']):.1%} (unbounded cache {_num(out['ideal_hit_rate']):.1%}); "
        f"prefill tokens from cache {_num(out['prefill_tokens_from_cache_frac']):.1%}; "
        f"{out['pages_verified']} pages verified; {_num(out['wall_s']):.1f} s")


def _as_map(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


def _num(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


# --------------------------------------------------------------------------------------
# bench


def _cmd_bench(args: argparse.Namespace) -> int:
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
        from tierkv.bench.main import run

        result = run(args)
    # A benchmark whose copies came back wrong measured nothing: say so in the exit status.
    status = 1 if result.get("mismatches") or result.get("verified") is False else EXIT_OK
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
