"""One cache configuration over a workload's reuse profile: hits, TTFT and bytes per tier.

Tier ``k`` of an exclusive LRU hierarchy holds the blocks at stack depths
``[B[k-1], B[k])`` (:func:`tierkv.plan.sizing.boundaries`). A full block is served from
the tier its own depth falls in when its prefix depth is below ``B[-1]``; otherwise it is
recomputed. Bytes a tier moves, over the whole workload:

* reads: blocks it serves x block bytes at rest;
* writes: blocks that enter it. Into the top tier: every access not already there
  (computed or loaded). Into tier ``k > 0``: a block demoted across ``B[k-1]`` is written
  unless the tier still holds its copy: lower tiers keep their copy when a block is
  promoted (as tierkv's store does), and lose it when the block falls past ``B[k]``
  (:func:`demotion_writes`). The writes are spread over time like the demotions, which
  happen at the accesses that push a block across ``B[k-1]``.

TTFT per request, without queueing: per-tier latency (once per tier it loads from) +
bytes / request bandwidth, tier after tier, + the prefill of the uncached rest.
Called by :mod:`tierkv.plan.planner` and :mod:`tierkv.plan.recommend`; pure numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tierkv.errors import InputError
from tierkv.plan.costs import PrefillModel
from tierkv.plan.hitrate import COLD, ReuseProfile
from tierkv.plan.sizing import ResolvedTier, boundaries

#: Window for peak bandwidth, seconds.
PEAK_WINDOW_S = 60.0


@dataclass(frozen=True)
class Timeline:
    """The workload's time base at the planned rate: ``duration_s`` and, per request, the index of its
    ``PEAK_WINDOW_S`` window among the ``windows`` that have arrivals (empty ones move no bytes)."""

    duration_s: float
    request_rate_per_s: float
    natural_rate_per_s: float | None
    window: np.ndarray
    windows: int


def timeline(profile: ReuseProfile, request_rate_per_s: float | None = None) -> Timeline:
    """The workload's time base, its arrivals rescaled to ``request_rate_per_s`` when given."""
    n = profile.requests
    if n == 0:
        raise InputError("the workload has no requests")
    span = float(profile.arrival_s.max() - profile.arrival_s.min())
    natural = n / span if span > 0 else None
    rate = request_rate_per_s if request_rate_per_s is not None else natural
    if rate is None:
        raise InputError(f"the workload's {n} request(s) all arrive at once; pass --request-rate")
    duration = n / rate if rate > 0 else math.inf
    if not 0 < duration < math.inf:
        raise InputError(f"--request-rate must be a finite number > 0 that leaves the workload a finite, "
                         f"non-zero duration, got {rate}")
    scale = duration / span if span > 0 else 0.0
    real = (profile.arrival_s - profile.arrival_s.min()) * scale
    # A last, partial window's bytes are divided by the full window too: it can only under-report.
    # Dense numbering: a slow rate's long timeline costs no memory and cannot overflow int64.
    _, window = np.unique(np.floor(real / PEAK_WINDOW_S), return_inverse=True)
    window = window.reshape(-1).astype(np.int64)
    return Timeline(duration, rate, natural, window, int(window.max()) + 1)


@dataclass(frozen=True)
class TierFlow:
    """What one tier does over the workload."""

    served_blocks: int
    hit_rate: float
    read_bytes: float
    write_bytes: float
    mean_bytes_s: float
    peak_bytes_s: float


@dataclass(frozen=True)
class Evaluation:
    hit_rate: float
    flows: tuple[TierFlow, ...]
    tier_blocks: np.ndarray       # [requests, tiers] blocks served per request and tier
    ttft_s: np.ndarray            # per request

    def ttft_percentile_s(self, q: float) -> float:
        return float(np.percentile(self.ttft_s, q)) if self.ttft_s.size else 0.0


def tier_blocks(profile: ReuseProfile, bounds: np.ndarray) -> np.ndarray:
    """Blocks each request gets from each tier: ``[requests, tiers]``."""
    k = bounds.size
    if k == 0 or profile.blocks == 0:
        return np.zeros((profile.requests, k), dtype=np.int64)
    tier = np.searchsorted(bounds, profile.depth, side="right")
    served = profile.prefix_depth < bounds[-1]
    flat = profile.request[served] * k + tier[served]
    return np.bincount(flat, minlength=profile.requests * k).reshape(profile.requests, k)


def ttft(profile: ReuseProfile, tiers: tuple[ResolvedTier, ...], blocks: np.ndarray,
         prefill: PrefillModel) -> np.ndarray:
    """Seconds to first token per request (see module docstring)."""
    loaded = blocks * profile.block_tokens
    total = prefill.recompute_s(profile.input_tokens, loaded.sum(axis=1))
    for k, t in enumerate(tiers):
        total = total + t.load.load_s(loaded[:, k])
    return np.asarray(total)


def evaluate(profile: ReuseProfile, tiers: tuple[ResolvedTier, ...], prefill: PrefillModel,
             time: Timeline | None = None) -> Evaluation:
    """Hits, per-tier bytes and per-request TTFT of ``tiers`` over ``profile``."""
    bounds = boundaries(tiers, profile.block_tokens)
    blocks = tier_blocks(profile, bounds)
    n = profile.blocks
    flows = []
    if time is not None:
        access_window = time.window[profile.request]
    for k, t in enumerate(tiers):
        block_bytes = t.bytes_per_token * profile.block_tokens
        served = int(blocks[:, k].sum())
        if k == 0:
            entering = profile.depth >= bounds[0]
            writes = int(entering.sum())
        else:
            entering = (profile.depth >= bounds[k - 1]) & (profile.stack_size >= bounds[k - 1])
            writes = demotion_writes(profile, int(bounds[k - 1]), int(bounds[k]))
        mean = peak = 0.0
        if time is not None:
            pushes = np.bincount(access_window[entering], minlength=time.windows).astype(np.float64)
            per_window = np.bincount(time.window, weights=blocks[:, k], minlength=time.windows) \
                + (pushes * (writes / pushes.sum()) if pushes.sum() else 0.0)
            mean = float(per_window.sum()) * block_bytes / time.duration_s
            peak = max(mean, float(per_window.max()) * block_bytes / PEAK_WINDOW_S) \
                if time.duration_s >= PEAK_WINDOW_S else mean
        flows.append(TierFlow(served, served / n if n else 0.0, served * block_bytes, writes * block_bytes, mean, peak))
    hit = float(blocks.sum()) / n if n else 0.0
    return Evaluation(hit, tuple(flows), blocks, ttft(profile, tiers, blocks, prefill))


def demotion_writes(profile: ReuseProfile, lo: int, hi: int) -> int:
    """Blocks written into the tier holding stack depths ``[lo, hi)`` over the workload.

    Between two accesses a block's depth only grows, so it was demoted across ``lo`` iff
    its depth at the next access (or after the last request) is ``>= lo``. Such a
    demotion is a write unless the tier kept the block's copy: it has one after a
    demotion that stopped inside ``[lo, hi)``, loses it when the block falls to ``hi`` or
    deeper, and keeps it while the block lives above ``lo``.
    """
    if hi <= lo or profile.blocks == 0:
        return 0
    warm = profile.depth != COLD
    distinct = profile.final_depth.size
    block = np.concatenate([profile.block[warm], np.arange(distinct, dtype=np.int64)])
    depth = np.concatenate([profile.depth[warm], profile.final_depth])
    when = np.concatenate([np.flatnonzero(warm), np.full(distinct, profile.blocks, dtype=np.int64)])
    order = np.lexsort((when, block))
    block, depth = block[order], depth[order]
    demoted = depth >= lo
    state = np.where(depth >= hi, 0, np.where(demoted, 1, -1))  # copy after the event; -1 = unchanged
    pos = np.arange(block.size, dtype=np.int64)
    first = np.maximum.accumulate(np.where(np.r_[True, block[1:] != block[:-1]], pos, 0))
    last_set = np.maximum.accumulate(np.where(state >= 0, pos, -1))
    before = np.r_[-1, last_set[:-1]]
    had_copy = (before >= first) & (state[np.maximum(before, 0)] == 1)
    return int(np.count_nonzero(demoted & ~had_copy))
