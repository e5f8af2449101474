"""Time to recompute a prefix against time to load it from a tier, and where they cross.

Recompute (prefill) of ``n`` tokens after ``h`` cached ones, on one model instance::

    recompute_s(n, h) = (n - h) / tokens_s  +  c_attn * (n**2 - h**2) / flops_s

The first term is the weights' work at the instance's prefill rate; the second is causal
attention, ``c_attn = layers x query heads x (d_qk + d_v)`` FLOPs per token pair
(:attr:`tierkv.plan.models.ModelSpec.attention_flops_coeff`), at the FLOP rate that
the first term implies (``flops_s = tokens_s x 2 x active parameters``). Loading saves
exactly ``recompute_s(h, 0)``: the suffix attends to the prefix either way.

Load of ``n`` tokens from a tier: ``latency_s + n x bytes_per_token / bandwidth`` (zero for
``n = 0``), with ``bytes_per_token`` after the codec. The crossover is the smallest ``n``
with load < recompute. Called by :mod:`tierkv.plan.planner`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tierkv.errors import ConfigError, InputError
from tierkv.plan.hardware import HardwareProfile
from tierkv.plan.models import ModelSpec

#: Prefill tokens/s of one instance the planner accepts, from any source (flag, profile, derived):
#: outside it recompute times overflow or mean nothing.
PREFILL_TOKENS_S_RANGE = (1.0, 1e9)


@dataclass(frozen=True)
class PrefillModel:
    """Prefill speed of one model instance. ``attention_flops_coeff`` 0 drops the quadratic term."""

    tokens_s: float
    flops_s: float
    attention_flops_coeff: float
    source: str

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
    """Loading from one tier into HBM for one request."""

    latency_s: float
    bytes_per_token: float
    bandwidth_bytes_s: float

    def load_s(self, n_tokens: float | np.ndarray) -> np.ndarray:
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


def instance_gpus(model: ModelSpec, profile: HardwareProfile, tp: int | None = None) -> int:
    """GPUs per model instance: ``tp`` if given, else the smallest power of two whose usable HBM
    holds the weights with at least 10% to spare for KV, else (a node whose GPU count is not a
    power of two) all the node's GPUs if they do. ConfigError when the node cannot."""
    gpu = profile.gpu
    usable = gpu.hbm_bytes * gpu.memory_utilization
    if tp is not None:
        if tp < 1 or tp > gpu.count:
            raise InputError(f"--tp must be in [1, {gpu.count}] (GPUs per node of {profile.name!r}), got {tp}")
        if model.weight_bytes >= tp * usable:
            raise ConfigError(f"{model.name}: {model.weight_bytes / 2**30:.1f} GiB of weights do not fit in "
                              f"{tp} GPU(s) x {usable / 2**30:.1f} GiB of usable HBM")
        return tp
    powers = [2**k for k in range(gpu.count.bit_length()) if 2**k <= gpu.count]
    for n in powers + ([gpu.count] if gpu.count not in powers else []):
        if model.weight_bytes <= 0.9 * n * usable:
            return n
    raise ConfigError(f"{model.name}: {model.weight_bytes / 2**30:.1f} GiB of weights do not fit in one node of "
                      f"{profile.name!r} with 10% left for KV ({gpu.count} GPUs x {usable / 2**30:.1f} GiB usable "
                      "HBM); --tp N forces a size")


def prefill_model(model: ModelSpec, profile: HardwareProfile, tp: int, tokens_s: float | None = None,
                  attention_term: bool = True) -> PrefillModel:
    """The instance's prefill model: ``tokens_s`` if given, else the profile's measured figure for
    the model, else ``tp x peak_flops x prefill_mfu / (2 x active parameters)``."""
    flops_per_token = 2.0 * model.active_params
    if tokens_s is not None:
        rate, source = tokens_s, "--prefill-tokens-s"
    elif (measured := profile.measured_prefill_tokens_s(model.name)) is not None:
        rate, source = measured, f"measured ({profile.name} [prefill_tokens_s])"
    else:
        rate = tp * profile.gpu.peak_flops * profile.gpu.prefill_mfu / flops_per_token
        source = f"derived: {tp} GPU(s) x {profile.gpu.peak_flops:.3g} FLOP/s x MFU {profile.gpu.prefill_mfu:g}"
    lo, hi = PREFILL_TOKENS_S_RANGE
    if not lo <= rate <= hi:
        raise ConfigError(f"{model.name}: a prefill rate of {rate:.3g} tokens/s ({source}) is outside "
                          f"[{lo:g}, {hi:g}]; check the profile or pass --prefill-tokens-s")
    coeff = float(model.attention_flops_coeff) if attention_term else 0.0
    return PrefillModel(tokens_s=rate, flops_s=rate * flops_per_token, attention_flops_coeff=coeff, source=source)
