"""``tierkv replay``: drive a serving workload through a real store and report per-tier hit
rates, bytes moved and the share of prompt tokens served from cache.

:func:`add_parser` registers the subcommand, :func:`run` is its handler (the driver
itself is :mod:`tierkv.workload.replay`). Every argument is parsed before the store is
imported, so bad input fails fast with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierkv.cli.exits import EXIT_OK
from tierkv.errors import ConfigError, InputError
from tierkv.units import format_size, parse_size

if TYPE_CHECKING:
    from tierkv.config import StoreConfig

DEFAULT_SYNTHETIC_REQUESTS = 3000


def add_parser(sub: "argparse._SubParsersAction[Any]") -> argparse.ArgumentParser:
    """Add ``replay`` to ``tierkv``'s subparsers; its handler is :func:`run`."""
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
    rp.set_defaults(handler=run)
    return rp


def _size(value: str | None, flag: str) -> int | None:
    return None if value is None else parse_size(value, flag)


def run(args: argparse.Namespace) -> int:
    # Parse every argument before importing the store, so bad input fails fast.
    page_bytes = parse_size(args.page_bytes, "--page-bytes")
    dram, nvme = _size(args.dram, "--dram"), _size(args.nvme, "--nvme")
    for flag, value in (("--limit", args.limit), ("--synthetic-requests", args.synthetic_requests)):
        if value is not None and value < 0:
            raise InputError(f"{flag} must be >= 0, got {value}")
    from tierkv import workload
    from tierkv.workload import replay

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
    out = {"workload": source, **result.to_dict()}
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
        f"prefix hit rate {_num(out['prefix_hit_rate']):.1%} (unbounded cache {_num(out['unbounded_hit_rate']):.1%}); "
        f"prefill tokens from cache {_num(out['prefill_tokens_from_cache_frac']):.1%}; "
        f"{out['pages_verified']} pages verified; {_num(out['wall_s']):.1f} s")


def _as_map(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


def _num(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0
