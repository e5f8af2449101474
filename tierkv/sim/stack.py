"""LRU's hit rate at every capacity in one pass, from stack distances (Mattson et al., 1970).

Under LRU a page is cached at capacity ``C`` exactly when fewer than ``C`` other
distinct pages were used since its last use (its *stack distance*), so one pass over
the trace gives every capacity at once. This is *plain* LRU: every page of a request
is used, in order, whether or not an earlier one missed. A request's block counts as
a hit only if it and every earlier block are cached, i.e. if the running maximum of
the stack distances along the request is below ``C``. Distances come from a Fenwick
tree over use times: O(log n) per page.

The store's LRU differs in two corners: a page cached beyond a request's first miss
is not touched by that request, and a page whose parent left every tier is dropped
with it (no lookup could reach it). ``docs/policies.md`` shows the two agree to 0.1%.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

from tierkv.keys import PageKey
from tierkv.sim.run import LRU_STACK, SimResult, Workload
from tierkv.sim.tiers import TIER_NAMES

_NEVER = 1 << 62


def prefix_stack_distances(requests: Sequence[Sequence[PageKey]]) -> list[int]:
    """For every page of every request, in order: the running max of stack distances so far.

    A page never seen before has an infinite distance (``1 << 62``).
    """
    size = sum(len(keys) for keys in requests) + 1
    tree = [0] * (size + 1)
    last: dict[PageKey, int] = {}
    out: list[int] = []
    now = 0
    for keys in requests:
        running = 0
        for k in keys:
            now += 1
            prev = last.get(k)
            if prev is None:
                dist = _NEVER
            else:
                # Distinct pages used in (prev, now): latest-use marks after prev.
                dist = 0
                i = now - 1
                while i > 0:
                    dist += tree[i]
                    i -= i & -i
                i = prev
                while i > 0:
                    dist -= tree[i]
                    i -= i & -i
                i = prev
                while i <= size:
                    tree[i] -= 1
                    i += i & -i
            i = now
            while i <= size:
                tree[i] += 1
                i += i & -i
            last[k] = now
            running = max(running, dist)
            out.append(running)
    return out


def lru_curve(requests: Sequence[Sequence[PageKey]], capacities: Sequence[int]) -> list[int]:
    """Blocks hit by plain LRU at each capacity (in pages), from one pass over ``requests``."""
    dists = sorted(prefix_stack_distances(requests))
    return [bisect.bisect_left(dists, c) for c in capacities]


def lru_curve_results(workload: Workload, capacities: Sequence[int]) -> list[SimResult]:
    """:func:`lru_curve` as simulator results (policy ``"lru-stack"``), one per capacity."""
    start = time.perf_counter()
    hits = lru_curve(workload.keys, capacities)
    wall = (time.perf_counter() - start) / max(len(capacities), 1)
    total = max(workload.total_blocks, 1)
    return [SimResult(LRU_STACK, c, c / max(workload.distinct_blocks, 1), (c,), h / total, workload.total_blocks, h,
                      {TIER_NAMES[0]: h / total}, len(workload.keys), 0, wall) for c, h in zip(capacities, hits)]
