"""The cheapest tier sizes that meet a target hit rate or time-to-first-token.

Candidates are every combination of fractions (:data:`FRACTIONS`) of each tier's
capacity in the profile, which is the most the hardware holds; HBM stays at what the
GPUs leave for cached prefixes (it comes with the GPUs, it is not bought). Their cost is
``sum(capacity GiB x cost_per_gib)`` (the profile's relative prices); they are tried
cheapest first (fewer bytes break ties) and the first that meets the target wins, so
the answer is the cheapest candidate that meets it. A hit-rate target depends only on
the total capacity in blocks and is read off the LRU curve for all candidates at once;
a TTFT target (a percentile over the workload's requests, no queueing) is evaluated per
candidate. Called by :mod:`tierkv.plan.planner`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from tierkv.errors import InputError
from tierkv.plan.costs import PrefillModel
from tierkv.plan.evaluate import tier_blocks, ttft
from tierkv.plan.hardware import TierKind
from tierkv.plan.hitrate import ReuseProfile
from tierkv.plan.sizing import ResolvedTier, boundaries

#: Shares of each tier's profile capacity that the search tries.
FRACTIONS = (0.0, 1 / 64, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)


@dataclass(frozen=True)
class Target:
    """Exactly one of ``hit_rate`` (fraction of full blocks) or ``ttft_s`` (at ``ttft_percentile``)."""

    hit_rate: float | None = None
    ttft_s: float | None = None
    ttft_percentile: float = 90.0

    def __post_init__(self) -> None:
        if (self.hit_rate is None) == (self.ttft_s is None):
            raise InputError("give exactly one target: a hit rate or a time to first token")
        if self.hit_rate is not None and not 0 < self.hit_rate <= 1:
            raise InputError(f"--target-hit-rate must be in (0, 1], got {self.hit_rate}")
        if self.ttft_s is not None and not self.ttft_s > 0:
            raise InputError(f"--target-ttft-s must be > 0, got {self.ttft_s}")
        if not 0 < self.ttft_percentile <= 100:
            raise InputError(f"--ttft-percentile must be in (0, 100], got {self.ttft_percentile}")


@dataclass(frozen=True)
class Recommendation:
    target: Target
    met: bool
    tiers: tuple[ResolvedTier, ...]   # the chosen sizes; a tier of 0 bytes is not needed
    cost: float
    hit_rate: float
    ttft_s: float                     # at the target's percentile
    evaluated: int
    candidates: int


def candidates(tiers: tuple[ResolvedTier, ...],
               fractions: tuple[float, ...] = FRACTIONS) -> list[tuple[ResolvedTier, ...]]:
    """Every combination of ``fractions`` of each tier but HBM, cheapest first, then fewest bytes."""
    choices = [[t] if t.kind is TierKind.HBM else [t.resized(int(t.capacity_bytes * f)) for f in fractions]
               for t in tiers]
    combos = list(itertools.product(*choices))
    combos.sort(key=lambda c: (sum(t.cost for t in c), sum(t.capacity_bytes for t in c)))
    return combos


def recommend(profile: ReuseProfile, tiers: tuple[ResolvedTier, ...], prefill: PrefillModel, target: Target,
              fractions: tuple[float, ...] = FRACTIONS) -> Recommendation:
    """The cheapest candidate meeting ``target``; if none does, the one that comes closest (``met`` False)."""
    combos = candidates(tiers, fractions)
    if target.hit_rate is not None:
        totals = np.array([boundaries(c, profile.block_tokens)[-1] if c else 0 for c in combos], dtype=np.int64)
        rates = profile.hit_rate(totals)
        ok = np.nonzero(rates >= target.hit_rate - 1e-12)[0]
        i = int(ok[0]) if ok.size else int(np.argmax(rates))
        return _result(profile, combos[i], prefill, target, ok.size > 0, i + 1 if ok.size else len(combos),
                       len(combos))
    assert target.ttft_s is not None
    best, best_s = 0, np.inf
    for i, combo in enumerate(combos):
        blocks = tier_blocks(profile, boundaries(combo, profile.block_tokens))
        value = float(np.percentile(ttft(profile, combo, blocks, prefill), target.ttft_percentile))
        if value <= target.ttft_s:
            return _result(profile, combo, prefill, target, True, i + 1, len(combos))
        if value < best_s:
            best, best_s = i, value
    return _result(profile, combos[best], prefill, target, False, len(combos), len(combos))


def _result(profile: ReuseProfile, combo: tuple[ResolvedTier, ...], prefill: PrefillModel, target: Target,
            met: bool, evaluated: int, total: int) -> Recommendation:
    blocks = tier_blocks(profile, boundaries(combo, profile.block_tokens))
    times = ttft(profile, combo, blocks, prefill)
    hit = float(blocks.sum()) / profile.blocks if profile.blocks else 0.0
    return Recommendation(target, met, combo, sum(t.cost for t in combo), hit,
                          float(np.percentile(times, target.ttft_percentile)) if times.size else 0.0,
                          evaluated, total)
