"""Load versus recompute (tierkv.recompute): formulas and crossovers against hand computations,
and the per-page view the policies weigh."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tierkv.errors import InputError
from tierkv.recompute import CostModel, LoadModel, PrefillModel, crossover_tokens


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


def _page_model(load_latency_s: float) -> CostModel:
    # 16 tokens per page, 1 us per token, 1e-8 s per (query, key) pair (c_attn / flops_s = 5e-9 s
    # per token squared), a 64 KiB page (4 KiB per token) at 1 GB/s.
    return CostModel(16, PrefillModel(tokens_s=1e6, flops_s=1e12, attention_flops_coeff=5e3),
                     LoadModel(latency_s=load_latency_s, bytes_per_token=4096, bandwidth_bytes_s=1e9))


def test_deeper_pages_cost_more_to_recompute() -> None:
    m = _page_model(0.0)
    # 16 tokens: 16 us of weights plus 5e-9 x 16^2 of attention.
    assert m.recompute_s(0) == pytest.approx(16e-6 + 5e-9 * 256)
    # Page 10 against page 9: each of its 16 queries attends to 16 more keys, 1e-8 s a pair.
    assert m.recompute_s(10) - m.recompute_s(9) == pytest.approx(1e-8 * 16 * 16)
    assert m.recompute_s(3) == pytest.approx(float(m.prefill.recompute_s(64, 48)))
    assert m.load_s() == pytest.approx(65536 / 1e9)


def test_a_slow_tier_saves_nothing_on_the_first_pages() -> None:
    # Loading a page takes 1e-4 + 65536 / 1e9 s; recomputing page d 17.28 us + 2.56 us x d,
    # so pages 0 to 57 are cheaper to recompute and page 58 on are worth loading.
    m = _page_model(1e-4)
    assert m.saved_s(57) < 0 < m.saved_s(58)
    fast = CostModel(16, m.prefill, LoadModel(latency_s=0.0, bytes_per_token=4096, bandwidth_bytes_s=1e12))
    assert fast.saved_s(0) > 0
    linear = CostModel(16, PrefillModel(tokens_s=1e6, flops_s=1e12, attention_flops_coeff=0.0), m.load)
    assert linear.saved_s(10_000) == linear.saved_s(0) < 0   # without attention, depth does not help


@pytest.mark.parametrize("build", [
    lambda: LoadModel(latency_s=0.0, bytes_per_token=4096, bandwidth_bytes_s=0.0),
    lambda: LoadModel(latency_s=-1.0, bytes_per_token=4096, bandwidth_bytes_s=1e9),
    lambda: PrefillModel(tokens_s=0.0, flops_s=1e12, attention_flops_coeff=0.0),
    lambda: CostModel(0, PrefillModel(1e6, 1e12, 0.0), LoadModel(0.0, 4096, 1e9)),
])
def test_bad_models_are_refused(build: Callable[[], object]) -> None:
    with pytest.raises(InputError):
        build()
