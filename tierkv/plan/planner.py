"""``make_plan``: model + hardware profile + workload -> every figure ``tierkv plan`` reports.

Steps: the KV layout and the model's placement on a node; the workload's reuse profile
(one pass, :mod:`tierkv.plan.hitrate`); the cluster's tiers (:mod:`tierkv.plan.sizing`);
hits, bytes and TTFT at the profile's sizes (:mod:`tierkv.plan.evaluate`) and the tiered
policy run at the same sizes; the LRU curve; load-versus-recompute crossovers
(:mod:`tierkv.plan.costs`); the codec/FP8 variants; NIC loads with and without DualPath
(:mod:`tierkv.plan.network`); the recommendation (:mod:`tierkv.plan.recommend`).
Results are frozen dataclasses; :mod:`tierkv.plan.report` renders them. Called by the CLI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierkv.layout import DType, KVLayout
from tierkv.plan.costs import PrefillModel, crossover_tokens, instance_gpus, prefill_model
from tierkv.plan.evaluate import Evaluation, TierFlow, Timeline, evaluate, timeline
from tierkv.plan.hardware import HardwareProfile, TierKind
from tierkv.plan.hitrate import COLD, Policy, PolicyRun, ReuseProfile, reuse_profile, simulate_policy
from tierkv.plan.models import ModelSpec
from tierkv.plan.network import Scenario, scenarios
from tierkv.plan.recommend import Recommendation, Target, recommend
from tierkv.plan.sizing import Deployment, ResolvedTier, deployment, resolve_tiers
from tierkv.workload.trace import MOONCAKE_BLOCK_TOKENS, Request

#: Tokens per block of the workloads (Mooncake convention); the hit-rate unit.
BLOCK_TOKENS = MOONCAKE_BLOCK_TOKENS
#: The lossless codec's compressed/raw ratio measured on BF16 pages, shown when --codec-ratio is 1.
REFERENCE_CODEC_RATIO = 0.65


@dataclass(frozen=True)
class PlanRequest:
    model: ModelSpec
    profile: HardwareProfile
    kv_dtype: DType = DType.BF16
    tokens_per_page: int = 16
    codec_ratio: float = 1.0
    lossy_bits: float | None = None   # also plan lossy pages at this many bits an element (docs/lossy.md)
    prefill_tokens_s: float | None = None
    tp: int | None = None
    attention_term: bool = True
    request_rate_per_s: float | None = None
    target: Target | None = None
    workload: str = "workload"


@dataclass(frozen=True)
class TierResult:
    tier: ResolvedTier
    capacity_blocks: int
    flow: TierFlow
    cumulative_hit_rate: float
    policy_hit_rate: float
    crossover_tokens: int | None

    @property
    def utilization(self) -> float:
        return self.flow.mean_bytes_s / self.tier.bandwidth_bytes_s if self.tier.bandwidth_bytes_s else 0.0

    @property
    def peak_utilization(self) -> float:
        return self.flow.peak_bytes_s / self.tier.bandwidth_bytes_s if self.tier.bandwidth_bytes_s else 0.0


@dataclass(frozen=True)
class Variant:
    """The same plan with another KV dtype and codec ratio."""

    label: str
    kv_dtype: DType
    codec_ratio: float
    kv_bytes_per_token: int
    hit_rate: float
    ttft_mean_s: float
    ttft_p90_s: float
    capacity_tokens: tuple[int, ...]
    crossover_tokens: tuple[int | None, ...]


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    layout: KVLayout
    deployment: Deployment
    prefill: PrefillModel
    profile: ReuseProfile
    time: Timeline
    tiers: tuple[TierResult, ...]
    evaluation: Evaluation
    policy_run: PolicyRun
    curve_blocks: np.ndarray
    curve_hit_rate: np.ndarray
    unbounded_hit_rate: float
    variants: tuple[Variant, ...]
    network: tuple[Scenario, ...]
    prefill_utilization: float
    recommendation: Recommendation | None


def make_plan(req: PlanRequest, requests: Sequence[Request], progress: bool = False) -> Plan:
    model, hw = req.model, req.profile
    layout = model.layout(req.kv_dtype, req.tokens_per_page)
    tp = instance_gpus(model, hw, req.tp)
    dep = deployment(model, hw, tp)
    prefill = prefill_model(model, hw, tp, req.prefill_tokens_s, req.attention_term)
    prof = reuse_profile(requests, BLOCK_TOKENS, progress)
    time = timeline(prof, req.request_rate_per_s)
    tiers = resolve_tiers(hw, layout, dep, req.codec_ratio)
    ev = evaluate(prof, tiers, prefill, time)
    run = simulate_policy(requests, [t.capacity_blocks(BLOCK_TOKENS) for t in tiers], Policy.LRU,
                          BLOCK_TOKENS, progress)
    results, cumulative = [], 0.0
    for t, flow, policy_rate in zip(tiers, ev.flows, run.tier_hit_rates):
        cumulative += flow.hit_rate
        results.append(TierResult(t, t.capacity_blocks(BLOCK_TOKENS), flow, cumulative, policy_rate,
                                  crossover_tokens(t.load, prefill, model.max_context_tokens)))
    curve_blocks = _curve_points(prof, sum(r.capacity_blocks for r in results))
    return Plan(request=req, layout=layout, deployment=dep, prefill=prefill, profile=prof, time=time,
                tiers=tuple(results), evaluation=ev, policy_run=run, curve_blocks=curve_blocks,
                curve_hit_rate=prof.hit_rate(curve_blocks), unbounded_hit_rate=float(prof.hit_rate(prof.blocks + 1)),
                variants=_variants(req, prof, dep, prefill),
                network=_network(req, tiers, ev, prof, time, layout),
                prefill_utilization=_prefill_busy(ev, prof, prefill, time, dep, hw),
                recommendation=recommend(prof, tiers, prefill, req.target) if req.target else None)


def _curve_points(prof: ReuseProfile, configured_blocks: int) -> np.ndarray:
    """64 log-spaced capacities from 1 block to past both the workload's footprint and the tiers."""
    distinct = int(np.count_nonzero(prof.depth == COLD))
    top = max(2, configured_blocks, distinct + 1)
    return np.unique(np.geomspace(1, top, 64).astype(np.int64))


def _variants(req: PlanRequest, prof: ReuseProfile, dep: Deployment, prefill: PrefillModel) -> tuple[Variant, ...]:
    ratio = req.codec_ratio if req.codec_ratio < 1 else REFERENCE_CODEC_RATIO
    dtypes = [req.kv_dtype] + ([DType.FP8_E4M3] if req.kv_dtype.itemsize > 1 else [])
    out = []
    runs = [(dtype, r, dtype.value + ("" if r == 1.0 else f"+codec {r:g}")) for dtype in dtypes for r in (1.0, ratio)]
    if req.lossy_bits is not None and req.kv_dtype.itemsize > 1:
        # Lossy pages (docs/lossy.md): a blob of the budget's bits an element, headers and
        # parameters included, stored whole on the tiers that code pages.
        runs.append((req.kv_dtype, req.lossy_bits / (8 * req.kv_dtype.itemsize),
                     f"{req.kv_dtype.value}+lossy {req.lossy_bits:g} bits"))
    for dtype, r, label in runs:
        layout = req.model.layout(dtype, req.tokens_per_page)
        tiers = resolve_tiers(req.profile, layout, dep, r)
        ev = evaluate(prof, tiers, prefill)
        out.append(Variant(label, dtype, r, layout.token_bytes, ev.hit_rate,
                           float(ev.ttft_s.mean()) if ev.ttft_s.size else 0.0, ev.ttft_percentile_s(90),
                           tuple(t.capacity_tokens for t in tiers),
                           tuple(crossover_tokens(t.load, prefill, req.model.max_context_tokens) for t in tiers)))
    return tuple(out)


def _network(req: PlanRequest, tiers: tuple[ResolvedTier, ...], ev: Evaluation, prof: ReuseProfile,
             time: Timeline, layout: KVLayout) -> tuple[Scenario, ...]:
    if not req.profile.cluster.disaggregated and not any(t.kind is TierKind.NVMEOF for t in tiers):
        return ()  # no storage network and no P->D transfers: nothing crosses a NIC
    read = write = 0.0
    share, cluster = 1.0, req.profile.cluster
    for above, t, flow in zip((None,) + tiers, tiers, ev.flows):
        if t.kind is TierKind.NVMEOF:
            read, write = flow.read_bytes / time.duration_s, flow.write_bytes / time.duration_s
            if above is not None and above.kind is not TierKind.HBM:  # demotions leave from every node
                share = cluster.prefill_nodes / cluster.nodes
    pd = 0.0
    if cluster.disaggregated:  # every prompt's KV crosses from its prefill to its decode node
        pd = float(prof.input_tokens.sum()) * layout.token_bytes / time.duration_s
    return scenarios(cluster, req.profile.nics, read, write, pd, share)


def _prefill_busy(ev: Evaluation, prof: ReuseProfile, prefill: PrefillModel, time: Timeline, dep: Deployment,
                  hw: HardwareProfile) -> float:
    """Share of the prefill instances' time the uncached tokens take at the planned rate."""
    cached = ev.tier_blocks.sum(axis=1) * prof.block_tokens
    busy_s = float(np.sum(prefill.recompute_s(prof.input_tokens, cached)))
    return busy_s / time.duration_s / (dep.instances_per_node * hw.cluster.prefill_nodes)
