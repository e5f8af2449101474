"""The recommendation is the cheapest candidate meeting the target, checked by brute force."""

from __future__ import annotations

import pytest

from tierkv.errors import InputError
from tierkv.plan.costs import PrefillModel
from tierkv.plan.evaluate import evaluate
from tierkv.plan.hardware import TierKind
from tierkv.plan.hitrate import reuse_profile, simulate_policy
from tierkv.plan.recommend import Target, candidates, recommend
from tierkv.plan.sizing import ResolvedTier
from tierkv.workload import synthetic

BT = 512
TOKEN_BYTES = 1000.0
BLOCK = BT * TOKEN_BYTES
REQS = synthetic(5, 500)
PROFILE = reuse_profile(REQS)
PREFILL = PrefillModel(tokens_s=5e4, flops_s=5e4 * 2e9, attention_flops_coeff=1e5, source="test")
FRACTIONS = (0.0, 0.125, 0.25, 0.5, 1.0)


def _tier(kind: TierKind, blocks: int, cost: float, bw: float, latency: float) -> ResolvedTier:
    return ResolvedTier(kind, int(blocks * BLOCK), TOKEN_BYTES, bw, bw, latency, cost, 1)


TIERS = (_tier(TierKind.DRAM, 800, 4.0, 2e10, 1e-5), _tier(TierKind.NVME, 4000, 0.1, 2e8, 1e-4))


def test_hit_rate_target_matches_brute_force_with_the_tiered_run() -> None:
    target = Target(hit_rate=0.5)
    rec = recommend(PROFILE, TIERS, PREFILL, target, FRACTIONS)
    meeting = [c for c in candidates(TIERS, FRACTIONS)
               if simulate_policy(REQS, [t.capacity_blocks(BT) for t in c]).hit_rate >= 0.5]
    cheapest = min(sum(t.cost for t in c) for c in meeting)
    assert rec.met and rec.cost == pytest.approx(cheapest) and rec.hit_rate >= 0.5
    assert rec.candidates == len(FRACTIONS) ** 2


def test_ttft_target_matches_brute_force() -> None:
    no_cache = evaluate(PROFILE, tuple(t.resized(0) for t in TIERS), PREFILL).ttft_percentile_s(90)
    target = Target(ttft_s=0.7 * no_cache, ttft_percentile=90)
    rec = recommend(PROFILE, TIERS, PREFILL, target, FRACTIONS)
    meeting = [c for c in candidates(TIERS, FRACTIONS)
               if evaluate(PROFILE, c, PREFILL).ttft_percentile_s(90) <= target.ttft_s]  # type: ignore[operator]
    assert rec.met and rec.cost == pytest.approx(min(sum(t.cost for t in c) for c in meeting))
    assert rec.ttft_s <= 0.7 * no_cache


def test_unreachable_target_reports_the_closest() -> None:
    rec = recommend(PROFILE, TIERS, PREFILL, Target(hit_rate=0.999), FRACTIONS)
    assert not rec.met and rec.hit_rate == pytest.approx(float(PROFILE.hit_rate(4800)))
    assert rec.evaluated == rec.candidates


def test_a_zero_target_needs_no_cache() -> None:
    rec = recommend(PROFILE, TIERS, PREFILL, Target(ttft_s=1e9), FRACTIONS)
    assert rec.met and rec.cost == 0 and all(t.capacity_bytes == 0 for t in rec.tiers) and rec.evaluated == 1


def test_hbm_is_not_a_knob() -> None:
    hbm = _tier(TierKind.HBM, 100, 20.0, 1e12, 0.0)
    combos = candidates((hbm, *TIERS), FRACTIONS)
    assert len(combos) == len(FRACTIONS) ** 2 and all(c[0] == hbm for c in combos)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"), ({"hit_rate": 0.5, "ttft_s": 1.0}, "exactly one"),
    ({"hit_rate": 1.5}, "in \\(0, 1\\]"), ({"ttft_s": -1.0}, "> 0"),
    ({"ttft_s": 1.0, "ttft_percentile": 0.0}, "percentile")])
def test_bad_targets(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(InputError, match=message):
        Target(**kwargs)
