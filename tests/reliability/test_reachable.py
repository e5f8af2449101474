"""No page is kept that nobody can reach: every cached or persisted page has its whole prefix.

A lookup walks a prompt's pages from the first and stops at the first miss, so a page
whose parent has left the store is dead weight (issue 28 item 11: with ``policy =
"lru"``, persisted pages were unreachable after a clean close). Real store: a small
DRAM tier over a small NVMe tier (O_DIRECT file, LMDB index), prompts that share
prefixes, churn enough to evict from both tiers, a clean close, the records read back
from the LMDB file itself, then a reopen. Run for every store policy. Then the paths
where a page leaves the store by force (a quarantine, a failed write) and an index
left by a crash, on the manager with real tiers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import LAYOUT, PB, make_config
from tierkv.keys import PageKey, split_keys
from tierkv.policy import POLICY_NAMES, make_policy
from tierkv.store.api import Store
from tierkv.store.index import IndexRecord, PersistentIndex
from tierkv.store.index_runs import live_records
from tierkv.store.manager import BlockManager
from tierkv.store.moves import MovePlan
from tierkv.tiers.dram import DramTier
from tierkv.tiers.nvme import NvmeTier

TPP = LAYOUT.tokens_per_page


def _prompts() -> list[list[int]]:
    """4 families, each a 2-page shared prefix and 5 prompts extending it by 2 pages: 48 pages."""
    out = []
    for f in range(4):
        shared = list(range(f * 1000, f * 1000 + 2 * TPP))
        for p in range(5):
            start = f * 1000 + 100 + p * 2 * TPP
            out.append(shared + list(range(start, start + 2 * TPP)))
    return out


def _unreachable(parents: dict[PageKey, PageKey | None]) -> list[PageKey]:
    """The pages of ``parents`` (page -> parent) some ancestor of which is not among them."""
    ok: dict[PageKey, bool] = {}

    def reach(k: PageKey) -> bool:
        chain = []
        while k not in ok:
            p = parents.get(k, k)
            if p is None or p == k:     # a root; or a key that is not a page here
                ok[k] = p is None
                break
            chain.append(k)
            if p in chain:              # a cycle: no root to reach it from
                ok[p] = False
                break
            k = p
        good = ok[k]
        for c in chain:
            ok[c] = good
        return good

    return [k for k in parents if not reach(k)]


def _records(store_dir: Path) -> dict[PageKey, PageKey | None]:
    """Every NVMe record in the store's index (its runs, replayed): page -> parent."""
    index = PersistentIndex(store_dir, ["nvme"], read_only=True, runs=["nvme"])
    try:
        got = live_records(index, "nvme")
    finally:
        index.close()
    keys, parents = split_keys(got.keys), split_keys(got.parents)
    return {k: p if has else None for k, p, has in zip(keys, parents, got.has_parent.tolist())}


def _held(s: Store) -> dict[PageKey, PageKey | None]:
    return {e.key: e.parent for e in s._manager.snapshots()}


# (DRAM pages, NVMe pages, persist_on_close). Before the fix (cached pages unreachable at
# worst; persisted records unreachable after the close): lru 10 and 8 of 32, 2 and 0 of
# 16, 10 and 10 of 24; s3fifo 16 and 8 of 32, 4 and 7 of 16, 10 and 9 of 24. Without a
# write-back (the third) gittins and lru-leaf left 4 of 24 records whose parent stayed in
# DRAM, and the reopen kept them.
SHAPES = [(4, 32, True), (16, 16, True), (8, 24, False)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"dram{s[0]}-nvme{s[1]}-{'persist' if s[2] else 'nopersist'}")
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_no_unreachable_page_cached_persisted_or_reopened(tmp_path: Path, policy: str,
                                                          shape: tuple[int, int, bool]) -> None:
    dram, nvme, persist = shape
    prompts = _prompts()
    cfg = make_config(tmp_path / "s", dram_pages=dram, nvme_pages=nvme, policy=policy, persist_on_close=persist)
    buf = np.zeros((4, PB), np.uint8)
    stranded = 0
    with Store.open(cfg) as s:
        for rnd in range(3):   # put all 48 pages, then go over them again twice: both tiers evict
            for i, toks in enumerate(prompts if rnd != 1 else prompts[::-1]):
                s.get(toks, buf)
                s.put(toks, np.full((4, PB), (i + rnd) % 251, np.uint8))
                stranded = max(stranded, len(_unreachable(_held(s))))
                s._manager.check()
        assert s.stats().evictions > 0
    records = _records(tmp_path / "s")
    dead = _unreachable(records)
    assert records, "nothing was persisted"
    assert stranded == 0 and (not persist or not dead), (
        f"{policy}: {stranded} cached pages at worst and {len(dead)} of {len(records)} persisted pages "
        "unreachable through their prefix")
    with Store.open(cfg) as s:
        held = _held(s)
        # Without a write-back the pages whose parent stayed in DRAM are dropped at the open.
        assert set(held) == set(records) - set(dead) and not _unreachable(held)
        served = {k for toks in prompts for k in split_keys(s._keys(toks, ""))[:s.lookup(toks).cached_pages]}
        assert served == set(held)   # every page adopted is served through its prompts
        s._manager.check()
    assert _records(tmp_path / "s").keys() == held.keys()   # and the index holds no other record


# -- on the manager -------------------------------------------------------------------------
def _key(i: int) -> PageKey:
    return PageKey(bytes([i]) * 16)


def _chain(*ids: int) -> list[tuple[PageKey, PageKey | None]]:
    return [(_key(i), _key(ids[j - 1]) if j else None) for j, i in enumerate(ids)]


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[PersistentIndex, DramTier, NvmeTier]]:
    dram = DramTier(2, PB)
    nvme = NvmeTier(tmp_path / "nvme.data", 8, PB)
    index = PersistentIndex(tmp_path, ["nvme"])
    yield index, dram, nvme
    for part in (dram, nvme, index):
        part.close()


def _manager(parts: tuple[PersistentIndex, DramTier, NvmeTier], policy: str = "lru") -> BlockManager:
    index, dram, nvme = parts
    m = BlockManager([dram, nvme], {t.name: make_policy(policy) for t in (dram, nvme)}, index)
    m.adopt_persistent(nvme.name)
    return m


def _run(m: BlockManager, plan: MovePlan, fail: str = "") -> None:
    """Execute ``plan`` as Transfers.run does, without bytes: each tier's placements
    published, fastest first, except the ``fail`` tier's (abandoned, as a failed write)."""
    assert not plan.moves
    for tier in m.tiers:
        placed = [p for p in plan.placements if p[1] == tier.name]
        if not placed:
            continue
        if tier.name == fail:
            m.abandon(placed)
        else:
            m.publish(placed, {k: 7 for k, _, _ in placed} if tier.persistent else {}, plan)
    m.commit_deletes(plan)


def test_a_quarantined_page_takes_its_descendants_and_their_records(
        parts: tuple[PersistentIndex, DramTier, NvmeTier]) -> None:
    index, _, nvme = parts
    m = _manager(parts)
    _run(m, m.plan_store(_chain(1, 2, 3, 4), PB))   # 1, 2 in DRAM; 3, 4 in NVMe
    _run(m, m.plan_store([(_key(5), _key(2))], PB, prefix=[_key(1), _key(2)]))
    assert m.entry(_key(3)) is not None and index.count("nvme") == 3
    m.forget(_key(2))                               # it failed its checksum, say
    assert sorted(e.key for e in m.snapshots()) == [_key(1)]
    assert index.count("nvme") == 0 and nvme.num_free == nvme.num_slots
    m.check()


def test_a_failed_write_strands_nothing_once_its_plan_is_done(
        parts: tuple[PersistentIndex, DramTier, NvmeTier]) -> None:
    index, dram, nvme = parts
    m = _manager(parts)
    plan = m.plan_store(_chain(1, 2, 3, 4), PB)
    assert {name for _, name, _ in plan.placements} == {dram.name, nvme.name}
    _run(m, plan, fail=dram.name)                   # 1, 2 never written; 3, 4 were
    assert m.snapshots() == [] and index.count("nvme") == 0
    assert plan.dropped == 2                        # counted in the store's pages_dropped
    assert dram.num_free == dram.num_slots and nvme.num_free == nvme.num_slots
    m.check()


def test_records_a_crash_left_without_their_prefix_are_dropped_at_adoption(
        parts: tuple[PersistentIndex, DramTier, NvmeTier]) -> None:
    index, _, nvme = parts
    index.commit("nvme", put=[
        IndexRecord(_key(1), 0, PB, 11, None),
        IndexRecord(_key(2), 1, PB, 12, _key(1)),
        IndexRecord(_key(4), 2, PB, 14, _key(3)),   # its parent lived in DRAM only
        IndexRecord(_key(5), 3, PB, 15, _key(4)),
        IndexRecord(_key(6), 4, PB, 16, _key(7)),   # a damaged index: 6 and 7 name each other
        IndexRecord(_key(7), 5, PB, 17, _key(6)),
    ])
    m = _manager(parts)
    assert sorted(e.key for e in m.snapshots()) == [_key(1), _key(2)]
    assert sorted(r.key for r in index.adopt("nvme", lambda r: True)[0]) == [_key(1), _key(2)]
    assert nvme.num_free == nvme.num_slots - 2
    m.check()


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_dram_only_store_keeps_no_page_without_its_parent(policy: str) -> None:
    """The last tier is also the first: lru and s3fifo evict 1, the oldest, and 2 and 3
    go with it, counted as dropped; the leaf-first policies evict 3."""
    dram = DramTier(3, PB)
    m = BlockManager([dram], {dram.name: make_policy(policy)}, None)
    _run(m, m.plan_store(_chain(1, 2, 3), PB))
    m.note_request([_key(9)])
    plan = m.plan_store(_chain(9), PB)
    _run(m, plan)
    held = {e.key: e.parent for e in m.snapshots()}
    assert _key(9) in held and not _unreachable(held)
    assert plan.dropped == 4 - len(held) and dram.num_free == 3 - len(held)
    m.check()
    dram.close()


def test_a_close_persists_no_page_whose_parent_it_cannot_write(tmp_path: Path) -> None:
    """1 and 2 live in DRAM only, 3 (their child) in NVMe, which has room for one more page
    and nothing it may evict (pinned): 1 is written back, 2 cannot be, so 3's record goes."""
    dram, nvme = DramTier(2, PB), NvmeTier(tmp_path / "nvme.data", 3, PB)
    index = PersistentIndex(tmp_path, ["nvme"])
    m = BlockManager([dram, nvme], {t.name: make_policy("lru") for t in (dram, nvme)}, index)
    m.adopt_persistent(nvme.name)
    _run(m, m.plan_store(_chain(1, 2, 3), PB))
    for i in (1, 2):
        m.pin(_key(i), 1)
    _run(m, m.plan_store(_chain(9), PB))   # DRAM is full and pinned: 9 goes to NVMe
    for i in (1, 2):
        m.pin(_key(i), -1)
    assert {e.key: set(e.slots) for e in m.snapshots()} == {
        _key(1): {dram.name}, _key(2): {dram.name}, _key(3): {nvme.name}, _key(9): {nvme.name}}
    m.pin(_key(3), 1)
    m.pin(_key(9), 1)
    plan = m.plan_writeback()
    assert [mv.key for run in plan.moves for mv in run] == [_key(1)]
    assert plan.deletes == {nvme.name: [_key(3)]} and nvme.num_free == 1   # 3's slot
    m.commit_deletes(plan)
    assert sorted(r.key for r in index.adopt("nvme", lambda r: True)[0]) == [_key(9)]
    m.check()
    for part in (dram, nvme, index):
        part.close()
