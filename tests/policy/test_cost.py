"""Cost awareness: recompute time saved against load time, and admission per tier."""

from __future__ import annotations

import pytest

from tierkv.errors import ConfigError
from tierkv.policy.cost import CostAwarePolicy, CostModel
from tierkv.policy.gittins import GittinsPolicy
from tierkv.policy.lru import LRUPolicy
from tests.policy.helpers import chain, k


def _model(load_latency_s: float) -> CostModel:
    # 16 tokens per page, 1 us per token, 10 ns per (query, key) pair, a 64 KiB page at 1 GB/s.
    return CostModel(tokens_per_page=16, page_bytes=65536, linear_s_per_token=1e-6,
                     attention_s_per_token_pair=1e-8, load_latency_s=load_latency_s, load_bytes_per_s=1e9)


def test_deeper_pages_cost_more_to_recompute() -> None:
    m = _model(0.0)
    assert m.recompute_s(0) == pytest.approx(16 * (1e-6 + 1e-8 * 8.5))
    assert m.recompute_s(10) - m.recompute_s(9) == pytest.approx(1e-8 * 16 * 16)
    assert m.load_s() == pytest.approx(65536 / 1e9)


def test_first_worth_loading_is_where_recompute_overtakes_load() -> None:
    m = _model(1e-4)
    d = m.first_worth_loading()
    assert m.saved_s(d) > 0 >= m.saved_s(d - 1)
    fast = CostModel(16, 65536, 1e-6, 1e-8, load_latency_s=0.0, load_bytes_per_s=1e12)
    assert fast.first_worth_loading() == 0


def test_bad_model_is_refused() -> None:
    with pytest.raises(ConfigError):
        CostModel(16, 65536, 1e-6, 1e-8, 0.0, 0.0)


def test_cost_aware_wrapper_refuses_shallow_pages_of_a_slow_tier() -> None:
    m = _model(1e-4)
    d = m.first_worth_loading()
    p = CostAwarePolicy(LRUPolicy(), m)
    pairs = chain(*range(d + 2))
    p.on_request([key for key, _ in pairs], 0.0)
    admitted = [p.admit(key, parent) for key, parent in pairs]
    assert admitted == [False] * d + [True, True]
    # Without a request hint, depth follows resident parents; unknown depth is admitted.
    q = CostAwarePolicy(LRUPolicy(), m)
    assert q.admit(k("x"), k("unknown-parent"))
    assert not q.admit(k("root"), None)


def test_gittins_with_a_cost_model_admits_by_saved_time() -> None:
    m = _model(1e-4)
    d = m.first_worth_loading()
    p = GittinsPolicy(cost=m)
    pairs = chain(*range(d + 1))
    p.on_request([key for key, _ in pairs], 0.0)
    assert [p.admit(key, parent) for key, parent in pairs] == [False] * d + [True]


def test_make_policy_with_a_cost_model() -> None:
    from tierkv.policy import make_policy

    m = _model(1e-4)
    assert isinstance(make_policy("gittins", cost=m), GittinsPolicy)
    wrapped = make_policy("lru", cost=m)
    assert isinstance(wrapped, CostAwarePolicy) and isinstance(wrapped.inner, LRUPolicy)
    wrapped.on_request([k(0)], 0.0)
    assert not wrapped.admit(k(0), None)
