"""The requester's cost model of each side (tierkv.dualpath.loads._Fit): latency and rate
told apart by least squares once transfer sizes differ, forgotten when stale."""

from __future__ import annotations

import pytest

from tierkv.dualpath.loads import INITIAL_BYTES_S, _Fit


def test_latency_and_rate_are_told_apart_once_sizes_differ() -> None:
    fit = _Fit()
    assert fit.estimate(0) == (0.0, INITIAL_BYTES_S)
    fit.add(1e6, 0.012, 1)      # 2 ms + 1 MB at 100 MB/s
    latency, rate = fit.estimate(1)
    assert latency == 0.0 and rate == pytest.approx(1e6 / 0.012)    # one size: all of it taken for rate
    fit.add(2e6, 0.022, 2)
    fit.add(4e6, 0.042, 3)
    latency, rate = fit.estimate(3)
    assert latency == pytest.approx(0.002) and rate == pytest.approx(1e8)
    fit.add(4e6, 0.042, 4)      # the same size again: the latency found stays
    assert fit.estimate(4)[0] == pytest.approx(0.002)


def test_slower_with_size_never_yields_negative_latency_or_rate() -> None:
    fit = _Fit()
    for i, (b, t) in enumerate([(1e6, 0.05), (2e6, 0.01), (3e6, 0.005)]):   # noisy: bigger was faster
        fit.add(b, t, i)
    latency, rate = fit.estimate(3)
    assert latency == 0.0 and rate > 0


def test_a_side_not_measured_for_long_is_guessed_again() -> None:
    fit = _Fit()
    fit.add(1e6, 1.0, 5)                            # one bad measurement: 1 MB/s
    assert fit.estimate(5 + _Fit.FORGET)[1] == pytest.approx(1e6)
    assert fit.estimate(6 + _Fit.FORGET) == (0.0, INITIAL_BYTES_S)   # forgotten: tried again
