"""``tierkv bench net``: every case measured against a real server process, ratios of the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.bench import net
from tierkv.cli import main


def test_bench_net_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "net", "--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cases = {(r["kind"], r["case"]) for r in out["results"]}
    assert {("tcp", "fetch-1"), ("tcp", "fetch-batch"), ("tcp", "incast-credits"), ("tcp", "incast-no-credits")} <= cases
    assert all(r["misses"] == 0 for r in out["results"])
    assert out["tcp_incast_naks_with_credits"] == 0  # credits: the receiver is never overrun
    assert out["tcp_batch_vs_single_fetch_throughput"] > 0


def test_module_help_runs_no_benchmark() -> None:
    proc = subprocess.run([sys.executable, "-m", "tierkv.bench.net", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python3 -m tierkv.bench.net")
    assert "--json" in proc.stdout and "fetch-1" not in proc.stdout


def test_module_main_json_and_default_lines(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert net.main(["--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tcp_incast_naks_with_credits"] == 0 and {r["case"] for r in out["results"]} >= {"fetch-1"}
    seen: list[dict[str, int]] = []
    row = net.NetBenchResult("tcp", "fetch-1", 1.0, 2.0, 3.0, 4.0, 0, 0)
    monkeypatch.setattr(net, "bench_local", lambda **kw: seen.append(kw) or [row])
    assert net.main([]) == 0
    assert capsys.readouterr().out == f"{row}\n" and seen == [{"pages": 64, "fetches": 500}]  # as before: full sizes
