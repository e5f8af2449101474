"""The requester's cost model of each side (tierkv.dualpath.loads._Fit): latency and rate
told apart by least squares once transfer sizes differ, forgotten when stale."""

from __future__ import annotations

import pytest

from tierkv.dualpath.loads import INITIAL_BYTES_S, _Fit


def test_latency_and_rate_are_told_apart_once_sizes_differ() -> None:
    fit = _Fit()
    assert fit.estimate(0) == (0.0, INITIAL_BYTES_S)
    fit.add(1e6, 5.0, 0)        # the first transfer (it connected): not counted
    assert fit.estimate(0) == (0.0, INITIAL_BYTES_S)
    fit.add(1e6, 0.012, 1)      # 2 ms + 1 MB at 100 MB/s
    latency, rate = fit.estimate(1)
    assert latency == 0.0 and rate == pytest.approx(1e6 / 0.012)    # one size: all of it taken for rate
    fit.add(2e6, 0.022, 2)
    fit.add(4e6, 0.042, 3)
    latency, rate = fit.estimate(3)
    assert latency == pytest.approx(0.002) and rate == pytest.approx(1e8)


def test_sizes_that_stop_spreading_forget_the_latency() -> None:
    fit = _Fit()
    fit.add(1, 1, 0)
    for i, (b, t) in enumerate([(1e6, 0.03), (2e6, 0.04), (4e6, 0.06)]):   # 20 ms + 100 MB/s
        fit.add(b, t, i + 1)
    assert fit.estimate(4)[0] == pytest.approx(0.02)
    for i in range(16):                                  # then only 4 MB transfers, much faster
        fit.add(4e6, 0.005, 5 + i)
    latency, rate = fit.estimate(21)
    assert latency == 0.0 and rate == pytest.approx(8e8)  # not 20 ms counted twice


def test_noise_never_yields_negative_latency_or_a_rate_past_the_fastest_transfer() -> None:
    fit = _Fit()
    fit.add(1, 1, 0)
    for i, (b, t) in enumerate([(1e6, 0.05), (2e6, 0.01), (3e6, 0.005)]):   # bigger was faster
        fit.add(b, t, i + 1)
    latency, rate = fit.estimate(4)
    assert latency == 0.0 and 0 < rate <= 3e6 / 0.005
    fit = _Fit()
    fit.add(1, 1, 0)
    for i, (b, t) in enumerate([(1e6, 0.0100), (2e6, 0.0101), (4e6, 0.0102)]):   # a slope near 0
        fit.add(b, t, i + 1)
    latency, rate = fit.estimate(4)
    assert rate <= 4e6 / (0.0102 - latency) * (1 + 1e-9)


def test_a_side_not_measured_for_long_is_guessed_again() -> None:
    fit = _Fit()
    fit.add(1, 1, 0)
    fit.add(1e6, 1.0, 5)                            # one bad measurement: 1 MB/s
    assert fit.estimate(5 + _Fit.FORGET)[1] == pytest.approx(1e6)
    assert fit.estimate(6 + _Fit.FORGET) == (0.0, INITIAL_BYTES_S)   # forgotten: tried again
