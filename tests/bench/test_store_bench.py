"""The DRAM figures of ``tierkv bench store`` (:mod:`tierkv.bench.store`), at a size
that runs in a second: every figure there, and the bytes checked."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tierkv.bench import store as bench


def test_the_dram_figures_are_all_there_and_checked() -> None:
    # 16 pages of 256 KiB: rows and a batch large enough for the streaming copies both ways.
    out: dict[str, Any] = bench.bench_store_dram(256 << 10, 16, 2)
    for key in ("dram_put", "dram_get", "tier_scattered_put", "tier_scattered_get"):
        assert out[f"{key}_gbps"] > 0 and len(out[f"{key}_runs"]) == 2, key
    for key in ("dram_put", "dram_get", "tier_scattered_put", "tier_scattered_get"):
        assert out[f"{key}_vs_memcpy"] == pytest.approx(out[f"{key}_gbps"] / out["memcpy_gbps"])


def test_the_scattered_copy_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier that reads back other bytes fails the benchmark instead of timing it."""
    from tierkv.tiers.dram import DramTier

    real = DramTier.read

    def wrong(self: DramTier, slots: list[int], dst: np.ndarray, **kw: object) -> None:
        real(self, slots, dst)
        dst[-1, -1] ^= 1
    monkeypatch.setattr(DramTier, "read", wrong)
    src = np.random.default_rng(0).integers(0, 256, (4, 32 << 10), dtype=np.uint8)
    with pytest.raises(ValueError, match="differ"):
        bench.bench_tier_rows(src, 2)
