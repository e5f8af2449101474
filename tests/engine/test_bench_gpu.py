"""``python -m tierkv.bench.gpu`` on CPU: every measured copy is checked against a plain-indexing
reference, a wrong copy fails the run, the first-layer latency leaves out the warm-up, and the
headline holds one configuration per operation. Figures on CPU mean nothing; the checks are real."""

from __future__ import annotations

import argparse
import json
import time

import pytest
import torch

from tierkv.bench import gpu
from tierkv.engine import EngineKV

OPS = {"gather_d2h", "scatter_h2d", "gather_d2d", "scatter_d2d", "layerwise_h2d"}


def cpu_run() -> dict[str, object]:
    return gpu.run(argparse.Namespace(device="cpu", quick=False, runs=1))


def test_cpu_run_checks_every_copy(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu.main(["--device", "cpu", "--json", "--runs", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["verified"] is True and "error" not in r
    cases = [*r["engine"], *r["tiers"]]
    assert cases and all(c["verified"] is True for c in cases)
    assert set(r["engine"][0]["ratios"]["kernel"]) == OPS
    assert set(r["tiers"][0]["ratios"]["kernel"]) == {"hbm_to_dram", "dram_to_hbm"}
    assert set(r["headline"]["config"]) == OPS | {"hbm_to_dram", "dram_to_hbm"}


def test_a_scatter_that_does_nothing_fails_the_run(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(EngineKV, "scatter", lambda self, pages, block_ids, rows=None, layers=None: None)
    assert gpu.main(["--device", "cpu", "--json", "--runs", "1"]) == 1
    out = capsys.readouterr()
    r = json.loads(out.out)
    case = r["engine"][0]
    assert r["verified"] is False and case["verified"] is False and "FAILED verification" in out.err
    for label in ("torch", "kernel"):
        assert f"{label} scatter_h2d" in case["error"] and f"{label} scatter_d2d" in case["error"]
        assert f"{label} gather_d2h" not in case["error"]
    assert all(t["verified"] for t in r["tiers"])


def test_one_wrong_byte_in_a_gather_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = EngineKV.gather

    def off_by_one(self: EngineKV, block_ids: object, out: torch.Tensor | None = None, rows: object = None,
                   layers: object = None) -> torch.Tensor:
        pages = real(self, block_ids, out, rows, layers)  # type: ignore[arg-type]
        if pages.device.type == "cpu" and pages.shape[0] == len(block_ids):  # type: ignore[arg-type]
            pages[int(rows[0]), 5] ^= 1  # type: ignore[index]  # the host pages only: gather_d2h
        return pages

    monkeypatch.setattr(EngineKV, "gather", off_by_one)
    case = cpu_run()["engine"][0]  # type: ignore[index]
    assert case["verified"] is False
    assert "gather_d2h" in case["error"] and "gather_d2d" not in case["error"]


def test_tier_copies_that_do_nothing_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "hbm_to_dram", lambda *a: None)
    monkeypatch.setattr(gpu, "dram_to_hbm", lambda *a: None)
    r = cpu_run()
    tiers = r["tiers"][0]  # type: ignore[index]
    assert r["verified"] is False and tiers["verified"] is False
    assert all(f"{p} {op}" in tiers["error"] for p in ("torch", "kernel") for op in ("hbm_to_dram", "dram_to_hbm"))
    assert all(c["verified"] for c in r["engine"])  # type: ignore[attr-defined]


def test_first_layer_latency_leaves_out_the_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold first call of 0.5 s must not reach the first-layer median (one timed run here)."""
    calls: list[int] = []
    real = gpu.load_layers

    def cold_then_warm(*a: object, **kw: object) -> object:
        if not calls:
            time.sleep(0.5)
        calls.append(1)
        return real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(gpu, "load_layers", cold_then_warm)
    case = cpu_run()["engine"][0]  # type: ignore[index]
    assert case["verified"] is True
    assert case["gbps"]["torch"]["layerwise_first_layer_ms"] < 100  # the warm-up alone took 500


def test_headline_holds_one_configuration_across_cases() -> None:
    """Config x is worst at 0.6, y at 0.5: the headline is x's 0.6, not the best of each case mixed."""
    cases: list[dict[str, object]] = [{"ratios": {"x": {"gather_d2h": 1.0}, "y": {"gather_d2h": 0.5}}},
                                      {"ratios": {"x": {"gather_d2h": 0.6}, "y": {"gather_d2h": 0.9}}}]
    h = gpu._headline(cases)
    assert h["config"] == {"gather_d2h": "x"} and h["worst_ratio"] == {"gather_d2h": 0.6}
    assert h["by_config"] == {"gather_d2h": {"x": 0.6, "y": 0.5}} and h["meets_target"] is False
