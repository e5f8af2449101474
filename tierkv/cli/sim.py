"""``tierkv sim``: hit rates of policies over a trace or the synthetic mix, without moving bytes.

``add_parser(subparsers)`` adds the subcommand to ``tierkv``'s parser (its handler is
:func:`run`). Importing this module is cheap (no numpy, no store): the simulator is
imported by the handler. Bad input raises :class:`~tierkv.errors.InputError` inside the
handler (the CLI turns it into one line and exit status 2); ``--plot`` is checked
(path, matplotlib) before any work. ``--json`` prints one JSON object: ``workload`` (trace
path, or synthetic seed and the mix fields changed by ``--mix``; requests, blocks and
distinct blocks) and ``results``, one object per policy and tier configuration.
"""

from __future__ import annotations

import argparse
import json
import sys

from typing import TYPE_CHECKING

from tierkv.cli.checks import check_plot
from tierkv.cli.exits import EXIT_OK
from tierkv.errors import InputError
from tierkv.progress import task_progress

if TYPE_CHECKING:
    from tierkv.sim.run import SimResult, Workload

#: What ``--policy`` accepts (``tierkv.sim.run.SIM_POLICIES``, spelled out to keep imports light).
POLICY_CHOICES = ("lru", "lru-leaf", "s3fifo", "gittins", "opt", "lru-stack")
LRU_STACK = "lru-stack"
DEFAULT_CAPACITIES = "0.5%,1%,2%,5%,10%,20%,50%"
DEFAULT_POLICIES = "lru,gittins,opt"
DEFAULT_SYNTHETIC_REQUESTS = 20000


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add ``sim`` to a ``tierkv`` subparsers object; returns the new parser."""
    sp = subparsers.add_parser(
        "sim", help="simulate eviction policies over a trace and report prefix hit rates",
        description="Run policies over a Mooncake JSONL trace or the built-in synthetic mix with the "
                    "store's own policy code and the same calls its block manager makes, but no bytes. "
                    "Reports the prefix hit rate: blocks served from cache over blocks requested, a block "
                    "counting only if every earlier block of its request was cached when it arrived.")
    src = sp.add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="FILE", help="Mooncake JSONL trace; default: the synthetic mix")
    src.add_argument("--synthetic-requests", type=int, metavar="N", default=None,
                     help=f"requests of the synthetic mix (default {DEFAULT_SYNTHETIC_REQUESTS})")
    sp.add_argument("--seed", type=int, default=None, help="seed of the synthetic mix (default 0; not with --trace)")
    sp.add_argument("--mix", metavar="FIELD=VALUE,...", default=None,
                    help="change the synthetic mix, e.g. conversation_share=1,rag_share=0,agent_share=0 or "
                         "think_time_s_mean=300,system_prompt_blocks=4-16 (fields of tierkv.workload.SyntheticMix; "
                         "ranges as low-high)")
    sp.add_argument("--limit", type=int, metavar="N", help="only the first N requests")
    sp.add_argument("--capacity", metavar="LIST", default=None,
                    help="single-tier capacities: blocks or percentages of the distinct blocks, comma-"
                         f"separated (default {DEFAULT_CAPACITIES.replace('%', '%%')} unless --tiers is given)")
    sp.add_argument("--tiers", metavar="LIST", action="append", default=[],
                    help="one multi-tier configuration, fastest tier first, e.g. 1%%,10%% for DRAM and "
                         "NVMe; repeatable")
    sp.add_argument("--policy", metavar="LIST", default=DEFAULT_POLICIES,
                    help=f"comma-separated, from {', '.join(POLICY_CHOICES)} (default {DEFAULT_POLICIES}); "
                         f"{LRU_STACK} is plain LRU at every capacity from one pass")
    sp.add_argument("--no-promote", action="store_true", help="read hits in place instead of promoting them")
    sp.add_argument("--cache-partial", action="store_true",
                    help="also cache each request's partial last block (the store never does; some "
                         "simulators do)")
    sp.add_argument("--json", action="store_true", help="print one JSON object only: the workload and the results")
    sp.add_argument("--plot", metavar="PNG", help="draw hit rate against capacity per policy (matplotlib)")
    sp.set_defaults(handler=run)
    from tierkv.cli import dualpath

    dualpath.add_parser(sp.add_subparsers(dest="sim_command", required=False, metavar="{dualpath}"))
    return sp


def run(args: argparse.Namespace) -> int:
    """The handler of ``tierkv sim``: parse, load, simulate, print."""
    policies = list(dict.fromkeys(p.strip() for p in args.policy.split(",") if p.strip()))  # each once
    unknown = [p for p in policies if p not in POLICY_CHOICES]
    if unknown or not policies:
        raise InputError(f"--policy: unknown {', '.join(unknown) or '(empty)'}; expected from {', '.join(POLICY_CHOICES)}")
    for flag, value in (("--limit", args.limit), ("--synthetic-requests", args.synthetic_requests)):
        if value is not None and value < 0:
            raise InputError(f"{flag} must be >= 0, got {value}")
    if args.plot is not None:
        check_plot(args.plot)
    workload = _load(args)
    configs = _configs(args, workload)
    if LRU_STACK in policies and any(len(c) > 1 for c in configs):
        raise InputError(f"{LRU_STACK} is single-tier only; use --capacity, not --tiers")
    results = _run_all(workload, policies, configs, promote=not args.no_promote)
    if args.plot is not None:
        from tierkv.sim.plot import plot_curves

        plot_curves(results, workload, args.plot)
    if args.json:
        print(json.dumps({"workload": _summary(workload), "results": [r.to_dict() for r in results]}))
    else:
        _print_table(results, workload)
    return EXIT_OK


def _load(args: argparse.Namespace) -> Workload:
    from tierkv import workload as wl
    from tierkv.sim.run import Workload

    n = DEFAULT_SYNTHETIC_REQUESTS if args.synthetic_requests is None else args.synthetic_requests
    mix = wl.parse_mix(args.mix) if args.mix is not None else None
    reqs, source = wl.load_requests(args.trace, args.limit, n, args.seed, mix)
    if not reqs:
        raise InputError("the workload has no requests")
    return Workload.from_requests(reqs, cache_partial=args.cache_partial, source=source)


def _summary(workload: Workload) -> dict[str, object]:
    return {**workload.source, "requests": len(workload.keys), "blocks": workload.total_blocks,
            "distinct_blocks": workload.distinct_blocks}


def _configs(args: argparse.Namespace, workload: Workload) -> list[list[int]]:
    from tierkv.sim.run import parse_capacities

    configs = [[c] for c in parse_capacities(args.capacity or DEFAULT_CAPACITIES, workload.distinct_blocks)] \
        if args.capacity is not None or not args.tiers else []
    for spec in args.tiers:
        configs.append(parse_capacities(spec, workload.distinct_blocks, "--tiers"))
    return configs


def _run_all(workload: Workload, policies: list[str], configs: list[list[int]], promote: bool) -> list[SimResult]:
    from tierkv.sim.run import simulate
    from tierkv.sim.stack import lru_curve_results

    results: list[SimResult] = []
    runs = sum(1 if p == LRU_STACK else len(configs) for p in policies)
    with task_progress("sim", runs, sys.stderr.isatty()) as advance:
        for policy in policies:
            if policy == LRU_STACK:
                results.extend(lru_curve_results(workload, [c[0] for c in configs]))
                advance()
                continue
            for tiers in configs:
                results.append(simulate(workload, policy, tiers, promote=promote))
                advance()
    return results


def _print_table(results: list[SimResult], workload: Workload) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"prefix hit rate ({len(workload.keys)} requests, {workload.total_blocks} blocks, "
                        f"{workload.distinct_blocks} distinct)")
    for col in ("policy", "tiers (blocks)", "capacity", "prefix hit rate", "by tier", "s"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        by_tier = " ".join(f"{k}:{v:.3f}" for k, v in r.tier_hit_rate.items()) if len(r.tiers) > 1 else ""
        table.add_row(r.policy, "+".join(map(str, r.tiers)), f"{r.capacity_frac:.2%}", f"{r.prefix_hit_rate:.4f}",
                      by_tier, f"{r.wall_s:.1f}")
    Console().print(table)
