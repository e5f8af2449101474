"""The time base and tier boundaries at extreme rates and capacities: no overflow, no giant arrays."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tierkv.errors import InputError
from tierkv.plan.evaluate import PEAK_WINDOW_S, timeline
from tierkv.plan.hardware import TierKind
from tierkv.plan.hitrate import reuse_profile
from tierkv.plan.sizing import MAX_BLOCKS, ResolvedTier, boundaries
from tierkv.workload import Request

REQS = [Request(0.0, (1, 2), 1024, 10), Request(1.0, (1, 3), 1024, 10), Request(2.0, (4,), 512, 10)]


def test_windows_are_numbered_densely_at_a_slow_rate() -> None:
    """1e-15 requests/s spreads three arrivals over 3e15 s: three windows, not 5e13."""
    time = timeline(reuse_profile(REQS), 1e-15)
    assert time.duration_s == pytest.approx(3e15)
    assert time.windows == 3 and time.window.tolist() == [0, 1, 2]
    fast = timeline(reuse_profile(REQS), 1.0)  # all within one minute: one window
    assert fast.windows == 1 and fast.duration_s == 3.0 < PEAK_WINDOW_S


@pytest.mark.parametrize("rate", [math.inf, 0.0, math.nan, -1.0])
def test_rates_without_a_finite_duration_are_refused(rate: float) -> None:
    with pytest.raises(InputError, match="--request-rate must be a finite number > 0"):
        timeline(reuse_profile(REQS), rate)


def test_boundaries_stay_in_int64_for_huge_capacities() -> None:
    huge = ResolvedTier(TierKind.NVMEOF, 10**30, 1e-3, 1e9, 1e9, 0.0, 0.1, 1)
    bounds = boundaries((huge, huge, huge, huge), 512)
    assert bounds.dtype == np.int64 and bounds.tolist() == [MAX_BLOCKS * k for k in (1, 2, 3, 4)]
