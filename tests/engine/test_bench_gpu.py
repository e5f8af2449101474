"""``python -m tierkv.bench.gpu`` on CPU: every measured copy is checked against a plain-indexing
reference, a wrong copy fails the run, the first-layer latency leaves out the warm-up, and the
headline holds one configuration per operation. Figures on CPU mean nothing; the checks are real.
No test here bounds a time: where timing logic is under test, the benchmark reads a fake clock."""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

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


def test_the_result_has_every_field_for_every_path() -> None:
    """What a GPU run records (docs/benchmarks.md): per case its shape, the baselines, GB/s and
    ratios per path and operation; the headline per operation. Figures are positive and finite."""
    r = cpu_run()
    assert r["device"] == "cpu" and r["runs"] == 1 and isinstance(r["kernel_available"], bool)
    engine, tiers = r["engine"], r["tiers"]
    assert isinstance(engine, list) and isinstance(tiers, list)
    assert [(c["layout"], c["blocks"]) for c in engine] == [("flash-l4-h2-d64", 64)]
    assert [t["blocks"] for t in tiers] == [64]
    for case, ops in [*((c, OPS) for c in engine), *((t, {"hbm_to_dram", "dram_to_hbm"}) for t in tiers)]:
        assert set(case["baseline_gbps"]) == {"h2d", "d2h", "d2d"}
        assert set(case["gbps"]) == set(case["ratios"]) == {"torch", "kernel"}
        for path in ("torch", "kernel"):
            extra = {"layerwise_first_layer_ms"} if "layout" in case else set()
            assert set(case["gbps"][path]) == ops | extra and set(case["ratios"][path]) == ops
            figures = [*case["gbps"][path].values(), *case["ratios"][path].values()]
            assert all(math.isfinite(v) and v > 0 for v in figures)
    c = engine[0]
    assert c["page_bytes"] == 4 * 2 * 16 * 2 * 64 * 2 and c["mib"] == round(64 * c["page_bytes"] / 2**20, 1)
    h = r["headline"]
    assert isinstance(h, dict)
    assert set(h) == {"worst_ratio", "config", "target", "meets_target", "by_config"} and h["target"] == gpu.TARGET
    assert set(h["worst_ratio"]) == set(h["by_config"]) == set(h["config"])
    assert all(h["config"][op] in h["by_config"][op] for op in h["config"])


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


class FakeClock:
    """The benchmark's ``time`` module: each ``perf_counter()`` call advances it by one tick, and
    ``stall(s)`` advances it by ``s`` seconds without waiting. Ticks are a power of two, so
    differences are exact."""

    TICK = 2.0**-10

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += self.TICK
        return self.now

    def stall(self, seconds: float) -> None:
        self.now += seconds


def test_first_layer_latency_leaves_out_the_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first load stalls 0.5 s on the benchmark's clock; every load's first layer takes
    one tick. With one timed run, a median that kept the warm-up would be about 250 ms; the
    reported figure is the tick alone, on every path."""
    clock = FakeClock()
    monkeypatch.setattr(gpu, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    calls: list[int] = []
    real = gpu.load_layers

    def cold_then_warm(*a: object, **kw: object) -> object:
        if not calls:
            clock.stall(0.5)
        calls.append(1)
        return real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(gpu, "load_layers", cold_then_warm)
    case = cpu_run()["engine"][0]  # type: ignore[index]
    assert case["verified"] is True
    assert len(calls) == 2 * 2  # two paths, each one warm-up and one timed run
    for path in ("torch", "kernel"):
        assert case["gbps"][path]["layerwise_first_layer_ms"] == pytest.approx(1e3 * FakeClock.TICK, abs=1e-3)


def test_headline_holds_one_configuration_across_cases() -> None:
    """Config x is worst at 0.6, y at 0.5: the headline is x's 0.6, not the best of each case mixed."""
    cases: list[dict[str, object]] = [{"ratios": {"x": {"gather_d2h": 1.0}, "y": {"gather_d2h": 0.5}}},
                                      {"ratios": {"x": {"gather_d2h": 0.6}, "y": {"gather_d2h": 0.9}}}]
    h = gpu._headline(cases)
    assert h["config"] == {"gather_d2h": "x"} and h["worst_ratio"] == {"gather_d2h": 0.6}
    assert h["by_config"] == {"gather_d2h": {"x": 0.6, "y": 0.5}} and h["meets_target"] is False
