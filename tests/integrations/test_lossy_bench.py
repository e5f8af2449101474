"""``tierkv bench lossy --quick`` and ``tierkv calibrate`` end to end on SmolLM2-135M: every
field there, the bytes each budget buys, the rate-distortion allocation ahead of the
uniform one at 2.5 bits an element (the run is deterministic: fixed weights, fixed
text), and a calibration file the allocation reads. The quality figures themselves are
the benchmark's to report (docs/lossy.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations.conftest import demo_missing_reason
from tierkv.lossy.alloc import Calibration


@pytest.mark.skipif(demo_missing_reason() is not None, reason=str(demo_missing_reason()))
def test_the_quick_lossy_bench_reports_every_field() -> None:
    out = subprocess.run([sys.executable, "-m", "tierkv", "bench", "lossy", "--quick", "--json"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["budgets"] == [2.5, 4.0]
    for field in ("delta_nll", "agreement", "bytes_ratio", "kept_fraction", "no_evict_delta_nll",
                  "tier_delta_nll", "tier_agreement", "tier_bytes_ratio",
                  "uniform_delta_nll", "uniform_agreement", "uniform_bytes_ratio"):
        assert len(r[field]) == 2, field
    # Bytes: the budget over BF16's 16 bits (headers and parameters inside it); the lossy
    # tier's blocks round each page's blob up to 4 KiB.
    for ratio, budget in zip(r["bytes_ratio"] + r["uniform_bytes_ratio"], [2.5, 4.0] * 2):
        assert budget / 16 * 0.95 <= ratio <= budget / 16 + 1e-3
    for ratio, budget in zip(r["tier_bytes_ratio"], [2.5, 4.0]):
        assert budget / 16 * 0.95 <= ratio <= budget / 16 + 0.01
    assert r["tier_delta_nll"][1] < r["uniform_delta_nll"][1]   # flat importance, calibrated: ahead of uniform
    assert r["delta_nll"][0] < r["uniform_delta_nll"][0]        # rate-distortion ahead at 2.5 bits
    assert r["delta_nll"][1] <= r["delta_nll"][0] + 0.02         # more bits, no more loss (beyond noise)
    assert r["uniform_delta_nll"][1] < r["uniform_delta_nll"][0]  # uniform: 4 bits lose less than 2.5
    assert 0 < r["kept_fraction"][0] < 1 and all(0 <= a <= 1 for a in r["agreement"])
    assert len(r["calibration_key"]) == len(r["calibration_value"]) == 30


@pytest.mark.skipif(demo_missing_reason() is not None, reason=str(demo_missing_reason()))
def test_calibrate_writes_a_file_the_allocation_reads(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tierkv", "calibrate", "--model", "smollm2", "--out",
                          str(tmp_path / "cal.json"), "--tokens", "256", "--continuation", "16", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    cal = Calibration.load(tmp_path / "cal.json")
    assert doc["layers"] == len(cal.key) == len(cal.value) == 30 and cal.model_id.startswith("HuggingFaceTB/")
    assert max(cal.key) > 0 and max(cal.value) > 0
    assert cal.query_energy is not None and doc["query_energy_shape"] == [30, 3, 64] == list(cal.query_energy.shape)
    assert (cal.query_energy > 0).all()


@pytest.mark.parametrize("argv, message", [
    (["calibrate", "--model", "nowhere", "--out", "x.json"], "transformers model folder"),
    (["calibrate", "--model", "smollm2", "--out", "x.json", "--tokens", "100"], "whole pages"),
    (["calibrate", "--model", "smollm2", "--out", "/no/such/dir/x.json"], "no directory"),
    (["calibrate", "--model", "smollm2", "--out", "x.json", "--continuation", "0"], "--continuation must be"),
    (["bench", "lossy", "--budgets", "4,x"], "--budgets must be numbers"),
    (["bench", "lossy", "--budgets", "0.5"], "1 to 16 bits"),
    (["bench", "codec", "--budgets", "4"], "--budgets and --text are for the lossy suite"),
    (["bench", "codec", "--text", "t.txt"], "--budgets and --text are for the lossy suite"),
    (["bench", "lossy", "--text", "/no/such/text.txt"], "--text: cannot read /no/such/text.txt"),
])
def test_bad_lossy_arguments_are_one_line_and_exit_2(argv: list[str], message: str, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tierkv", *argv], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.skipif(demo_missing_reason() is not None, reason=str(demo_missing_reason()))
def test_a_held_text_too_short_for_the_bench_is_refused(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_text("A few words of a held text.")
    out = subprocess.run([sys.executable, "-m", "tierkv", "bench", "lossy", "--quick", "--text", "short.txt"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--text short.txt is" in out.stderr and "tokens; the bench needs 544" in out.stderr, out.stderr[-2000:]
