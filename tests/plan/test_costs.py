"""The planner's prefill rate (derived, measured or given) and instance sizing; the load-versus-recompute
formulas themselves are tested in tests/test_recompute.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tierkv.errors import ConfigError, InputError
from tierkv.plan.costs import instance_gpus, prefill_model
from tierkv.plan.hardware import load_profile
from tierkv.plan.models import builtin


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


@pytest.mark.parametrize("peak_flops, message", [(1e-300, "a prefill rate of 3.58e-311 tokens/s \\(derived"),
                                                 (1e30, "a prefill rate of 3.58e\\+19 tokens/s \\(derived")])
def test_absurd_derived_prefill_rates_are_refused(peak_flops: float, message: str) -> None:
    hw = load_profile("h200-node")
    with pytest.raises(ConfigError, match=message):
        prefill_model(builtin("llama-3.1-8b"), replace(hw, gpu=replace(hw.gpu, peak_flops=peak_flops)), 1)
