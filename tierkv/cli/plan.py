"""The ``tierkv plan`` subcommand: arguments, workload choice and output.

``add_parser(subparsers)`` registers ``plan`` on the ``tierkv`` command line with
:func:`run` as its handler (``python -m tierkv.plan`` runs it alone). Exit statuses:
0 on success, 2 with one line on stderr for bad
input (arguments, sizes, model or hardware files, traces). Every argument is checked
before the workload is read.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierkv.cli.checks import check_plot
from tierkv.cli.exits import EXIT_OK
from tierkv.errors import InputError
from tierkv.layout import DType, KVLayout, LayoutKind
from tierkv.units import parse_size

if TYPE_CHECKING:
    from tierkv.plan.hardware import HardwareProfile
    from tierkv.plan.models import ModelSpec
    from tierkv.workload import Request

DEFAULT_SYNTHETIC_REQUESTS = 3000
_PARAM_FLAGS = ("requests", "context_tokens", "turns", "reuse")
#: Float flags and their sane ranges, inclusive; anything else (inf and nan included) exits 2. Past
#: these the arithmetic overflows or the answer means nothing: a request per 11 days to a billion per
#: second, a codec shrinking KV at most 100x (--prefill-tokens-s: costs.PREFILL_TOKENS_S_RANGE).
_FLOAT_RANGES = {"--request-rate": (1e-6, 1e9), "--codec-ratio": (0.01, 1.0), "--turns": (1.0, 1000.0),
                 "--reuse": (0.0, 1.0)}


def add_parser(subparsers: "argparse._SubParsersAction[Any]") -> argparse.ArgumentParser:
    """Add ``plan`` to ``subparsers`` and return its parser (handler: ``args.handler``)."""
    p = subparsers.add_parser(
        "plan", help="size KV tiers for a model, hardware profile and workload",
        description="Capacity planning: KV bytes per token, what each tier holds, prefix hit rates (LRU), "
                    "bandwidth each tier must sustain, load versus recompute, codec and FP8 effects, NIC load "
                    "with and without DualPath, and the cheapest tier sizes meeting a target. See docs/plan.md.")
    m = p.add_argument_group("model")
    mx = m.add_mutually_exclusive_group(required=True)
    mx.add_argument("--model", metavar="NAME", help="built-in model: llama-3.1-8b, llama-3.1-70b, llama-3.1-405b, "
                    "qwen2.5-7b, qwen2.5-72b, mistral-7b, mixtral-8x7b, deepseek-v3, smollm2-135m")
    mx.add_argument("--model-config", metavar="PATH", help="a Hugging Face config.json")
    m.add_argument("--kv-dtype", default="bf16", help="KV dtype: bf16, fp16, fp32, fp8_e4m3, fp8_e5m2 (default bf16)")
    m.add_argument("--tokens-per-page", type=int, default=16, metavar="N", help="tokens per store page (default 16)")
    h = p.add_argument_group("hardware")
    h.add_argument("--hardware", default="h200-node", metavar="NAME|PATH",
                   help="a profile shipped with tierkv (h200-node, dev-box) or a TOML file's path "
                        "(default h200-node)")
    for tier in ("hbm", "dram", "nvme", "nvmeof"):
        h.add_argument(f"--{tier}", metavar="SIZE", help=f"{tier} tier capacity per node (nvmeof: the pool); "
                       "0 removes the tier; default: the profile's")
    h.add_argument("--tp", type=int, metavar="N",
                   help="GPUs per model instance (default: the fewest that hold the weights)")
    h.add_argument("--prefill-tokens-s", type=float, metavar="X", help="prefill tokens/s of one instance "
                   "(default: the profile's measured value for the model, else peak FLOPs x MFU)")
    h.add_argument("--no-attention-term", action="store_true", help="recompute time linear in tokens (drop "
                   "the quadratic attention FLOPs)")
    h.add_argument("--codec-ratio", type=float, default=1.0, metavar="R", help="lossless codec's compressed/raw "
                   "ratio for the NVMe and NVMe-oF tiers (default 1.0 = off; ~0.65 measured on BF16)")
    h.add_argument("--lossy-bits", type=float, metavar="B", help="also plan lossy pages at B bits an element "
                   "(1 to under 16; bf16, fp16 or fp32 KV; docs/lossy.md) as a variant")
    w = p.add_argument_group("workload (default: the built-in synthetic mix)")
    wx = w.add_mutually_exclusive_group()
    wx.add_argument("--trace", metavar="FILE", help="Mooncake JSONL trace (512-token blocks)")
    wx.add_argument("--synthetic", type=int, metavar="N", help=f"N requests of the built-in synthetic mix "
                    f"(default {DEFAULT_SYNTHETIC_REQUESTS})")
    wx.add_argument("--params", action="store_true", help="conversations from --requests, --request-rate, "
                    "--context-tokens, --turns, --reuse")
    w.add_argument("--limit", type=int, metavar="N", help="use the first N requests of the trace or mix")
    w.add_argument("--seed", type=int, default=None,
                   help="seed of the synthetic or parametric workload (default 0; not with --trace)")
    w.add_argument("--request-rate", type=float, metavar="R", help="requests/s to plan for (a trace or the mix "
                   "is rescaled in time; --params default 1.0)")
    w.add_argument("--requests", type=int, metavar="N", help="--params: requests (default 3000)")
    w.add_argument("--context-tokens", metavar="LO:HI", help="--params: first-prompt length range, log-uniform "
                   "(default 1024:16384)")
    w.add_argument("--turns", type=float, metavar="MEAN", help="--params: mean turns per conversation (default 3)")
    w.add_argument("--reuse", type=float, metavar="F", help="--params: share of a first prompt shared across "
                   "conversations (default 0.5)")
    t = p.add_argument_group("recommendation target (optional)")
    tx = t.add_mutually_exclusive_group()
    tx.add_argument("--target-hit-rate", type=float, metavar="F", help="smallest configuration with this hit rate")
    tx.add_argument("--target-ttft-s", type=float, metavar="S", help="smallest configuration with this TTFT")
    t.add_argument("--ttft-percentile", type=float, default=90.0, metavar="P", help="TTFT percentile (default 90)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    o.add_argument("--plot", metavar="PNG", help="write hit rate vs capacity and load vs recompute to PNG")
    p.set_defaults(handler=run)
    return p


def _lossy_bits(bits: float | None, dtype: DType, layout: KVLayout) -> float | None:
    """``--lossy-bits``, checked against ``layout`` (the planned pages): InputError naming
    what is expected, below the floor a lossy tier's config refuses too."""
    from tierkv.lossy.format import min_budget

    if bits is None:
        return None
    if not math.isfinite(bits) or not 1.0 <= bits < 16.0:
        raise InputError(f"--lossy-bits must be bits an element, at least 1 and under 16, got {bits:g}")
    if dtype.itemsize < 2:
        raise InputError(f"--lossy-bits: lossy pages code bf16, fp16 or fp32 KV, not {dtype.value}")
    if layout.kind is not LayoutKind.KV:
        raise InputError(f"--lossy-bits: lossy pages code K/V layouts; this model's KV is {layout.kind.value} (MLA)")
    least = min_budget(layout.num_layers, layout.tokens_per_page, layout.num_kv_heads, layout.head_dim)
    if bits < least:
        raise InputError(f"--lossy-bits {bits:g} is below what this model's pages of {layout.tokens_per_page} tokens "
                         f"code at keeping every token ({least:.3f} bits an element: headers, widths and "
                         f"parameters count)")
    return float(bits)


def run(args: argparse.Namespace) -> int:
    """Handler of ``tierkv plan``; raises InputError/ConfigError/LayoutError for bad input."""
    from tierkv.plan.hardware import load_profile
    from tierkv.plan.planner import PlanRequest, make_plan
    from tierkv.plan.recommend import Target

    _check_numbers(args)
    if args.plot is not None:
        check_plot(args.plot)
    dtype = DType.parse(args.kv_dtype)
    model = _model(args)
    model.layout(dtype, args.tokens_per_page)  # a bad page size fails here, before the workload is read
    profile = _profile(load_profile(args.hardware), args)
    target = None
    if args.target_hit_rate is not None or args.target_ttft_s is not None:
        target = Target(args.target_hit_rate, args.target_ttft_s, args.ttft_percentile)
    requests, label = _workload(args)
    req = PlanRequest(model=model, profile=profile, kv_dtype=dtype, tokens_per_page=args.tokens_per_page,
                      codec_ratio=args.codec_ratio,
                      lossy_bits=_lossy_bits(args.lossy_bits, dtype, model.layout(dtype, args.tokens_per_page)),
                      prefill_tokens_s=args.prefill_tokens_s, tp=args.tp,
                      attention_term=not args.no_attention_term, request_rate_per_s=args.request_rate, target=target,
                      workload=label)
    plan = make_plan(req, requests, progress=True)
    if args.plot is not None:
        from tierkv.plan.plot import write_plot

        write_plot(plan, args.plot)
    from tierkv.plan.report import print_plan, to_dict

    if args.json:
        print(json.dumps(to_dict(plan), allow_nan=False))
    else:
        from rich.console import Console

        print_plan(plan, Console())
    return EXIT_OK


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value in (("--limit", args.limit), ("--synthetic", args.synthetic), ("--requests", args.requests),
                        ("--tokens-per-page", args.tokens_per_page), ("--tp", args.tp), ("--seed", args.seed)):
        low = 0 if flag in ("--limit", "--seed") else 1
        if value is not None and value < low:
            raise InputError(f"{flag} must be >= {low}, got {value}")
    from tierkv.plan.costs import PREFILL_TOKENS_S_RANGE

    for flag, (lo, hi) in {**_FLOAT_RANGES, "--prefill-tokens-s": PREFILL_TOKENS_S_RANGE}.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not (math.isfinite(value) and lo <= value <= hi):
            raise InputError(f"{flag} must be a finite number in [{lo:g}, {hi:g}], got {value}")
    if args.target_ttft_s is not None and not (math.isfinite(args.target_ttft_s) and args.target_ttft_s > 0):
        raise InputError(f"--target-ttft-s must be a finite number > 0 (seconds), got {args.target_ttft_s}")
    if not 0 < args.ttft_percentile <= 100:  # checked even without --target-ttft-s: it would be ignored silently
        raise InputError(f"--ttft-percentile must be in (0, 100], got {args.ttft_percentile}")
    stray = [f"--{f.replace('_', '-')}" for f in _PARAM_FLAGS if getattr(args, f) is not None]
    if stray and not args.params:
        raise InputError(f"{', '.join(stray)} describe a --params workload; add --params")


def _model(args: argparse.Namespace) -> ModelSpec:
    from tierkv.plan.models import builtin, load_hf_config

    return builtin(args.model) if args.model is not None else load_hf_config(args.model_config)


def _profile(profile: HardwareProfile, args: argparse.Namespace) -> HardwareProfile:
    from tierkv.plan.hardware import MAX_CAPACITY_BYTES, TierKind

    for kind in TierKind:
        value = getattr(args, kind.value)
        if value is None:
            continue
        if value.strip().startswith("-"):
            raise InputError(f"--{kind.value} must be a size >= 0, got {value!r}")
        try:
            size = parse_size(value, f"--{kind.value}")
        except OverflowError:  # hundreds of digits: no float holds them
            size = MAX_CAPACITY_BYTES + 1
        if size > MAX_CAPACITY_BYTES:
            raise InputError(f"--{kind.value} must be a size from 0 to 1 EiB, got {value!r}")
        profile = profile.with_capacity(kind, size)
    if not profile.tiers:
        raise InputError("every tier is sized 0: nothing left to plan")
    return profile


def _workload(args: argparse.Namespace) -> tuple[list[Request], str]:
    from tierkv import workload

    if args.trace is not None:
        if args.seed is not None:
            raise InputError("--seed seeds the synthetic or parametric workload; a trace runs as recorded, "
                             "so it cannot be used with --trace")
        return list(workload.read_mooncake(args.trace, args.limit)), f"mooncake trace {Path(args.trace).name}"
    args.seed = 0 if args.seed is None else args.seed
    if args.params:
        from tierkv.workload.params import ParamWorkload, param_workload

        spec = ParamWorkload(requests=args.requests or DEFAULT_SYNTHETIC_REQUESTS,
                             request_rate_per_s=args.request_rate or 1.0,
                             context_tokens=_range(args.context_tokens or "1024:16384"),
                             turns_mean=3.0 if args.turns is None else args.turns,
                             reuse=0.5 if args.reuse is None else args.reuse)
        reqs = param_workload(spec, args.seed)
        return reqs[:args.limit] if args.limit is not None else reqs, f"parametric (seed {args.seed})"
    n = DEFAULT_SYNTHETIC_REQUESTS if args.synthetic is None else args.synthetic
    n = n if args.limit is None else min(n, args.limit)
    return workload.synthetic(args.seed, n), f"synthetic mix (seed {args.seed})"


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        return int(lo), int(hi if sep else lo)
    except ValueError:
        raise InputError(f"--context-tokens must be LOW:HIGH token counts, got {text!r}") from None
