"""``tierkv bench splice --quick`` end to end on SmolLM2-135M: every field there, the first
layer's moved keys exact to 1e-4, the splice prefilling far fewer tokens than the
re-prefill, derived pages adding reuse on the trace. Times and agreement are the
benchmark's to report (docs/benchmarks.md), not this test's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integrations.conftest import demo_missing_reason


@pytest.mark.skipif(demo_missing_reason() is not None, reason=str(demo_missing_reason()))
def test_the_quick_splice_bench_reports_every_field() -> None:
    out = subprocess.run([sys.executable, "-m", "tierkv", "bench", "splice", "--quick", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    for field in ("ttft_s_reprefill", "ttft_s_splice", "layer0_key_max_abs_err", "greedy_agreement", "nll_delta",
                  "tokens_reused_exact", "tokens_reused_splice", "reuse_gain_points"):
        assert field in r, field
    assert r["layer0_key_max_abs_err"] <= 1e-4
    assert r["prefilled_tokens_splice"] < r["prefilled_tokens_reprefill"] / 4
    assert r["derived_tokens"] > 0 and 0 <= r["greedy_agreement"] <= 1
    assert r["tokens_reused_splice"] > r["tokens_reused_exact"]
