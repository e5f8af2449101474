"""``tierkv sim dualpath``: DualPath loading in a seeded discrete-event simulation
(:mod:`tierkv.dualpath.sim`, docs/dualpath.md).

Registered under ``tierkv sim`` by :mod:`tierkv.cli.sim`. Every flag is a field of
:class:`~tierkv.dualpath.sim.DualPathConfig` (rates in Gbit/s on the command line).
``--json`` prints one object: ``config`` and ``results`` (per policy: ``turns_per_s``,
``tokens_per_s``, ``throughput_vs_pe_only``, ``nic_util_prefill``, ``nic_util_decode``,
``prefill_read_share``, ``ttft_p50_s``, ``ttft_p99_s``).
"""

from __future__ import annotations

import argparse
import json

from tierkv.cli.exits import EXIT_OK
from tierkv.cli.sim import DEFAULT_POLICIES
from tierkv.errors import InputError

#: The policies (``tierkv.dualpath.scheduler.POLICIES``, spelled out to keep imports light).
POLICY_CHOICES = ("pe-only", "shorter-queue", "split")
#: ``tierkv sim``'s own options (flag, dest, default): given before ``dualpath`` they would
#: be ignored, so they are refused.
SIM_OPTIONS: tuple[tuple[str, str, object], ...] = (("--trace", "trace", None), ("--synthetic-requests", "synthetic_requests", None),
               ("--seed", "seed", None), ("--mix", "mix", None), ("--limit", "limit", None),
               ("--capacity", "capacity", None), ("--tiers", "tiers", []), ("--policy", "policy", DEFAULT_POLICIES),
               ("--no-promote", "no_promote", False), ("--cache-partial", "cache_partial", False),
               ("--json", "json", False), ("--plot", "plot", None))


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add ``dualpath`` to the ``tierkv sim`` subcommands."""
    from tierkv.dualpath.sim import DualPathConfig

    d = DualPathConfig()
    dp = sub.add_parser("dualpath", help="simulate DualPath loading: prefill-side reads vs reads through "
                        "the decode side's storage NICs",
                        description="Simulate P prefill and D decode engines loading an agent workload's cached "
                                    "KV from shared storage: through the prefill engines' storage NICs only "
                                    "(pe-only), or also through the decode engines' and over the compute network "
                                    "(shorter-queue: the DualPath paper's per-request choice; split: a request's "
                                    "pages divided so both sides finish together). docs/dualpath.md.")
    dp.add_argument("--prefill", type=int, default=d.prefill, metavar="P", help=f"prefill engines (default {d.prefill})")
    dp.add_argument("--decode", type=int, default=d.decode, metavar="D", help=f"decode engines (default {d.decode})")
    dp.add_argument("--storage-nic-gbps", type=float, default=d.storage_nic_bytes_s * 8 / 1e9, metavar="G",
                    help="each engine's storage NIC, Gbit/s (default %(default)g)")
    dp.add_argument("--compute-link-gbps", type=float, default=d.compute_link_bytes_s * 8 / 1e9, metavar="G",
                    help="each prefill engine's compute link, Gbit/s (default %(default)g)")
    dp.add_argument("--storage-gbps", type=float, default=d.storage_bytes_s * 8 / 1e9, metavar="G",
                    help="the storage cluster's total read rate, Gbit/s (default %(default)g)")
    dp.add_argument("--kv-bytes-per-token", type=int, default=d.kv_bytes_per_token, metavar="B",
                    help="KV bytes per token, all layers (default %(default)d: about DeepSeek-V3's)")
    dp.add_argument("--page-tokens", type=int, default=d.page_tokens, metavar="N", help="tokens per page (default %(default)d)")
    dp.add_argument("--prefill-us-per-token", type=float, default=d.prefill_s_per_token * 1e6, metavar="US",
                    help="prefill time per new token on a prefill engine, us (default %(default)g)")
    dp.add_argument("--decode-ms-per-token", type=float, default=d.decode_s_per_token * 1e3, metavar="MS",
                    help="decode time per output token, ms (default %(default)g)")
    dp.add_argument("--output-tokens", type=int, default=d.output_tokens, metavar="N", help="tokens decoded per turn")
    dp.add_argument("--sessions", type=int, default=d.sessions, metavar="N", help="concurrent agent sessions")
    dp.add_argument("--start-tokens", type=int, default=d.start_tokens, metavar="N",
                    help="a session's first prompt, on average (0.5-1.5x)")
    dp.add_argument("--turn-tokens", type=int, default=d.turn_tokens, metavar="N", help="tokens a turn adds")
    dp.add_argument("--turns", type=int, default=d.turns, metavar="N", help="turns per session")
    dp.add_argument("--hit-rate", type=float, default=d.hit_rate, metavar="F",
                    help="share of the previous prompt found cached (default %(default)g)")
    dp.add_argument("--think-s", type=float, default=d.think_s, metavar="S", help="mean think time between turns")
    dp.add_argument("--duration-s", type=float, default=d.duration_s, metavar="S", help="simulated seconds measured")
    dp.add_argument("--warmup-s", type=float, default=d.warmup_s, metavar="S", help="simulated seconds before")
    # Own names for the options ``tierkv sim`` also has: its values must not overwrite these.
    dp.add_argument("--seed", dest="dp_seed", type=int, default=d.seed, help="the sessions' seed (default 0)")
    dp.add_argument("--policy", dest="dp_policy", metavar="LIST", default=",".join(POLICY_CHOICES),
                    help="comma-separated, from " + ", ".join(POLICY_CHOICES) + " (pe-only always runs: the baseline)")
    dp.add_argument("--json", dest="dp_json", action="store_true", help="print one JSON object: config and results")
    dp.set_defaults(handler=run)
    return dp


def run(args: argparse.Namespace) -> int:
    from tierkv.dualpath.sim import DualPathConfig, run_dualpath

    given = [flag for flag, dest, default in SIM_OPTIONS if getattr(args, dest, default) != default]
    if given:
        raise InputError(f"{', '.join(given)}: an option of tierkv sim's policy simulation, not of 'sim dualpath' "
                         "(put dualpath's options after the word dualpath)")
    policies = [p.strip() for p in args.dp_policy.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICY_CHOICES]
    if unknown or not policies:
        raise InputError(f"--policy: unknown {', '.join(unknown) or '(empty)'}; expected from {', '.join(POLICY_CHOICES)}")
    cfg = DualPathConfig(
        prefill=args.prefill, decode=args.decode, storage_nic_bytes_s=args.storage_nic_gbps * 1e9 / 8,
        compute_link_bytes_s=args.compute_link_gbps * 1e9 / 8, storage_bytes_s=args.storage_gbps * 1e9 / 8,
        kv_bytes_per_token=args.kv_bytes_per_token, page_tokens=args.page_tokens,
        prefill_s_per_token=args.prefill_us_per_token / 1e6, decode_s_per_token=args.decode_ms_per_token / 1e3,
        output_tokens=args.output_tokens, sessions=args.sessions, start_tokens=args.start_tokens,
        turn_tokens=args.turn_tokens, turns=args.turns, hit_rate=args.hit_rate, think_s=args.think_s,
        duration_s=args.duration_s, warmup_s=args.warmup_s, seed=args.dp_seed)
    out = run_dualpath(cfg, policies)
    if args.dp_json:
        print(json.dumps(out))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"DualPath: {cfg.prefill} prefill, {cfg.decode} decode engines, {cfg.sessions} sessions "
                        f"({cfg.duration_s:g} s measured)")
    for col in ("policy", "turns/s", "vs pe-only", "prefill NIC util", "decode NIC util", "prefill read share",
                "TTFT p50 s", "TTFT p99 s"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=col == "policy")

    def f(v: object, fmt: str = "{:.3f}") -> str:
        return "-" if v is None else fmt.format(v)

    for name, r in out["results"].items():
        table.add_row(name, f(r["turns_per_s"], "{:.2f}"), f(r["throughput_vs_pe_only"]), f(r["nic_util_prefill"]),
                      f(r["nic_util_decode"]), f(r["prefill_read_share"]), f(r["ttft_p50_s"]), f(r["ttft_p99_s"]))
    Console().print(table)
    return EXIT_OK
