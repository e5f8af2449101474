"""The planner's side of load versus recompute: GPUs per instance and the instance's prefill rate.

The model itself (:class:`PrefillModel`, :class:`LoadModel`, :func:`crossover_tokens`)
is :mod:`tierkv.recompute`, shared with the eviction policies; this module fills it in
for a model on a hardware profile. Attention costs ``c_attn = layers x query heads x
(d_qk + d_v)`` FLOPs per token pair (:attr:`tierkv.plan.models.ModelSpec.attention_flops_coeff`),
at the FLOP rate that the prefill rate implies (``flops_s = tokens_s x 2 x active
parameters``). Each tier's :class:`LoadModel` comes from :mod:`tierkv.plan.sizing`.
Called by :mod:`tierkv.plan.planner`; the other planner modules import the model's
names from here.
"""

from __future__ import annotations

from tierkv.errors import ConfigError, InputError
from tierkv.plan.hardware import HardwareProfile
from tierkv.plan.models import ModelSpec
from tierkv.recompute import LoadModel, PrefillModel, crossover_tokens

__all__ = ["PREFILL_TOKENS_S_RANGE", "LoadModel", "PrefillModel", "crossover_tokens", "instance_gpus",
           "prefill_model"]

#: Prefill tokens/s of one instance the planner accepts, from any source (flag, profile, derived):
#: outside it recompute times overflow or mean nothing.
PREFILL_TOKENS_S_RANGE = (1.0, 1e9)


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
