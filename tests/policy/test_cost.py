"""Cost awareness in gittins: admission by the prefill time a hit saves against the load time.

The model itself (tierkv.recompute.CostModel) is tested in tests/test_recompute.py.
"""

from __future__ import annotations

from tierkv.policy.gittins import GittinsPolicy
from tierkv.recompute import CostModel, LoadModel, PrefillModel
from tests.policy.helpers import chain


def _model(load_latency_s: float) -> CostModel:
    # 16 tokens per page, 1 us per token, 1e-8 s per (query, key) pair, a 64 KiB page at 1 GB/s.
    return CostModel(16, PrefillModel(tokens_s=1e6, flops_s=1e12, attention_flops_coeff=5e3),
                     LoadModel(latency_s=load_latency_s, bytes_per_token=4096, bandwidth_bytes_s=1e9))


def test_gittins_with_a_cost_model_admits_by_saved_time() -> None:
    m = _model(1e-4)
    d = next(d for d in range(1000) if m.saved_s(d) > 0)   # the shallowest page worth loading
    p = GittinsPolicy(cost=m)
    pairs = chain(*range(d + 1))
    p.on_request([key for key, _ in pairs], 0.0)
    assert [p.admit(key, parent) for key, parent in pairs] == [False] * d + [True]


def test_with_a_cost_model_admission_needs_the_parents() -> None:
    """admit_keys cannot weigh a page's depth from its key alone: None, nothing changed,
    and the manager asks admit_many with the (key, parent) pairs instead."""
    m = _model(1e-4)
    d = next(d for d in range(1000) if m.saved_s(d) > 0)
    p = GittinsPolicy(cost=m)
    pairs = chain(*range(d + 1))
    p.on_request([key for key, _ in pairs], 0.0)
    state = (p._admitted, p._refused, p._bar)
    assert p.admit_keys([key for key, _ in pairs]) is None
    assert (p._admitted, p._refused, p._bar) == state
    assert p.admit_many(pairs) == [False] * d + [True]
