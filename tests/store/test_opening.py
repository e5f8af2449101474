"""Tier construction by table: one builder per tier kind, fastest first."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import tierkv.store.opening as opening
from tests.conftest import PB, make_config
from tierkv.config import NvmeConfig, StoreConfig
from tierkv.errors import ConfigError
from tierkv.store.api import Store
from tierkv.tiers.base import Tier, TierKind
from tierkv.tiers.blocks import BlockPageTier
from tierkv.tiers.dram import DramTier
from tierkv.tiers.nvme import NvmeTier


def test_one_builder_per_store_tier_kind_fastest_first() -> None:
    assert list(opening.TIER_BUILDERS) == sorted(set(TierKind) - {TierKind.PEER}, key=lambda k: k.rank)


def test_the_store_builds_its_tiers_from_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def dram(cfg: StoreConfig, read_only: bool) -> Tier | None:
        return None if read_only else DramTier(3, cfg.layout.page_bytes, name="dram-small")

    monkeypatch.setitem(opening.TIER_BUILDERS, TierKind.DRAM, dram)
    with Store.open(make_config(tmp_path / "s", dram_pages=8, nvme_pages=8)) as s:
        assert {n: t.capacity_slots for n, t in s.stats().tiers.items()} == {"dram-small": 3, "nvme": 8}


@pytest.mark.parametrize(("codec", "kind"), [("none", NvmeTier), ("lossless", BlockPageTier)])
def test_one_codec_branch_serves_every_file_tier(tmp_path: Path, codec: str, kind: type) -> None:
    cfg = dataclasses.replace(make_config(tmp_path, dram_pages=0), nvme=NvmeConfig(5 * PB, codec=codec))
    tiers = opening.build_tiers(cfg, read_only=False)
    try:
        [t] = tiers
        assert isinstance(t, kind) and (t.kind, t.name, t.num_slots) == (TierKind.NVME, "nvme", 5)
    finally:
        for t in tiers:
            t.close()


def test_a_failing_builder_closes_the_tiers_built_before_it(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Tier] = []

    def dram(cfg: StoreConfig, read_only: bool) -> Tier | None:
        built.append(DramTier(2, cfg.layout.page_bytes))
        return built[-1]

    def nvme(cfg: StoreConfig, read_only: bool) -> Tier | None:
        raise ConfigError("no room for the nvme tier")

    monkeypatch.setitem(opening.TIER_BUILDERS, TierKind.DRAM, dram)
    monkeypatch.setitem(opening.TIER_BUILDERS, TierKind.NVME, nvme)
    with pytest.raises(ConfigError, match="no room"):
        opening.build_tiers(make_config(tmp_path / "s"), read_only=False)
    assert built and not built[0].available  # closed
