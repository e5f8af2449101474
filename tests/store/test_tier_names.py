"""Tiers told apart by name: two NVMe tiers in one store, through the real manager, copy
table, index, labels and stats.

The config has one ``[tiers.nvme]``, so the tiers are built here and handed to the
store's opening in place of the config's (``build_tiers``); everything after that is
the store's own code: geometry and labels per name, plans and demotions between the
two, one index database per name, and a reopen that finds every page where it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

import tierkv.store.opening as opening
from tests.conftest import LAYOUT, PB, make_config, page_data
from tierkv.config import StoreConfig
from tierkv.errors import InputError
from tierkv.policy import make_policy
from tierkv.store import transfer
from tierkv.store.api import Store
from tierkv.store.index import PersistentIndex
from tierkv.store.index_runs import live_records
from tierkv.store.manager import BlockManager
from tierkv.tiers.base import Tier, TierId, TierKind
from tierkv.tiers.dram import DramTier
from tierkv.tiers.nvme import NvmeTier

TPP = LAYOUT.tokens_per_page


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed + 700).integers(0, 50000, pages * TPP, dtype=np.int64)


@pytest.fixture
def two_nvme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StoreConfig:
    """A store of two NVMe tiers on two files: ``nvme`` (4 pages) above ``nvme-b`` (16)."""
    cfg = make_config(tmp_path / "store", dram_pages=0, nvme_pages=4, policy="lru")

    def build(c: StoreConfig, read_only: bool) -> list[Tier]:
        store_dir = Path(c.path)
        return [NvmeTier(store_dir / f"{name}.data", pages, PB, header_bytes=opening.LABEL_BYTES,
                         create=not read_only, defer_grow=True, name=name)
                for name, pages in (("nvme", 4), ("nvme-b", 16))]

    monkeypatch.setattr(opening, "build_tiers", build)
    return cfg


def test_two_nvme_tiers_in_one_store(two_nvme: StoreConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    copies: list[tuple[str, str]] = []

    def nvme_to_nvme(src: Tier, src_slots: Sequence[int], dst: Tier, dst_slots: Sequence[int],
                     nbytes: int) -> np.ndarray:
        copies.append((src.name, dst.name))
        return transfer.staged_copy(src, src_slots, dst, dst_slots, nbytes)[0]

    # The copy table still dispatches on kinds: an (nvme, nvme) entry serves nvme -> nvme-b.
    monkeypatch.setitem(transfer.COPY_TABLE, (TierKind.NVME, TierKind.NVME), nvme_to_nvme)
    prompts = {seed: (prompt(seed, 4), page_data(seed, 4)) for seed in range(4)}
    with Store.open(two_nvme) as s:
        for tokens, data in prompts.values():
            assert s.put(tokens, data).stored == 4
        stats = s.stats()
        assert {name: (t.kind, t.capacity_slots, t.used_slots) for name, t in stats.tiers.items()} == {
            "nvme": ("nvme", 4, 4), "nvme-b": ("nvme", 16, 12)}
        assert copies and set(copies) == {("nvme", "nvme-b")}
        # New pages land in the faster one; the slower one fills with demotions only.
        assert stats.bytes_moved["nvme->nvme-b"] == stats.tiers["nvme-b"].bytes_written == 12 * PB
        for tokens, data in prompts.values():
            out = np.zeros_like(data)
            got = s.get(tokens, out)
            assert got.pages == 4 and np.array_equal(out, data)
            assert set(got.tiers) == {TierKind.NVME}      # results report kinds
        assert s.stats().tiers["nvme-b"].hits > 0
    with Store.open(two_nvme) as s:                      # both tiers' records come back (promoted
        tiers = s.stats().tiers                          # pages keep their copy below: inclusive)
        assert tiers["nvme"].used_slots == 4 and tiers["nvme-b"].used_slots >= 12
        for tokens, data in prompts.values():
            out = np.zeros_like(data)
            assert s.get(tokens, out).pages == 4 and np.array_equal(out, data)
    index = PersistentIndex(Path(two_nvme.path), ["nvme", "nvme-b"], read_only=True)
    try:
        assert len(live_records(index, "nvme")) + len(live_records(index, "nvme-b")) >= 16
        assert index.has_labelled("nvme") and index.has_labelled("nvme-b")
    finally:
        index.close()


def test_two_tiers_of_one_name_are_refused(tmp_path: Path) -> None:
    with NvmeTier(tmp_path / "a", 2, PB) as a, NvmeTier(tmp_path / "b", 2, PB) as b, \
            pytest.raises(InputError, match="share a name"):
        BlockManager([a, b], {a.name: make_policy("lru")}, None)
    with DramTier(2, PB, name="peer") as d, pytest.raises(InputError, match="cannot be named 'peer'"):
        BlockManager([d], {TierId("peer"): make_policy("lru")}, None)
