"""Tests of tierkv.workload.replay: real store (DRAM + O_DIRECT file NVMe tier + LMDB) under a workload."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tierkv.store.api", reason="the store (tierkv.store.api) is not built yet")

from tierkv.store.api import Store  # noqa: E402
from tierkv.errors import ConfigError, CorruptPageError  # noqa: E402
from tierkv.workload.replay import (DEFAULT_PAGE_BYTES, PagePattern, ReplayResult, ReplayVerifyError,  # noqa: E402
                           default_capacities, replay_config, replay_layout, run_replay)
from tierkv.workload import Request, read_mooncake, synthetic  # noqa: E402

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
PAGE = 4096  # small pages keep the tests fast; O_DIRECT still needs 4 KiB alignment


@pytest.fixture(scope="module")
def small_synthetic() -> list[Request]:
    return synthetic(0, 300)


def _check_consistent(r: ReplayResult, n_requests: int) -> None:
    assert r.requests == n_requests
    for rate in (r.prefix_hit_rate, r.unbounded_hit_rate, r.prefill_tokens_from_cache_frac, *r.tier_hit_rate.values()):
        assert 0.0 <= rate <= 1.0
    assert math.isclose(sum(r.tier_hit_rate.values()), r.prefix_hit_rate, abs_tol=1e-12)
    assert r.prefix_hit_rate <= r.unbounded_hit_rate + 1e-12
    assert r.blocks_hit == round(r.prefix_hit_rate * r.blocks_requested)
    assert r.tokens_from_cache == r.blocks_hit * 512
    assert r.pages_verified == r.blocks_hit
    assert r.pages_stored + r.pages_already_present + r.pages_refused == r.blocks_requested
    assert set(r.bandwidth_gbps) == set(r.bytes_moved)
    assert all(v >= 0 for v in r.bandwidth_gbps.values())
    stored = sum(n for pair, n in r.bytes_moved.items() if pair.startswith("caller->"))
    loaded = sum(n for pair, n in r.bytes_moved.items() if pair.endswith("->caller"))
    assert stored == r.pages_stored * PAGE
    assert loaded == r.blocks_hit * PAGE
    doc = json.loads(json.dumps(r.to_dict()))
    for key in ("requests", "prefix_hit_rate", "tier_hit_rate", "bytes_moved", "bandwidth_gbps",
                "prefill_tokens_from_cache_frac", "pages_verified", "wall_s", "config"):
        assert key in doc
    assert doc["config"]["page_bytes"] == PAGE


def test_synthetic_replay_uses_both_tiers(tmp_path: Path, small_synthetic: list[Request]) -> None:
    cfg = replay_config(tmp_path / "store", PAGE, 240 * PAGE, 500 * PAGE)
    r = run_replay(small_synthetic, cfg, progress=False)
    _check_consistent(r, 300)
    assert r.bytes_moved["dram->nvme"] > 0  # DRAM is too small for the working set
    assert r.tier_hit_rate["dram"] > 0 and r.tier_hit_rate["nvme"] > 0
    assert r.bytes_moved["nvme->dram"] > 0  # NVMe hits are promoted
    assert r.prefix_hit_rate > 0.5
    assert r.config["dram_pages"] == 240 and r.config["nvme_pages"] == 500


def test_replay_is_deterministic_and_dram_only_works(tmp_path: Path, small_synthetic: list[Request]) -> None:
    reqs = small_synthetic[:150]
    a = run_replay(reqs, replay_config(tmp_path / "a", PAGE, 240 * PAGE, None), progress=False)
    b = run_replay(iter(reqs), replay_config(tmp_path / "b", PAGE, 240 * PAGE, None), progress=False)
    assert set(a.tier_hit_rate) == {"dram"}
    assert "dram->nvme" not in a.bytes_moved
    assert (a.blocks_hit, a.pages_stored, dict(a.bytes_moved)) == (b.blocks_hit, b.pages_stored, dict(b.bytes_moved))
    _check_consistent(a, 150)


def test_tenants_sharing_block_ids_share_nothing(tmp_path: Path) -> None:
    """The same blocks from two tenants: no hit, and the unbounded-cache bound says so too."""
    tpp = replay_config(tmp_path / "x", PAGE, 64 * PAGE, None).layout.tokens_per_page
    reqs = [Request(0.0, (1, 2, 3), 3 * tpp, 1, tenant="alice"), Request(1.0, (1, 2, 3), 3 * tpp, 1, tenant="bob")]
    r = run_replay(reqs, replay_config(tmp_path / "s", PAGE, 64 * PAGE, None), progress=False)
    assert r.prefix_hit_rate == 0.0 and r.unbounded_hit_rate == 0.0


@pytest.mark.skipif(not TRACE.is_file(), reason="Mooncake trace not present")
def test_trace_prefix_replay(tmp_path: Path) -> None:
    reqs = list(read_mooncake(TRACE, limit=300))
    cfg = replay_config(tmp_path / "store", PAGE, 480 * PAGE, 1500 * PAGE)
    r = run_replay(reqs, cfg, progress=False)
    _check_consistent(r, 300)
    assert r.bytes_moved["dram->nvme"] > 0
    assert r.blocks_hit > 0 and r.pages_verified > 0
    assert r.prompt_tokens == sum(q.input_tokens for q in reqs)


def test_reopened_store_serves_the_second_replay(tmp_path: Path, small_synthetic: list[Request]) -> None:
    cfg = replay_config(tmp_path / "store", PAGE, 240 * PAGE, 4000 * PAGE)
    reqs = small_synthetic[:60]
    run_replay(reqs, cfg, progress=False)
    again = run_replay(reqs, cfg, progress=False)  # the NVMe tier and index persist
    assert again.prefix_hit_rate > 0.9 and again.pages_verified == again.blocks_hit


@pytest.fixture
def scribbling_get(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make Store.get flip one byte of the last page it loads (a store returning wrong data)."""
    real_get = Store.get

    def get(self: Store, tokens: object, out: np.ndarray, tenant: str = ""):  # type: ignore[no-untyped-def]
        result = real_get(self, tokens, out, tenant=tenant)  # type: ignore[arg-type]
        if result.pages:
            out[result.pages - 1, 100] ^= 0xFF
        return result

    monkeypatch.setattr(Store, "get", get)
    yield


@pytest.mark.usefixtures("scribbling_get")
def test_wrong_bytes_are_a_hard_error(tmp_path: Path, small_synthetic: list[Request]) -> None:
    cfg = replay_config(tmp_path / "store", PAGE, 240 * PAGE, None)
    with pytest.raises(ReplayVerifyError, match="does not hold block") as info:
        run_replay(small_synthetic[:50], cfg, progress=False)
    assert isinstance(info.value, CorruptPageError)
    unchecked = run_replay(small_synthetic[:50], replace_path(cfg, tmp_path / "b"), progress=False, verify=False)
    assert unchecked.pages_verified == 0 and unchecked.blocks_hit > 0


def replace_path(cfg, path: Path):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    return replace(cfg, path=str(path))


def test_page_pattern_catches_swaps_shifts_and_zeros() -> None:
    pat = PagePattern(PAGE)
    ids = np.array([5, 6, 7], dtype=np.uint64)
    rows = np.empty((3, PAGE), dtype=np.uint8)
    pat.fill(rows, ids)
    assert pat.mismatches(rows, ids).size == 0
    assert pat.mismatches(rows[::-1].copy(), ids).tolist() == [0, 2]
    shifted = np.roll(rows, 8, axis=1)
    assert pat.mismatches(shifted, ids).tolist() == [0, 1, 2]
    torn = rows.copy()
    torn[1, PAGE // 2:] = rows[2, PAGE // 2:]
    assert pat.mismatches(torn, ids).tolist() == [1]
    assert pat.mismatches(np.zeros_like(rows), ids).tolist() == [0, 1, 2]


def test_layout_and_capacity_helpers(small_synthetic: list[Request]) -> None:
    layout = replay_layout(DEFAULT_PAGE_BYTES)
    assert layout.page_bytes == DEFAULT_PAGE_BYTES and layout.tokens_per_page == 512 and layout.head_dim == 32
    for bad in (0, 1000, 2048 + 512):
        with pytest.raises(ConfigError, match="multiple of 2048"):
            replay_layout(bad)
    dram, nvme = default_capacities(small_synthetic, PAGE)
    largest = max(r.full_blocks(512) for r in small_synthetic)
    assert dram >= 2 * largest * PAGE and nvme >= 4 * largest * PAGE and nvme > dram
    assert dram % PAGE == 0 and nvme % PAGE == 0
