"""Parametric workloads refuse parameters the sampling cannot take (called without the CLI's checks)."""

from __future__ import annotations

import math

import pytest

from tierkv.errors import InputError
from tierkv.workload.params import ParamWorkload, param_workload


@pytest.mark.parametrize("kwargs, message", [
    ({"turns_mean": math.inf}, "--turns must be a finite number >= 1"),
    ({"request_rate_per_s": math.inf}, "--request-rate must be a finite number > 0"),
    ({"think_time_s": math.inf}, "think_time_s >= 0"),
])
def test_non_finite_parameters_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(InputError, match=message):
        ParamWorkload(requests=10, **kwargs)  # type: ignore[arg-type]


def test_a_valid_spec_gives_its_requests() -> None:
    reqs = param_workload(ParamWorkload(requests=50, turns_mean=1000.0), seed=1)
    assert len(reqs) == 50 and all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
