"""Demotions in runs: the last copies a tier evicts move down with one reservation below.

A full DRAM tier over an NVMe tier (the steady state of a serving node) demotes a
batch's worth of pages at every put; they used to move one by one, each reserving one
slot below (a scan of the tier's free map per page). Real store (O_DIRECT file, LMDB
index): the bytes come back from the tier below, the table stays consistent, and a run
the tier below cannot take is dropped leaf first as before, not kept whole.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import LAYOUT, PB, make_config
from tierkv.store.api import Store
from tierkv.tiers.base import Tier, tier_id

TPP = LAYOUT.tokens_per_page


def _prompt(i: int, pages: int) -> list[int]:
    return list(range(i * 10_000, i * 10_000 + pages * TPP))


def _pages(i: int, pages: int) -> np.ndarray:
    return (np.arange(pages * PB, dtype=np.int64).reshape(pages, PB) * 7 + i).astype(np.uint8)


@pytest.mark.parametrize("policy", ["gittins", "lru-leaf", "lru", "s3fifo"])
def test_a_run_of_last_copies_moves_down_with_one_reservation(tmp_path: Path, policy: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    with Store.open(make_config(tmp_path / "s", dram_pages=8, nvme_pages=32, policy=policy)) as s:
        nvme = s._manager.tier(tier_id("nvme"))
        calls: list[int] = []
        allocate = Tier.allocate

        def counting(self: Tier, n: int, contiguous: bool = False) -> list[int]:
            if self is nvme:
                calls.append(n)
            return allocate(self, n, contiguous)

        monkeypatch.setattr(Tier, "allocate", counting)
        assert s.put(_prompt(0, 8), _pages(0, 8)).stored == 8
        assert s.put(_prompt(1, 8), _pages(1, 8)).stored == 8   # the first prompt goes down
        stats = s.stats()
        assert stats.evictions == 8 and stats.tiers["nvme"].used_slots == 8
        assert calls == [8], f"{policy}: the NVMe tier reserved {calls} for one run of 8 demotions"
        s._manager.check()
        out = np.zeros((8, PB), np.uint8)
        got = s.get(_prompt(0, 8), out)
        assert got.pages == 8 and np.array_equal(out, _pages(0, 8))
        s._manager.check()


@pytest.mark.parametrize("policy", ["gittins", "lru-leaf"])
def test_a_run_the_tier_below_cannot_take_is_dropped_leaf_first(tmp_path: Path, policy: str) -> None:
    """The NVMe tier is full of pinned pages: the DRAM victims (one prompt, leaf first)
    cannot go down. Each is dropped once its child is, so the new prompt gets every slot;
    keeping those whose child was still cached when the run began left it one."""
    with Store.open(make_config(tmp_path / "s", dram_pages=4, nvme_pages=4, policy=policy)) as s:
        assert s.put(_prompt(0, 4), _pages(0, 4)).stored == 4
        assert s.put(_prompt(1, 4), _pages(1, 4)).stored == 4   # prompt 0 down to NVMe
        assert s.pin(_prompt(0, 4)) == 4
        assert s.put(_prompt(2, 4), _pages(2, 4)).stored == 4   # prompt 1 cannot go down
        assert s.lookup(_prompt(1, 4)).cached_pages == 0
        assert s.lookup(_prompt(2, 4)).cached_pages == 4
        s._manager.check()
        out = np.zeros((4, PB), np.uint8)
        assert s.get(_prompt(2, 4), out).pages == 4 and np.array_equal(out, _pages(2, 4))
        assert s.get(_prompt(0, 4), out).pages == 4 and np.array_equal(out, _pages(0, 4))
        s._manager.check()


def _assert_written_down(nvme: object, rows: np.ndarray, sums: list[int] | None) -> None:
    """DRAM slots 3 and 2 (rows 2 and 0 written there) are NVMe slots 1 and 0 now, with
    the checksums of their bytes."""
    from tierkv.store.checksum import checksum64

    out = np.zeros((2, rows.shape[1]), np.uint8)
    nvme.read([1, 0], out)  # type: ignore[attr-defined]
    assert np.array_equal(out, rows[[2, 0]]) and sums == [checksum64(rows[2]), checksum64(rows[0])]


@pytest.mark.parametrize("page", [4096, 6000])
def test_dram_pages_are_written_down_from_their_slots(tmp_path: Path, page: int) -> None:
    """direct_copy hands the NVMe tier the DRAM slots themselves, marked aligned where the
    slots are (so O_DIRECT writes them in place, no per-row check), else bounced; the
    bytes and checksums are the slots'."""
    from tierkv.store.transfer import direct_copy
    from tierkv.tiers.dram import DramTier
    from tierkv.tiers.nvme import NvmeTier

    dram, nvme = DramTier(4, page), NvmeTier(tmp_path / "nvme.data", 4, page)
    try:
        rows = np.random.default_rng(page).integers(0, 256, (3, page), dtype=np.uint8)
        dram.write([2, 0, 3], rows)
        staged, sums = direct_copy(dram, [3, 2], nvme, [1, 0], page)
        assert staged.aligned == (page % 4096 == 0)
        _assert_written_down(nvme, rows, sums)
    finally:
        dram.close()
        nvme.close()


@pytest.mark.parametrize("mode", ["never", "advise"])
def test_a_pool_without_huge_pages_is_written_down_through_the_bounce_buffers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """A DRAM tier whose memfd the kernel gives no huge pages (``shmem_enabled`` never) hands
    its slots down marked scattered: the NVMe tier moves them through its huge-page bounce
    buffers even though they are aligned (a direct write from scattered 4 KiB pages ran at
    half the speed here); one on huge pages is written in place. Bytes and checksums are
    the slots' either way."""
    import tierkv.tiers.dram as dram_mod
    from tierkv.store.transfer import direct_copy
    from tierkv.tiers.dram import DramTier
    from tierkv.tiers.nvme import NvmeTier

    monkeypatch.setattr(dram_mod, "shmem_huge_pages", lambda: mode)
    page = 8192
    dram, nvme = DramTier(4, page), NvmeTier(tmp_path / "nvme.data", 4, page)
    try:
        assert dram.huge_pages == (mode == "advise")
        bounced: list[int] = []
        real = nvme._bounce.borrow

        def borrow() -> object:
            bounced.append(1)
            return real()

        monkeypatch.setattr(nvme._bounce, "borrow", borrow)
        rows = np.random.default_rng(7).integers(0, 256, (3, page), dtype=np.uint8)
        dram.write([2, 0, 3], rows)
        staged, sums = direct_copy(dram, [3, 2], nvme, [1, 0], page)
        assert staged.aligned and staged.scattered == (mode == "never")
        assert staged[:1].scattered == staged.take([1]).scattered == staged.scattered   # kept by views
        assert bool(bounced) == (mode == "never")
        _assert_written_down(nvme, rows, sums)
    finally:
        dram.close()
        nvme.close()
