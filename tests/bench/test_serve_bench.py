"""``tierkv bench serve --quick``, end to end: a daemon, clients in their own processes,
the in-process baseline, the lookups of a new and of a wholly cached prompt. What it
measures is the benchmark's to report (docs/benchmarks.md); this checks what it returns."""

from __future__ import annotations

from pathlib import Path

from tierkv.bench.serve import run_serve_bench


def test_the_quick_run_returns_every_figure_and_verifies_its_bytes(tmp_path: Path) -> None:
    r = run_serve_bench(quick=True, where=str(tmp_path))
    assert r["verified"] is True
    for key in ("lookup_p50_us", "lookup_p99_us", "inprocess_lookup_p50_us", "lookup_cached_p50_us",
                "lookup_cached_p99_us", "inprocess_lookup_cached_p50_us", "inprocess_lookup_cached_p99_us"):
        assert r[key] > 0, key
    assert r["lookup_p50_us"] <= r["lookup_p99_us"] and r["lookup_cached_p50_us"] <= r["lookup_cached_p99_us"]
    assert isinstance(r["shmem_huge_pages"], str) and r["shmem_huge_pages"]
    assert r["put_vs_inprocess"] > 0 and r["get_vs_inprocess"] > 0
