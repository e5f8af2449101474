"""The LRU prefix-hit model: a hand-computed trace, a naive simulator, the tiered run, demotion writes."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.plan.evaluate import demotion_writes
from tierkv.plan.hitrate import COLD, hit_rate_curve, reuse_profile, simulate_policy
from tierkv.workload import Request, synthetic

BT = 512


def _reqs(*prompts: list[int]) -> list[Request]:
    return [Request(float(i), tuple(p), len(p) * BT, 1) for i, p in enumerate(prompts)]


def test_hand_computed_curve() -> None:
    # After R1 the stack is 3,2,1. R2 sees 1 at depth 2 and 2 at depth 1, 4 cold. R3 adds 5.
    # R4 sees 1 at depth 3 (5,4,2 above it), 2 at 2, 3 at 4: prefix depths 3,3,4.
    reqs = _reqs([1, 2, 3], [1, 2, 4], [5], [1, 2, 3])
    prof = reuse_profile(reqs)
    assert prof.depth.tolist() == [COLD] * 3 + [2, 1, COLD, COLD, 3, 2, 4]
    assert prof.prefix_depth.tolist() == [COLD] * 3 + [2, 2, COLD, COLD, 3, 3, 4]
    assert hit_rate_curve(reqs, [0, 2, 3, 4, 5, 100]) == [0.0, 0.0, 0.2, 0.4, 0.5, 0.5]
    assert prof.final_depth.tolist() == [2, 1, 0, 4, 3]  # blocks 1, 2, 3, 4, 5 after R4


def test_partial_last_block_is_not_counted() -> None:
    reqs = [Request(0.0, (7, 8), BT + 10, 1), Request(1.0, (7, 9), BT + 20, 1)]
    assert reuse_profile(reqs).blocks == 2 and hit_rate_curve(reqs, [1]) == [0.5]


def _naive_lru(reqs: list[Request], capacity: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for r in reqs:
        blocks = r.blocks[:r.full_blocks(BT)]
        total += len(blocks)
        for b in blocks:
            if b not in cache:
                break
            hits += 1
        for b in blocks:
            cache.pop(b, None)
            cache[b] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / total if total else 0.0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=0, max_size=6), min_size=1, max_size=25),
       st.integers(0, 15))
def test_curve_matches_naive_lru(prompts: list[list[int]], capacity: int) -> None:
    reqs = _reqs(*prompts)
    assert hit_rate_curve(reqs, [capacity])[0] == pytest.approx(_naive_lru(reqs, capacity))


@pytest.mark.parametrize("caps", [[50, 200, 1000], [0, 300, 0], [10, 0, 5000], [100000]])
def test_tiered_run_equals_stack_cut(caps: list[int]) -> None:
    reqs = synthetic(3, 400)
    prof = reuse_profile(reqs)
    run = simulate_policy(reqs, caps)
    bounds = np.cumsum(caps)
    served = prof.prefix_depth < bounds[-1]
    tier = np.searchsorted(bounds, prof.depth, side="right")
    assert run.blocks == prof.blocks
    assert list(run.tier_hits) == [int(np.sum(served & (tier == k))) for k in range(len(caps))]
    assert run.hit_rate == pytest.approx(float(prof.hit_rate(int(bounds[-1]))))


def test_demotion_writes() -> None:
    # One block per request: depths as of arrival are exact, so crossings equal pushes.
    reqs = _reqs(*[[b] for b in [1, 2, 3, 1, 4, 5, 6, 2, 1, 7]])
    prof = reuse_profile(reqs)
    distinct = 7
    assert demotion_writes(prof, 0, 10**9) == distinct  # a tier below everything writes each block once
    pushes = int(np.sum((prof.depth >= 2) & (prof.stack_size >= 2)))
    crossings = int(np.sum((prof.depth >= 2) & (prof.depth != COLD)) + np.sum(prof.final_depth >= 2))
    assert pushes == crossings == 8
    # Tier [2, 3), by hand. Block 1: demoted into it before t3 (write; t3 promotes it, the copy
    # stays), demoted again before t8 (copy there: no write) and past 3 (copy lost). Block 2:
    # demoted past 3 before t7 (write, copy lost), demoted to depth 2 by the end (write). Blocks
    # 3, 4, 5, 6 end at depths 6, 5, 4, 3: one write each. Block 7 ends on top.
    assert demotion_writes(prof, 2, 3) == 7
    assert demotion_writes(prof, 2, 2) == 0
