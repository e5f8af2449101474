"""The DualPath simulator: the paper's gain where loading is storage-bound, none where the
prefill compute is the bottleneck, the same sessions for every policy, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typing import Any

from tierkv.dualpath.sim import DualPathConfig, run_dualpath, simulate
from tierkv.errors import InputError

SHORT: dict[str, Any] = {"duration_s": 120.0, "warmup_s": 30.0}


def test_storage_bound_1p1d_doubles_with_balanced_nics() -> None:
    r = run_dualpath(DualPathConfig(**SHORT))["results"]
    pe, sq, split = r["pe-only"], r["shorter-queue"], r["split"]
    assert pe["nic_util_prefill"] > 0.95 and pe["nic_util_decode"] == 0.0 and pe["prefill_read_share"] == 1.0
    assert sq["throughput_vs_pe_only"] >= 1.8
    assert abs(sq["nic_util_prefill"] - sq["nic_util_decode"]) <= 0.10
    # Saturated, both keep both NICs busy: equal but for the order events fall in (0.2% here).
    assert split["throughput_vs_pe_only"] >= sq["throughput_vs_pe_only"] * 0.99
    assert sq["ttft_p50_s"] < pe["ttft_p50_s"] / 1.5


def test_split_beats_the_per_request_choice_below_saturation() -> None:
    r = run_dualpath(DualPathConfig(sessions=8, duration_s=300.0, warmup_s=60.0))["results"]
    assert r["split"]["ttft_p50_s"] < r["shorter-queue"]["ttft_p50_s"]
    assert r["split"]["throughput_vs_pe_only"] >= r["shorter-queue"]["throughput_vs_pe_only"]


def test_compute_bound_no_policy_gains() -> None:
    r = run_dualpath(DualPathConfig(prefill_s_per_token=5e-4, start_tokens=4000, **SHORT))["results"]
    for name in ("shorter-queue", "split"):
        assert abs(r[name]["throughput_vs_pe_only"] - 1) <= 0.05, (name, r[name])


def test_more_decode_engines_take_a_larger_share() -> None:
    r = simulate(DualPathConfig(prefill=1, decode=3, **SHORT), "shorter-queue")
    assert 0.2 <= r["prefill_read_share"] <= 0.3 and r["nic_util_decode"] > 0.9


def test_runs_are_deterministic_by_seed() -> None:
    a = simulate(DualPathConfig(**SHORT), "split")
    assert a == simulate(DualPathConfig(**SHORT), "split")
    assert a != simulate(DualPathConfig(seed=1, **SHORT), "split")


@pytest.mark.parametrize("field, value, match", [
    ("prefill", 0, "--prefill must be a whole number >= 1"),
    ("hit_rate", 1.5, "--hit-rate must lie in"),
    ("storage_nic_bytes_s", 0.0, "--storage-nic-gbps must be a positive number"),
    ("think_s", float("nan"), "--think-s must be a number >= 0"),
    ("turns", True, "--turns must be a whole number"),
])
def test_bad_configs_are_refused_by_flag(field: str, value: object, match: str) -> None:
    with pytest.raises(InputError, match=match):
        DualPathConfig(**{field: value}).check()   # type: ignore[arg-type]


def test_cli_json_and_errors() -> None:
    proc = subprocess.run([sys.executable, "-m", "tierkv", "sim", "dualpath", "--duration-s", "60", "--warmup-s", "10",
                           "--policy", "split", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out["results"]) == {"pe-only", "split"} and out["config"]["prefill"] == 1
    for key in ("throughput_vs_pe_only", "nic_util_prefill", "nic_util_decode", "ttft_p50_s", "ttft_p99_s"):
        assert isinstance(out["results"]["split"][key], float)
    proc = subprocess.run([sys.executable, "-m", "tierkv", "sim", "dualpath", "--decode", "-1"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--decode must be a whole number >= 0" in proc.stderr


@pytest.mark.parametrize("p, d", [(1, 1), (1, 3), (4, 1), (2, 2)])
def test_saturated_reads_split_as_the_planner_advises(p: int, d: int) -> None:
    """tierkv plan's DualPath scenario sends D / (P + D) of the loads through decode nodes of
    identical NICs; the scheduler, run storage-bound, measures the same split."""
    from tierkv.plan.hardware import ClusterSpec, NicSpec
    from tierkv.plan.network import scenarios

    nic = NicSpec("storage", 1, 50e9 / 8, True, False)
    planned = next(s for s in scenarios(ClusterSpec(p, d, True), (nic,), 1e9, 0.0, 0.0) if s.name == "dualpath")
    r = simulate(DualPathConfig(prefill=p, decode=d, sessions=32 * (p + d), **SHORT), "shorter-queue")
    assert abs((1 - r["prefill_read_share"]) - planned.decode_share) <= 0.03, (r, planned.decode_share)


def test_a_model_that_cannot_advance_is_refused_not_hung() -> None:
    with pytest.raises(InputError, match="a turn would take no time"):
        DualPathConfig(turns=1, think_s=0, output_tokens=0, prefill_s_per_token=0).check()
    # Simulated times far past a float's resolution at the NICs' rates end, not spin.
    r = simulate(DualPathConfig(sessions=4, think_s=3e6, duration_s=1e9, warmup_s=0.0), "split")
    assert r["turns"] > 0


def test_sim_options_before_dualpath_are_refused() -> None:
    proc = subprocess.run([sys.executable, "-m", "tierkv", "sim", "--json", "dualpath"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--json: an option of tierkv sim's policy simulation" in proc.stderr
