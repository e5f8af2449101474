"""The reuse model: censoring-aware hazards and an index that waits through a think time."""

from __future__ import annotations

from tierkv.policy.hazard import BINS, ReuseModel, age_bin


def test_age_bins_are_monotone_and_bounded() -> None:
    ages = [0, 0.5, 1, 2, 10, 100, 1e4, 1e9]
    bins = [age_bin(a) for a in ages]
    assert bins == sorted(bins) and bins[0] == 0 and bins[-1] == BINS - 1


def _think_time_model() -> ReuseModel:
    """Class 0 pages come back exactly 40 clock units later, half of them; class 1 never."""
    m = ReuseModel(2)
    t = 0.0
    for i in range(4000):
        t = float(i)
        m.start(0, t)
        m.start(1, t)
        if i >= 40:
            if i % 2:
                m.reuse(0, t - 40, t)
            else:
                m.censor(0, t - 40, t)
            m.censor(1, t - 40, t)
    m.refresh(t)
    return m


def test_index_rises_through_the_think_time_then_falls() -> None:
    m = _think_time_model()
    idx = m.index[0]
    assert idx[age_bin(1)] < idx[age_bin(20)] < idx[age_bin(38)]
    assert idx[age_bin(200)] < idx[age_bin(38)] / 10


def test_pages_never_reused_rank_below_pages_that_are() -> None:
    m = _think_time_model()
    assert m.index[1][age_bin(10)] < m.index[0][age_bin(10)] / 10
    assert m.support[0][age_bin(10)] > 1000 and m.support[1][age_bin(10)] == 0


def test_pages_still_waiting_are_censored_not_counted_as_never_reused() -> None:
    """A reuse seen at age 40 while many pages are younger than 40 must not be diluted by them."""
    m = ReuseModel(1)
    for i in range(200):
        m.start(0, float(i))
    m.reuse(0, 0.0, 40.0)
    m.refresh(200.0)
    fresh = ReuseModel(1)
    fresh.start(0, 0.0)
    fresh.reuse(0, 0.0, 40.0)
    for i in range(1, 200):
        fresh.start(0, 160.0 + i * 0.2)         # same count, all younger than 40 at t=200
    fresh.refresh(200.0)
    assert fresh.index[0][age_bin(10)] > m.index[0][age_bin(10)]
