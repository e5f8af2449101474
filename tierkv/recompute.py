"""Load or recompute: the one model of what a cached prefix saves, for the planner and the policies.

Recompute (prefill) of tokens ``h..n`` of a prompt, on one model instance::

    recompute_s(n, h) = (n - h) / tokens_s  +  c_attn * (n**2 - h**2) / flops_s

The first term is the weights' work at the instance's prefill rate; the second is causal
attention, ``c_attn x n**2`` FLOPs for ``n`` tokens (``n**2 / 2`` query-key pairs at
``2 x c_attn`` each; the mask's diagonal is left out), at the instance's FLOP rate.
Loading saves exactly ``recompute_s(h, 0)``: the suffix attends to the prefix either way.

Load of ``n`` tokens from a tier: ``latency_s + n x bytes_per_token / bandwidth`` (zero
for ``n = 0``), with ``bytes_per_token`` as the tier stores them (after any codec).

Two views of the same two models:

* :func:`crossover_tokens`: the shortest prompt whose load beats its recompute
  (``tierkv plan``'s crossover per tier);
* :class:`CostModel`: the same per page of one tier, the view a policy weighs. Page
  ``d`` of a prompt (0-based) costs tokens ``d*p..(d+1)*p`` to recompute, so deeper
  pages are dearer, and ``p`` tokens to load; a page whose load is slower than its
  recompute is not worth keeping in that tier.

:mod:`tierkv.plan.costs` fills :class:`PrefillModel` from a model and a hardware profile
and :class:`LoadModel` per tier (:mod:`tierkv.plan.sizing`); :mod:`tierkv.policy.gittins`
takes a :class:`CostModel` built from the two. Pure computation (numpy), no I/O,
thread-safe (the models are frozen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tierkv.errors import InputError


@dataclass(frozen=True)
class PrefillModel:
    """Prefill speed of one model instance: ``tokens_s`` for the weights' work, ``flops_s``
    for attention's, ``attention_flops_coeff`` (``c_attn``) 0 drops the quadratic term.
    ``source`` says where ``tokens_s`` came from (reports print it)."""

    tokens_s: float
    flops_s: float
    attention_flops_coeff: float
    source: str = ""

    def __post_init__(self) -> None:
        if not self.tokens_s > 0 or not self.flops_s > 0:
            raise InputError(f"prefill rates must be > 0, got {self.tokens_s} tokens/s and {self.flops_s} FLOP/s")

    def recompute_s(self, n_tokens: float | np.ndarray, cached_tokens: float | np.ndarray = 0) -> np.ndarray:
        """Seconds to prefill tokens ``cached_tokens..n_tokens`` (elementwise on arrays)."""
        n = np.asarray(n_tokens, dtype=np.float64)
        h = np.asarray(cached_tokens, dtype=np.float64)
        return (n - h) / self.tokens_s + self.attention_flops_coeff * (n * n - h * h) / self.flops_s


@dataclass(frozen=True)
class LoadModel:
    """Loading from one tier into HBM for one request: ``latency_s`` once, then
    ``bytes_per_token`` (as stored) at ``bandwidth_bytes_s``."""

    latency_s: float
    bytes_per_token: float
    bandwidth_bytes_s: float

    def __post_init__(self) -> None:
        if not self.latency_s >= 0 or not self.bytes_per_token > 0 or not self.bandwidth_bytes_s > 0:
            raise InputError(f"a tier's load needs latency_s >= 0, bytes_per_token > 0 and bandwidth_bytes_s > 0, "
                             f"got {self.latency_s}, {self.bytes_per_token}, {self.bandwidth_bytes_s}")

    def load_s(self, n_tokens: float | np.ndarray) -> np.ndarray:
        """Seconds to load ``n_tokens`` (elementwise on arrays; 0 for none)."""
        n = np.asarray(n_tokens, dtype=np.float64)
        return np.where(n > 0, self.latency_s + n * self.bytes_per_token / self.bandwidth_bytes_s, 0.0)

    @property
    def s_per_token(self) -> float:
        return self.bytes_per_token / self.bandwidth_bytes_s


def crossover_tokens(load: LoadModel, prefill: PrefillModel, max_tokens: int) -> int | None:
    """Smallest prompt length ``n >= 1`` with load(n) < recompute(n); None if none is <= ``max_tokens``.

    Solves ``d n**2 + (c - b) n - a > 0`` with ``a`` the latency, ``b`` load s/token,
    ``c`` recompute s/token and ``d`` the attention term's s/token**2.
    """
    a, b = load.latency_s, load.s_per_token
    c, d = 1.0 / prefill.tokens_s, prefill.attention_flops_coeff / prefill.flops_s
    if not math.isfinite(a + b):
        return None  # a load that never ends never wins
    if d == 0:
        if c <= b:
            return None
        root = a / (c - b)
    else:
        # hypot and the two forms of the root avoid overflow and cancellation at extreme rates.
        disc = math.hypot(c - b, 2 * math.sqrt(d * a))
        root = 2 * a / ((c - b) + disc) if c > b else (disc - (c - b)) / (2 * d)
    if math.isnan(root):
        return None
    # Past max_tokens the answer is None; clipping keeps huge roots from overflowing or stepping forever.
    n = max(1, math.floor(min(root, max_tokens)) + 1)
    # Float rounding near the root: step to the exact smallest integer.
    while n > 1 and _wins(load, prefill, n - 1):
        n -= 1
    while not _wins(load, prefill, n) and n <= max_tokens:
        n += 1
    return n if n <= max_tokens else None


def _wins(load: LoadModel, prefill: PrefillModel, n: int) -> bool:
    return bool(load.load_s(n) < prefill.recompute_s(n))


@dataclass(frozen=True)
class CostModel:
    """Recompute and load times of one page of ``tokens_per_page`` tokens in one tier, in seconds.

    All pages are the same size, so seconds per page rank exactly as seconds per byte.
    """

    tokens_per_page: int
    prefill: PrefillModel
    load: LoadModel

    def __post_init__(self) -> None:
        if self.tokens_per_page < 1:
            raise InputError(f"CostModel needs tokens_per_page >= 1, got {self.tokens_per_page}")

    def recompute_s(self, depth: int) -> float:
        """Seconds to prefill page ``depth`` (0-based) given every earlier page."""
        p = self.tokens_per_page
        return float(self.prefill.recompute_s((depth + 1) * p, depth * p))

    def load_s(self) -> float:
        """Seconds to load one page from the tier."""
        return float(self.load.load_s(self.tokens_per_page))

    def saved_s(self, depth: int) -> float:
        """What a hit on page ``depth`` saves; <= 0 means recomputing it is no slower."""
        return self.recompute_s(depth) - self.load_s()
