"""``tierkv bench net``: every case measured against a real server process, ratios of the same run."""

from __future__ import annotations

import json

import pytest

from tierkv.cli import main


def test_bench_net_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "net", "--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cases = {(r["kind"], r["case"]) for r in out["results"]}
    assert {("tcp", "fetch-1"), ("tcp", "fetch-batch"), ("tcp", "incast-credits"), ("tcp", "incast-no-credits")} <= cases
    assert all(r["misses"] == 0 for r in out["results"])
    assert out["tcp_incast_naks_with_credits"] == 0  # credits: the receiver is never overrun
    assert out["tcp_batch_vs_single_fetch_throughput"] > 0
