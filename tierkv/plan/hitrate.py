"""Prefix hit rates of a workload under LRU: the one-pass stack-distance curve and a tiered run.

THIS MODULE IS THE SEAM to the trace simulator (``tierkv.sim``), which another engineer is
writing. Until it lands, both entry points are implemented here with a minimal exact LRU:

* :func:`reuse_profile` walks the workload once and records, for every full block a
  request asks for, its LRU stack depth when the request arrived and the largest depth
  among the request's blocks up to it. :func:`hit_rate_curve` (and every per-tier figure
  of the planner) reads hit rates for any capacity off that profile.
* :func:`simulate_policy` runs a tiered cache block by block at chosen sizes (exclusive
  tiers, LRU in each, evictions demoted to the next tier, hits moved to the top).

Swap point: replace the body of :func:`simulate_policy` (and, if it offers a one-pass
curve, :func:`reuse_profile`) with calls into ``tierkv.sim``; the signatures are what the
planner depends on.

The rules (shared with ``tierkv replay``): only full blocks count; a block is a hit only if
it and every earlier block of its request were cached when the request arrived; all blocks
of a request are inserted (or refreshed) on arrival, in prompt order. Under these rules an
exclusive LRU hierarchy holds exactly the top of one LRU stack, cut at the tiers' cumulative
capacities, so the two entry points agree (a test checks it); the store's own policy, which
touches only the leading hits, will differ slightly once ``tierkv.sim`` replaces this.
Single-threaded; pure computation.
"""

from __future__ import annotations

import enum
import functools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierkv.errors import InputError
from tierkv.progress import task_progress
from tierkv.workload.trace import MOONCAKE_BLOCK_TOKENS, Request

#: Stack depth of a block never seen before.
COLD = np.iinfo(np.int64).max


class Policy(enum.Enum):
    """Eviction policies the planner can evaluate."""

    LRU = "lru"


@dataclass(frozen=True)
class ReuseProfile:
    """One entry per full block requested, in request and prompt order.

    ``depth``: the block's LRU stack depth when its request arrived (0 = most recent,
    :data:`COLD` if never seen). ``prefix_depth``: the running maximum of ``depth`` over
    the request's blocks up to this one; the block hits in an LRU cache of ``C`` blocks
    iff ``prefix_depth < C``. ``stack_size``: distinct blocks seen before the access.
    ``request``: index of the block's request; ``block``: the block as a dense index.
    Per request: ``input_tokens``, ``arrival_s``. Per distinct block: ``final_depth``,
    its stack depth after the last request.
    """

    depth: np.ndarray
    prefix_depth: np.ndarray
    stack_size: np.ndarray
    request: np.ndarray
    block: np.ndarray
    final_depth: np.ndarray
    input_tokens: np.ndarray
    arrival_s: np.ndarray
    block_tokens: int

    @property
    def blocks(self) -> int:
        return int(self.depth.size)

    @property
    def requests(self) -> int:
        return int(self.input_tokens.size)

    def hit_rate(self, capacity_blocks: int | np.ndarray) -> np.ndarray:
        """Prefix hit rate of an LRU cache of each capacity (blocks), from the sorted profile."""
        if self.blocks == 0:
            return np.zeros(np.shape(capacity_blocks))
        return np.searchsorted(self._sorted_prefix_depth, np.asarray(capacity_blocks), side="left") / self.blocks

    @functools.cached_property
    def _sorted_prefix_depth(self) -> np.ndarray:
        return np.sort(self.prefix_depth)


class _Fenwick:
    """Counts of last-access markers by time, for stack depths in O(log n)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0] * (n + 1)

    def add(self, i: int, delta: int) -> None:
        i += 1
        tree, n = self.tree, self.n
        while i <= n:
            tree[i] += delta
            i += i & -i

    def prefix(self, i: int) -> int:
        """Sum of markers at times < i."""
        total, tree = 0, self.tree
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total


def reuse_profile(requests: Sequence[Request], block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                  progress: bool = False) -> ReuseProfile:
    """Walk ``requests`` once (O(blocks log blocks)); see :class:`ReuseProfile`."""
    if block_tokens <= 0:
        raise InputError(f"block_tokens must be positive, got {block_tokens}")
    counts = [r.full_blocks(block_tokens) for r in requests]
    total = sum(counts)
    depth = np.empty(total, dtype=np.int64)
    stack = np.empty(total, dtype=np.int64)
    dense = np.empty(total, dtype=np.int64)
    fen = _Fenwick(total)
    last: dict[int, int] = {}
    ident: dict[int, int] = {}
    pos = 0
    with task_progress("plan: LRU stack distances", len(requests), enabled=progress) as advance:
        for req, n in zip(requests, counts):
            blocks = req.blocks[:n]
            live = len(last)
            for j, b in enumerate(blocks):  # depths as of arrival, before this request's own touches
                t = last.get(b)
                depth[pos + j] = COLD if t is None else live - fen.prefix(t + 1)
                stack[pos + j] = live
                dense[pos + j] = ident.setdefault(b, len(ident))
            for j, b in enumerate(blocks):
                t = last.get(b)
                if t is not None:
                    fen.add(t, -1)
                last[b] = pos + j
                fen.add(pos + j, 1)
            pos += n
            advance()
    req_index = np.repeat(np.arange(len(requests), dtype=np.int64), counts)
    last_time = np.empty(len(ident), dtype=np.int64)
    for b, i in ident.items():
        last_time[i] = last[b]
    # Depth after the end = blocks touched later; last-access times are distinct.
    final = len(ident) - 1 - np.argsort(np.argsort(last_time))
    return ReuseProfile(depth=depth, prefix_depth=_prefix_max(depth, np.asarray(counts, dtype=np.int64)),
                        stack_size=stack, request=req_index, block=dense, final_depth=final.astype(np.int64),
                        input_tokens=np.array([r.input_tokens for r in requests], dtype=np.int64),
                        arrival_s=np.array([r.arrival_s for r in requests], dtype=np.float64),
                        block_tokens=block_tokens)


def _prefix_max(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Running maximum of ``values`` restarting at each group of ``counts`` entries."""
    if values.size == 0:
        return values.copy()
    uniq, ranks = np.unique(values, return_inverse=True)
    # Lift each group above every earlier one, so one global running max restarts per group.
    lift = np.repeat(np.arange(counts.size, dtype=np.int64), counts) * uniq.size
    return uniq[np.maximum.accumulate(lift + ranks.astype(np.int64)) - lift]


def hit_rate_curve(requests: Sequence[Request], capacities_blocks: Sequence[int],
                   policy: Policy = Policy.LRU, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[float]:
    """Prefix hit rate of a single cache of each capacity (in blocks), one pass over ``requests``."""
    if policy is not Policy.LRU:
        raise InputError(f"hit_rate_curve supports the LRU policy only, got {policy}")
    if any(c < 0 for c in capacities_blocks):
        raise InputError(f"capacities must be >= 0 blocks, got {list(capacities_blocks)}")
    profile = reuse_profile(requests, block_tokens)
    return [float(x) for x in profile.hit_rate(np.asarray(capacities_blocks, dtype=np.int64))]


@dataclass(frozen=True)
class PolicyRun:
    """Result of :func:`simulate_policy`: blocks served per tier over all full blocks requested."""

    policy: Policy
    engine: str
    blocks: int
    tier_hits: tuple[int, ...]

    @property
    def tier_hit_rates(self) -> tuple[float, ...]:
        return tuple(h / self.blocks if self.blocks else 0.0 for h in self.tier_hits)

    @property
    def hit_rate(self) -> float:
        return sum(self.tier_hits) / self.blocks if self.blocks else 0.0


def simulate_policy(requests: Sequence[Request], capacities_blocks: Sequence[int], policy: Policy = Policy.LRU,
                    block_tokens: int = MOONCAKE_BLOCK_TOKENS, progress: bool = False) -> PolicyRun:
    """Run tiers of ``capacities_blocks`` (fastest first) block by block over ``requests``.

    SWAP POINT for ``tierkv.sim``: a minimal exclusive LRU hierarchy stands in for the
    store's policies until the simulator lands.
    """
    if policy is not Policy.LRU:
        raise InputError(f"simulate_policy supports the LRU policy only, got {policy}")
    if any(c < 0 for c in capacities_blocks):
        raise InputError(f"capacities must be >= 0 blocks, got {list(capacities_blocks)}")
    tiers: list[OrderedDict[int, None]] = [OrderedDict() for _ in capacities_blocks]
    caps = list(capacities_blocks)
    where: dict[int, int] = {}
    hits = [0] * len(caps)
    total = 0
    with task_progress("plan: tiered LRU run", len(requests), enabled=progress) as advance:
        for req in requests:
            blocks = req.blocks[:req.full_blocks(block_tokens)]
            total += len(blocks)
            for b in blocks:  # hits as of arrival
                t = where.get(b)
                if t is None:
                    break
                hits[t] += 1
            for b in blocks:
                _touch(b, tiers, caps, where)
            advance()
    return PolicyRun(policy, "tierkv.plan.hitrate (exclusive LRU; stand-in for tierkv.sim)", total, tuple(hits))


def _touch(block: int, tiers: list[OrderedDict[int, None]], caps: list[int], where: dict[int, int]) -> None:
    """Move ``block`` to the top of tier 0, cascading each overflow one tier down."""
    t = where.pop(block, None)
    if t is not None:
        del tiers[t][block]
    moving: int | None = block
    for i, tier in enumerate(tiers):
        if moving is None:
            return
        if caps[i] == 0:
            continue
        tier[moving] = None
        where[moving] = i
        moving = None
        if len(tier) > caps[i]:
            moving, _ = tier.popitem(last=False)
            del where[moving]
    # A block pushed out of the last tier is forgotten.
