"""Rendering a :class:`tierkv.plan.planner.Plan`: one JSON object, or rich tables on the terminal.

The JSON keys are the interface (documented in ``docs/plan.md``); the tables show the
same numbers rounded. Called by :mod:`tierkv.cli.plan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tierkv.plan.planner import BLOCK_TOKENS, Plan, TierResult
from tierkv.units import format_size

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from tierkv.plan.recommend import Recommendation

JSONValue = object


def to_dict(plan: Plan) -> dict[str, JSONValue]:
    """The plan as one JSON-ready dict (``tierkv plan --json``); its keys are the interface."""
    req, layout, dep, prof = plan.request, plan.layout, plan.deployment, plan.profile
    model, cluster = req.model, req.profile.cluster
    ev = plan.evaluation
    return {
        "model": {"name": model.name, "attention": model.attention.value, "num_layers": model.num_layers,
                  "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim, "layout_kind": layout.kind.value,
                  "kv_dtype": layout.dtype.value, "tokens_per_page": layout.tokens_per_page,
                  "active_params": model.active_params, "total_params": model.total_params,
                  "weight_bytes": model.weight_bytes, "max_context_tokens": model.max_context_tokens},
        "kv_bytes_per_token": layout.token_bytes,
        "page_bytes": layout.page_bytes,
        "block_tokens": BLOCK_TOKENS,
        "codec_ratio": req.codec_ratio,
        "lossy_bits": req.lossy_bits,
        "hardware": {"profile": req.profile.name, "nodes": cluster.nodes, "disaggregated": cluster.disaggregated,
                     "prefill_nodes": cluster.prefill_nodes, "decode_nodes": cluster.decode_nodes,
                     "instance_gpus": dep.instance_gpus, "instances_per_node": dep.instances_per_node,
                     "idle_gpus_per_node": dep.idle_gpus_per_node,
                     "hbm_kv_space_bytes_per_node": dep.kv_space_bytes_per_node,
                     "hbm_cache_bytes_per_node": dep.hbm_cache_bytes_per_node},
        "workload": {"source": req.workload, "requests": prof.requests, "full_blocks": prof.blocks,
                     "distinct_blocks": int(np.count_nonzero(prof.depth == np.iinfo(np.int64).max)),
                     "mean_input_tokens": float(prof.input_tokens.mean()) if prof.requests else 0.0,
                     "duration_s": plan.time.duration_s, "request_rate_per_s": plan.time.request_rate_per_s,
                     "trace_request_rate_per_s": plan.time.natural_rate_per_s,
                     "unbounded_hit_rate": plan.unbounded_hit_rate},
        "prefill": {"tokens_s": plan.prefill.tokens_s, "source": plan.prefill.source,
                    "attention_term": plan.prefill.attention_flops_coeff > 0,
                    "attention_flops_coeff": plan.prefill.attention_flops_coeff,
                    "recompute_s_per_1k_tokens": float(plan.prefill.recompute_s(1000)),
                    "utilization": plan.prefill_utilization},
        "hit_rate": ev.hit_rate,
        "policy": {"name": plan.policy_run.policy.value, "engine": plan.policy_run.engine,
                   "hit_rate": plan.policy_run.hit_rate, "tier_hit_rates": list(plan.policy_run.tier_hit_rates)},
        "ttft_s": {"mean": float(ev.ttft_s.mean()), "p50": ev.ttft_percentile_s(50),
                   "p90": ev.ttft_percentile_s(90), "p99": ev.ttft_percentile_s(99),
                   "no_cache_mean": float(np.mean(plan.prefill.recompute_s(prof.input_tokens)))},
        "tiers": [_tier_json(t, layout.tokens_per_page) for t in plan.tiers],
        "curve": {"capacity_blocks": plan.curve_blocks.tolist(),
                  "capacity_tokens": (plan.curve_blocks * BLOCK_TOKENS).tolist(),
                  "capacity_bytes": (plan.curve_blocks * BLOCK_TOKENS * layout.token_bytes).tolist(),
                  "hit_rate": plan.curve_hit_rate.tolist()},
        "variants": [{"label": v.label, "kv_dtype": v.kv_dtype.value, "codec_ratio": v.codec_ratio,
                      "kv_bytes_per_token": v.kv_bytes_per_token, "hit_rate": v.hit_rate,
                      "ttft_mean_s": v.ttft_mean_s, "ttft_p90_s": v.ttft_p90_s,
                      "capacity_tokens": dict(zip(_kinds(plan), v.capacity_tokens)),
                      "recompute_crossover_tokens": dict(zip(_kinds(plan), v.crossover_tokens))}
                     for v in plan.variants],
        "network": [{"scenario": s.name, "decode_share": s.decode_share, "max_utilization": s.max_utilization,
                     "nics": [{"side": n.side, "nic": n.nic, "count": n.count, "rx_bytes_s": n.rx_bytes_s,
                               "tx_bytes_s": n.tx_bytes_s, "capacity_bytes_s": n.capacity_bytes_s,
                               "utilization": n.utilization} for n in s.loads]} for s in plan.network],
        "recommendation": _recommendation_json(plan.recommendation),
    }


def _kinds(plan: Plan) -> list[str]:
    return [t.tier.kind.value for t in plan.tiers]


def _tier_json(r: TierResult, tokens_per_page: int) -> dict[str, JSONValue]:
    t, f = r.tier, r.flow
    return {"tier": t.kind.value, "capacity_bytes": t.capacity_bytes, "nodes": t.nodes,
            "capacity_bytes_per_node": t.capacity_bytes // t.nodes, "stored_bytes_per_token": t.bytes_per_token,
            "capacity_tokens": t.capacity_tokens, "capacity_pages": t.capacity_tokens // tokens_per_page,
            "capacity_blocks": r.capacity_blocks,
            "hit_rate": f.hit_rate, "cumulative_hit_rate": r.cumulative_hit_rate, "policy_hit_rate": r.policy_hit_rate,
            "load_latency_s": t.latency_s, "load_bandwidth_bytes_s": t.request_bandwidth_bytes_s,
            "load_s_per_1k_tokens": float(t.load.load_s(1000)),
            "required_bandwidth_bytes_s": f.mean_bytes_s, "required_read_bytes_s": _share(f.read_bytes, r),
            "required_write_bytes_s": _share(f.write_bytes, r), "peak_bandwidth_bytes_s": f.peak_bytes_s,
            "available_bandwidth_bytes_s": t.bandwidth_bytes_s, "bandwidth_utilization": r.utilization,
            "peak_bandwidth_utilization": r.peak_utilization, "bandwidth_ok": r.peak_utilization <= 1.0,
            "recompute_crossover_tokens": r.crossover_tokens}


def _share(nbytes: float, r: TierResult) -> float:
    """Mean bytes/s of ``nbytes`` of the tier's reads and writes together."""
    total = r.flow.read_bytes + r.flow.write_bytes
    return r.flow.mean_bytes_s * nbytes / total if total else 0.0


def _recommendation_json(rec: Recommendation | None) -> dict[str, JSONValue] | None:
    if rec is None:
        return None
    return {"target": {"hit_rate": rec.target.hit_rate, "ttft_s": rec.target.ttft_s,
                       "ttft_percentile": rec.target.ttft_percentile},
            "met": rec.met, "cost": rec.cost, "hit_rate": rec.hit_rate, "ttft_s": rec.ttft_s,
            "evaluated": rec.evaluated, "candidates": rec.candidates,
            "tiers": [{"tier": t.kind.value, "capacity_bytes": t.capacity_bytes,
                       "capacity_bytes_per_node": t.capacity_bytes // t.nodes} for t in rec.tiers]}


# --------------------------------------------------------------------------------------
# terminal


def _bw(value: float) -> str:
    if value >= 1e12:
        return f"{value / 1e12:.3g} TB/s"
    if value >= 1e9:
        return f"{value / 1e9:.3g} GB/s"
    return f"{value / 1e6:.3g} MB/s" if value >= 1e5 else "0" if value == 0 else f"{value / 1e3:.3g} kB/s"


def _secs(value: float) -> str:
    if value >= 1:
        return f"{value:.3g} s"
    return f"{value * 1e3:.3g} ms" if value >= 1e-3 else f"{value * 1e6:.3g} µs"


def print_plan(plan: Plan, console: Console) -> None:
    """The plan as text and tables on ``console``."""
    from rich.markup import escape
    from rich.table import Table

    req, layout, dep, prof, ev = plan.request, plan.layout, plan.deployment, plan.profile, plan.evaluation
    cluster = req.profile.cluster
    split = f" ({cluster.prefill_nodes} prefill + {cluster.decode_nodes} decode)" if cluster.disaggregated else ""
    console.print(f"[bold]{escape(req.model.name)}[/] ({req.model.attention.value}, {layout.num_layers} layers x "
                  f"{layout.num_kv_heads} KV heads x {layout.head_dim} dims, {layout.dtype.value}): "
                  f"{layout.token_bytes:,} bytes/token, {format_size(layout.page_bytes)} per "
                  f"{layout.tokens_per_page}-token page")
    idle = f" ({dep.idle_gpus_per_node} GPU(s) idle)" if dep.idle_gpus_per_node else ""
    console.print(f"hardware [bold]{escape(req.profile.name)}[/]: {cluster.nodes} node(s){split}, "
                  f"{dep.instances_per_node} instance(s) of {dep.instance_gpus} GPU(s) per node{idle}; prefill "
                  f"{plan.prefill.tokens_s:,.0f} tokens/s per instance ({escape(plan.prefill.source)}), busy "
                  f"{plan.prefill_utilization:.1%} at the planned rate")
    distinct = int(np.count_nonzero(prof.depth == np.iinfo(np.int64).max))
    console.print(f"workload {escape(req.workload)}: {prof.requests:,} requests at "
                  f"{plan.time.request_rate_per_s:.2f}/s, mean prompt "
                  f"{float(prof.input_tokens.mean()) if prof.requests else 0.0:,.0f} tokens, {prof.blocks:,} full "
                  f"{BLOCK_TOKENS}-token blocks ({distinct:,} distinct); an unbounded cache would hit "
                  f"{plan.unbounded_hit_rate:.1%}")
    console.print()
    console.print(_tier_table(plan, Table))
    no_cache = float(np.mean(plan.prefill.recompute_s(prof.input_tokens))) if prof.requests else 0.0
    console.print(f"prefix hit rate {ev.hit_rate:.1%} (tiered {plan.policy_run.policy.value} run: "
                  f"{plan.policy_run.hit_rate:.1%}); TTFT without queueing: mean {_secs(float(ev.ttft_s.mean()))}, "
                  f"p90 {_secs(ev.ttft_percentile_s(90))} (no cache: mean {_secs(no_cache)}); recompute "
                  f"{_secs(float(plan.prefill.recompute_s(1000)))} per 1k tokens")
    for note in _notes(plan):
        console.print(f"[yellow]note:[/] {note}")
    console.print()
    console.print(_variant_table(plan, Table))
    if plan.network:
        console.print()
        console.print(_network_table(plan, Table))
    if plan.recommendation is not None:
        console.print()
        console.print(_recommendation_line(plan.recommendation))


def _notes(plan: Plan) -> list[str]:
    """Warnings worth a line: a tier slower than recompute, a tier or the prefill GPUs over capacity."""
    out = []
    context = plan.request.model.max_context_tokens
    for r in plan.tiers:
        name = r.tier.kind.value
        if r.crossover_tokens is None:
            out.append(f"{name}: loading is slower than recomputing at every prompt length up to the model's "
                       f"{context:,}-token context; its hits cost time")
        if r.peak_utilization > 1:
            out.append(f"{name}: the busiest minute needs {_bw(r.flow.peak_bytes_s)}, the tier sustains "
                       f"{_bw(r.tier.bandwidth_bytes_s)}")
    if plan.prefill_utilization > 1:
        out.append(f"prefill needs {plan.prefill_utilization:.1f}x the cluster's prefill instances at this rate "
                   "(the TTFT figures assume no queueing)")
    return out


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")


def _size(nbytes: float, spec: str = ".3g") -> str:
    """Bytes in the binary unit that keeps the number under 1000, so ``.3g`` never turns to an exponent."""
    value, unit = float(nbytes), 0
    while abs(value) >= 1000 and unit < len(_BINARY_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:.0f} B" if unit == 0 else f"{value:{spec}} {_BINARY_UNITS[unit]}"


def _count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _table(table_cls: type, title: str, columns: Sequence[str], left: int = 1) -> Table:
    t = table_cls(title=title, title_justify="left", box=None, pad_edge=False, padding=(0, 1),
                  header_style="bold underline")
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i < left else "right", no_wrap=True)
    return t


def _tier_table(plan: Plan, table_cls: type) -> Table:
    t = _table(table_cls, "tiers, cluster totals (hit = share of full blocks served from the tier)",
               ("tier", "capacity", "tokens", "hit", "load 1k", "peak need", "has", "util", "x-over"))
    for r in plan.tiers:
        tier = r.tier
        util = f"{r.peak_utilization:.1%}" + ("" if r.peak_utilization <= 1 else " [red]OVER[/]")
        t.add_row(tier.kind.value, _size(tier.capacity_bytes), _count(tier.capacity_tokens),
                  f"{r.flow.hit_rate:.1%}", _secs(float(tier.load.load_s(1000))),
                  _bw(r.flow.peak_bytes_s), _bw(tier.bandwidth_bytes_s), util,
                  "never" if r.crossover_tokens is None else f"{r.crossover_tokens:,}")
    return t


def _variant_table(plan: Plan, table_cls: type) -> Table:
    t = _table(table_cls, f"KV dtype and codec on NVMe (x-over: tokens, {'/'.join(_kinds(plan))})",
               ("variant", "B/token", "tokens", "hit", "TTFT mean", "p90", "x-over"))
    for v in plan.variants:
        cross = "/".join("never" if c is None else f"{c:,}" for c in v.crossover_tokens)
        t.add_row(v.label, f"{v.kv_bytes_per_token * v.codec_ratio:,.0f}", _count(sum(v.capacity_tokens)),
                  f"{v.hit_rate:.1%}", _secs(v.ttft_mean_s), _secs(v.ttft_p90_s), cross)
    return t


def _network_table(plan: Plan, table_cls: type) -> Table:
    t = _table(table_cls, "mean NIC load per node (storage: nvmeof tier; compute: P->D KV, DualPath hop)",
               ("scenario", "node", "NICs", "rx", "tx", "util."), left=3)
    for s in plan.network:
        name = s.name + (f" ({s.decode_share:.0%} via decode)" if s.decode_share else "")
        for n in s.loads:
            t.add_row(name, n.side, f"{n.count}x {n.nic}", _bw(n.rx_bytes_s), _bw(n.tx_bytes_s),
                      f"{n.utilization:.1%}")
            name = ""
    return t


def _recommendation_line(rec: Recommendation) -> str:
    goal = (f"hit rate >= {rec.target.hit_rate:.1%}" if rec.target.hit_rate is not None
            else f"p{rec.target.ttft_percentile:g} TTFT <= {_secs(rec.target.ttft_s or 0.0)}")
    sizes = ", ".join(f"{t.kind.value} {_size(t.capacity_bytes // t.nodes, '.1f')}"
                      + ("" if t.nodes == 1 else "/node") for t in rec.tiers if t.capacity_bytes) or "no cache"
    verdict = "cheapest configuration that meets it" if rec.met else "[red]not met[/] by any candidate; closest"
    return (f"recommendation for {goal}: {verdict}: {sizes} (cost {rec.cost:,.0f}; hit rate {rec.hit_rate:.1%}, "
            f"p{rec.target.ttft_percentile:g} TTFT {_secs(rec.ttft_s)}; {rec.evaluated:,} of {rec.candidates:,} "
            "candidates tried)")
