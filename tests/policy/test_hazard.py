"""The reuse model: censoring-aware hazards and an index that waits through a think time."""

from __future__ import annotations

import numpy as np
import pytest

from tierkv.policy import hazard
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


def _hazards(rng: np.random.Generator, kind: int, classes: int = 7) -> np.ndarray:
    shape = (classes, BINS)
    if kind == 0:
        return rng.random(shape)
    if kind == 1:                                  # rare reuse: small hazards, long horizons
        return rng.random(shape) * 1e-3
    if kind == 2:                                  # bins with no reuse at all
        return np.where(rng.random(shape) < 0.3, 0.0, rng.random(shape))
    if kind == 3:                                  # certain reuse in some bins
        return np.where(rng.random(shape) < 0.1, 1.0, rng.random(shape) ** 8)
    return np.full(shape, rng.random() * 0.05)    # flat: the index falls from its first bin


@pytest.mark.skipif(hazard._gittins_index is None, reason="tierkv.policy._ghost is not built")
def test_the_compiled_index_table_has_numpys_bits() -> None:
    """``refresh``'s index table (compiled) against the numpy ``_gittins``, row by row, to
    the bit: the eviction order, and the simulator's figures, must not move with it."""
    rng = np.random.default_rng(3)
    for trial in range(400):
        h = _hazards(rng, trial % 5)
        got = hazard.index_table(h)
        want = np.array([hazard._gittins(row) for row in h])
        assert got.tobytes() == want.tobytes(), trial
    h = _hazards(rng, 0, 2)
    h[1, 40] = np.nan                              # not from refresh (it clips), but alike all the same
    np.testing.assert_array_equal(hazard.index_table(h), np.array([hazard._gittins(row) for row in h]))


def test_the_index_table_takes_rows_of_every_bin_only() -> None:
    for shape in ((2, BINS // 2), (1, 2 * BINS), (BINS,)):
        with pytest.raises(ValueError, match="index_table"):
            hazard.index_table(np.zeros(shape))


@pytest.mark.skipif(hazard._gittins_index is None, reason="tierkv.policy._ghost is not built")
def test_the_compiled_index_table_refuses_shapes_that_do_not_match() -> None:
    h = np.zeros((2, BINS))
    for args in ((h, hazard._EDGES[:-1], hazard._MIDS, np.empty_like(h)),
                 (h[:, :-1].copy(), hazard._EDGES, hazard._MIDS, np.empty((2, BINS - 1))),
                 (h, hazard._EDGES, hazard._MIDS, np.empty((1, BINS)))):
        with pytest.raises(ValueError, match="gittins_index"):
            hazard._gittins_index(*args)


def test_refresh_gives_the_same_index_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's table with the compiled index and with numpy alone: the same numbers."""
    tables = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(hazard, "_gittins_index", None)
        tables.append(_think_time_model().tables())
    assert tables[0] == tables[1]


@pytest.mark.parametrize("native", [True, False])
def test_a_clock_far_past_the_last_refresh_keeps_the_weights_finite(monkeypatch: pytest.MonkeyPatch,
                                                                     native: bool) -> None:
    """A reopen of millions of pages moves a policy's clock one a page with no request, so
    the first requests after it come thousands of memories after the weight reference:
    their observations and the next refresh must rebase first, not overflow."""
    from tierkv.keys import PageKey
    from tierkv.policy import gittins
    from tierkv.policy.gittins import GittinsPolicy

    if not native:
        monkeypatch.setattr(hazard, "_record", None)
    p = GittinsPolicy(native=native)
    p.insert_many(b"".join(bytes([i]) * 16 for i in range(1, 9)), bytes(8 * 16), bytes(8))
    p._now = 3000.0 * 4096    # where 3,000 memories of inserts (12M pages) leave the clock
    for r in range(2 * gittins.REFRESH_REQUESTS):
        p.on_request([PageKey(bytes([1 + r % 8]) * 16), PageKey(bytes([200]) * 16)], 0.0)
    model = p._model
    assert np.isfinite(model._open).all() and np.isfinite(model._reuses).all()
    assert all(np.isfinite(row).all() for row in model.index)
    assert p.victims(2, lambda k: True)


def test_advance_does_nothing_in_steady_use() -> None:
    """Refresh rebases every 64 memories; advance only beyond 128, so it changes no bit."""
    a, b = _think_time_model(), _think_time_model()
    b.advance(100 * 4096.0)   # within 128 memories of the reference: nothing moves
    assert a.tables() == b.tables() and a._t_ref == b._t_ref


@pytest.mark.parametrize("how", ["start", "record_many", "close"])
def test_a_rebase_scales_what_was_observed_and_skips_an_empty_model(how: str) -> None:
    """Before any observation (a reopen's first request) a rebase only moves the reference:
    its cells are all zero. After one, it scales every cell, whichever way it was made."""
    empty = ReuseModel(2)
    empty.advance(200 * 4096.0)
    assert empty._t_ref == 200 * 4096.0 and not empty._open.any() and not empty._resolved.any()
    m = ReuseModel(2)
    if how == "start":
        m.start(1, 0.0)
    elif how == "record_many":
        m.record_many(bytes([hazard.START]), bytes([1]), np.array([0.0]).tobytes(), 0.0)
    else:
        m._close(1, 0.0, 10.0, hit=True)
    before = (m._open.copy(), m._resolved.copy(), m._reuses.copy())
    m.advance(200 * 4096.0)
    f = np.exp(-200.0)
    for got, was in zip((m._open, m._resolved, m._reuses), before):
        np.testing.assert_array_equal(got, was * f)
    assert m._open.any()   # the weight was scaled, not dropped
