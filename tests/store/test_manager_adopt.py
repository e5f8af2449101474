"""Reopening persistent tiers whose indexes disagree after a crash.

A demotion NVMe -> NVMe-oF commits the page's NVMe-oF record first and the NVMe delete
with a later commit; a crash in between leaves the key recorded in both tiers. Real
tiers (O_DIRECT files, the NVMe-oF tier over a file) and a real LMDB index.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tierkv.store.index import IndexRecord, PersistentIndex
from tierkv.keys import PageKey
from tierkv.store.manager import BlockManager
from tierkv.policy import make_policy
from tierkv.tiers.aligned import round_up
from tierkv.tiers.base import TierId
from tierkv.tiers.nvme import NvmeTier
from tierkv.tiers.nvmeof import NvmeofTier, StaticLink

PAGE = 8192
K = PageKey(bytes(range(16)))
NVME, NVMEOF = TierId("nvme"), TierId("nvmeof")  # the tiers' names: their kinds' unless given others


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[PersistentIndex, NvmeTier, NvmeofTier]]:
    ns = tmp_path / "ns.img"
    with open(ns, "wb") as f:
        f.truncate(8 * round_up(PAGE))
    nvme = NvmeTier(tmp_path / "nvme.data", 4, PAGE)
    fabric = NvmeofTier(StaticLink(ns), 8, PAGE)
    index = PersistentIndex(tmp_path, ["nvme", "nvmeof"])
    yield index, nvme, fabric
    nvme.close()
    fabric.close()
    index.close()


def manager(index: PersistentIndex, nvme: NvmeTier, fabric: NvmeofTier) -> BlockManager:
    m = BlockManager([nvme, fabric], {t.name: make_policy("lru") for t in (nvme, fabric)}, index)
    m.adopt_persistent(nvme.name)
    m.adopt_persistent(fabric.name)
    return m


def test_a_page_recorded_in_two_tiers_keeps_both_copies(parts: tuple[PersistentIndex, NvmeTier, NvmeofTier]) -> None:
    index, nvme, fabric = parts
    index.commit("nvme", put=[IndexRecord(K, 2, PAGE, 77, None)])
    index.commit("nvmeof", put=[IndexRecord(K, 5, PAGE, 77, None)])
    m = manager(index, nvme, fabric)
    loc = m.locate(K)
    assert loc is not None and dict(loc.slots) == {NVME: 2, NVMEOF: 5}
    assert m.used_slots(NVME) == 1 and m.used_slots(NVMEOF) == 1
    # Filling NVMe evicts K from it: no KeyError, no leaked slot, the NVMe-oF copy stays.
    new = [(PageKey(bytes([i]) * 16), None) for i in range(1, 5)]
    m.plan_store(new, PAGE)
    loc = m.locate(K)
    assert loc is not None and dict(loc.slots) == {NVMEOF: 5}
    assert m.used_slots(NVME) == 4


def test_a_key_recorded_with_other_bytes_in_another_tier_is_trusted_nowhere(
        parts: tuple[PersistentIndex, NvmeTier, NvmeofTier]) -> None:
    index, nvme, fabric = parts
    index.commit("nvme", put=[IndexRecord(K, 2, PAGE, 77, None)])
    index.commit("nvmeof", put=[IndexRecord(K, 5, PAGE, 78, None)])
    m = manager(index, nvme, fabric)
    assert m.locate(K) is None
    assert m.used_slots(NVME) == 0 and m.used_slots(NVMEOF) == 0
    assert index.get_many("nvme", [K]) == [None] and index.get_many("nvmeof", [K]) == [None]
