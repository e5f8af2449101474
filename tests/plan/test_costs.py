"""Load versus recompute: formulas and crossovers against hand computations; instance sizing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tierkv.errors import ConfigError, InputError
from tierkv.plan.costs import LoadModel, PrefillModel, crossover_tokens, instance_gpus, prefill_model
from tierkv.plan.hardware import load_profile
from tierkv.plan.models import builtin


def _linear(tokens_s: float) -> PrefillModel:
    return PrefillModel(tokens_s=tokens_s, flops_s=1.0, attention_flops_coeff=0.0, source="test")


def test_linear_crossover_by_hand() -> None:
    # recompute 1e-4 s/token; load 1 ms + 1e5 B/token at 1e10 B/s = 1e-5 s/token.
    # 1e-3 + 1e-5 n < 1e-4 n  <=>  n > 1e-3 / 9e-5 = 11.1, so 12 tokens.
    load = LoadModel(latency_s=1e-3, bytes_per_token=1e5, bandwidth_bytes_s=1e10)
    prefill = _linear(1e4)
    assert crossover_tokens(load, prefill, 1_000_000) == 12
    assert float(load.load_s(12)) < float(prefill.recompute_s(12))
    assert float(load.load_s(11)) >= float(prefill.recompute_s(11))
    assert float(load.load_s(0)) == 0.0


def test_no_crossover_when_the_tier_is_slower_per_token() -> None:
    slow = LoadModel(latency_s=0.0, bytes_per_token=2e5, bandwidth_bytes_s=1e9)  # 2e-4 s/token
    assert crossover_tokens(slow, _linear(1e4), 10**9) is None


def test_quadratic_crossover_by_hand() -> None:
    # recompute n/1e4 + 1e4 n^2 / 1e12 = 1e-4 n + 1e-8 n^2; load 2e-4 n.
    # 1e-8 n^2 > 1e-4 n  <=>  n > 10,000 (equal at 10,000), so 10,001.
    prefill = PrefillModel(tokens_s=1e4, flops_s=1e12, attention_flops_coeff=1e4, source="test")
    load = LoadModel(latency_s=0.0, bytes_per_token=2e5, bandwidth_bytes_s=1e9)
    assert float(prefill.recompute_s(10_000)) == pytest.approx(2.0)
    assert crossover_tokens(load, prefill, 100_000) == 10_001
    assert crossover_tokens(load, prefill, 10_000) is None  # beyond the model's context


def test_recompute_with_a_cached_prefix() -> None:
    prefill = PrefillModel(tokens_s=1e4, flops_s=1e12, attention_flops_coeff=1e4, source="test")
    # 2000 tokens after 1000 cached: 1000 / 1e4 + 1e-8 * (2000^2 - 1000^2) = 0.1 + 0.03
    assert float(prefill.recompute_s(2000, 1000)) == pytest.approx(0.13)
    assert float(prefill.recompute_s(2000)) == pytest.approx(prefill.recompute_s(1000) + 0.13)


def test_derived_prefill_rate_and_attention_term() -> None:
    model, hw = builtin("llama-3.1-8b"), load_profile("h200-node")
    p = prefill_model(model, hw, tp=1)
    assert p.tokens_s == pytest.approx(989e12 * 0.5 / (2 * model.active_params))
    assert p.attention_flops_coeff == 32 * 32 * (128 + 128)
    # 1000 tokens: linear part plus 32 layers x 32 heads x 256 x 1000^2 FLOPs at 2 x P x tokens/s.
    expected = 1000 / p.tokens_s + 262_144 * 1e6 / (p.tokens_s * 2 * model.active_params)
    assert float(p.recompute_s(1000)) == pytest.approx(expected)
    assert prefill_model(model, hw, 1, tokens_s=1234.0, attention_term=False).recompute_s(1000) \
        == pytest.approx(1000 / 1234.0)


def test_instance_gpus() -> None:
    hw = load_profile("h200-node")
    assert instance_gpus(builtin("llama-3.1-8b"), hw) == 1
    assert instance_gpus(builtin("llama-3.1-70b"), hw) == 2
    assert instance_gpus(builtin("llama-3.1-405b"), hw) == 8
    with pytest.raises(ConfigError, match="do not fit in one node of 'dev-box'"):
        instance_gpus(builtin("llama-3.1-70b"), load_profile("dev-box"))
    with pytest.raises(InputError, match=r"--tp must be in \[1, 8\]"):
        instance_gpus(builtin("llama-3.1-8b"), hw, tp=16)


def test_auto_tp_uses_every_gpu_of_a_node_that_is_not_a_power_of_two() -> None:
    """6 GPUs hold DeepSeek-V3 with 10% to spare: powers of two first, then all of them."""
    hw = load_profile("h200-node")
    six = replace(hw, gpu=replace(hw.gpu, count=6))
    assert instance_gpus(builtin("deepseek-v3"), six) == 6
    assert instance_gpus(builtin("llama-3.1-70b"), six) == 2  # the power-of-two preference stays
    with pytest.raises(ConfigError, match="do not fit in one node of 'h200-node' with 10% left for KV"):
        instance_gpus(builtin("deepseek-v3"), replace(hw, gpu=replace(hw.gpu, count=5)))


@pytest.mark.parametrize("tokens_s, latency_s, bandwidth, expected", [
    (1e-300, 1e-4, 1e10, 1),         # recompute takes forever: loading wins at once
    (1e300, 1e-4, 1e10, None),       # recompute is free
    (1e4, 1e300, 1e10, None),        # the load never starts
    (1e4, 1e-4, 1e-300, None),       # the load never ends
    (1e-300, 0.0, 1e-300, None),     # both absurd: the quadratic root lies past the context
    (10.0, 1e-4, 1e10, 1),
])
def test_crossover_survives_extreme_rates(tokens_s: float, latency_s: float, bandwidth: float,
                                          expected: int | None) -> None:
    prefill = PrefillModel(tokens_s=tokens_s, flops_s=tokens_s * 1e9, attention_flops_coeff=1e4, source="test")
    load = LoadModel(latency_s=latency_s, bytes_per_token=1e5, bandwidth_bytes_s=bandwidth)
    assert crossover_tokens(load, prefill, 131_072) == expected


@pytest.mark.parametrize("peak_flops, message", [(1e-300, "a prefill rate of 3.58e-311 tokens/s \\(derived"),
                                                 (1e30, "a prefill rate of 3.58e\\+19 tokens/s \\(derived")])
def test_absurd_derived_prefill_rates_are_refused(peak_flops: float, message: str) -> None:
    hw = load_profile("h200-node")
    with pytest.raises(ConfigError, match=message):
        prefill_model(builtin("llama-3.1-8b"), replace(hw, gpu=replace(hw.gpu, peak_flops=peak_flops)), 1)
