"""A plan's new pages as columns (``Placed``, ``NewPages``): what the manager plans, the
transfers write and publish, with no tuple per page. Real tiers (DRAM, an NVMe file, the
LMDB index); a policy that refuses some pages drives the partial paths."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PB
from tierkv.errors import InputError
from tierkv.keys import PageKey
from tierkv.policy.lru import LeafLRUPolicy
from tierkv.store.index import PersistentIndex
from tierkv.store.manager import BlockManager
from tierkv.store.moves import NO_PARENT, Move, MovePlan, Moves, NewPages, Placed, Sums, as_placed
from tierkv.tiers.base import TierId
from tierkv.tiers.dram import DramTier
from tierkv.tiers.nvme import NvmeTier


def _key(i: int) -> PageKey:
    return PageKey(bytes([i]) * 16)


A, B, DRAM, NVME = TierId("a"), TierId("b"), TierId("dram"), TierId("nvme")


def _chain(*ids: int) -> list[tuple[PageKey, PageKey | None]]:
    return [(_key(i), _key(ids[j - 1]) if j else None) for j, i in enumerate(ids)]


def test_new_pages_round_trip_and_take() -> None:
    pairs = _chain(1, 2, 3, 4)
    pages = NewPages.of(pairs)
    assert len(pages) == 4 and pages.pairs() == pairs
    assert pages.blob == b"".join(k for k, _ in pairs) and pages.parents[:16] == NO_PARENT
    some = pages.take(np.array([False, True, False, True]))
    assert some.pairs() == [pairs[1], pairs[3]] and some.blob == _key(2) + _key(4)
    assert len(pages.take(np.zeros(4, dtype=bool))) == 0


def test_placed_batches_take_tuples_and_group() -> None:
    p = Placed.of(DRAM, [_key(1), _key(2), _key(3)], [7, 0, 4])
    assert p.tuples() == [(_key(1), DRAM, 7), (_key(2), DRAM, 0), (_key(3), DRAM, 4)]
    q = p.take(np.array([True, False, True]))
    assert q.tuples() == [(_key(1), DRAM, 7), (_key(3), DRAM, 4)] and q.index.tolist() == [0, 2]
    assert q.blob == _key(1) + _key(3)
    with pytest.raises(ValueError, match="2 keys and 1 slots"):
        Placed.of(DRAM, [_key(1), _key(2)], [3])
    runs = as_placed([(_key(1), A, 1), (_key(2), A, 2), (_key(3), B, 0), (_key(4), A, 3)])
    assert [(b.tier, b.slots) for b in runs] == [(A, [1, 2]), (B, [0]), (A, [3])]
    assert as_placed(p) == [p] and as_placed([]) == []


def test_a_plans_batches_merge_per_tier_fastest_first() -> None:
    plan = MovePlan()
    slow = Placed.of(NVME, [_key(1)], [5])
    fast1 = Placed.of(DRAM, [_key(2)], [0])
    fast2 = Placed.of(DRAM, [_key(3), _key(4)], [1, 2])
    fast2.index += 1
    plan.placed = [slow, fast1, Placed.of(DRAM, [], []), fast2]
    by = plan.placed_by_level({DRAM: 0, NVME: 1})
    assert [(b.tier, b.keys, b.slots, b.index.tolist()) for b in by] == [
        (DRAM, [_key(2), _key(3), _key(4)], [0, 1, 2], [0, 1, 2]), (NVME, [_key(1)], [5], [0])]
    assert plan.placements == [(_key(1), NVME, 5), (_key(2), DRAM, 0), (_key(3), DRAM, 1),
                               (_key(4), DRAM, 2)]


class Picky(LeafLRUPolicy):
    """LRU that refuses the keys it is told to (as a policy weighing pages would)."""

    def __init__(self, refuse: set[PageKey]) -> None:
        super().__init__()
        self.refuse = refuse

    def admit(self, key: PageKey, parent: PageKey | None) -> bool:
        return key not in self.refuse


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[tuple[DramTier, NvmeTier, PersistentIndex]]:
    dram, nvme = DramTier(3, PB), NvmeTier(tmp_path / "nvme.data", 8, PB)
    index = PersistentIndex(tmp_path, ["nvme"])
    yield dram, nvme, index
    for part in (dram, nvme, index):
        part.close()


def test_a_plans_moves_run_slowest_source_first_merged_between_the_same_tiers() -> None:
    C = TierId("c")
    levels = {A: 0, B: 1, C: 2}
    plan = MovePlan(moves=[Moves(A, B, [_key(1)], [10], [20]), Moves(B, C, [_key(2), _key(3)], [11, 12], [21, 22]),
                           Moves(A, B, [], [], []), Moves(A, B, [_key(4)], [13], [23]),
                           Moves(A, C, [_key(5)], [14], [24]), Moves(B, C, [_key(6)], [15], [25])])
    assert plan.moved == 6
    groups = plan.move_groups(levels)
    assert [(g.src, g.dst, g.keys, g.src_slots, g.dst_slots) for g in groups] == [
        (B, C, [_key(2), _key(3), _key(6)], [11, 12, 15], [21, 22, 25]),
        (A, B, [_key(1), _key(4)], [10, 13], [20, 23]),
        (A, C, [_key(5)], [14], [24])]
    assert [len(m) for m in plan.moves] == [1, 2, 0, 1, 1, 1]   # the plan's own batches are left as they were
    assert list(groups[1]) == [Move(_key(1), A, 10, B, 20), Move(_key(4), A, 13, B, 23)]
    placed = groups[0].placed()
    assert placed.tier == C and placed.tuples() == [(_key(2), C, 21), (_key(3), C, 22), (_key(6), C, 25)]
    with pytest.raises(ValueError, match="moves of 2 keys with 1 source and 2 destination slots"):
        Moves(A, B, [_key(1), _key(2)], [1], [2, 3])


def test_plan_new_places_what_each_tier_admits_and_has_room_for(
        tiers: tuple[DramTier, NvmeTier, PersistentIndex]) -> None:
    dram, nvme, index = tiers
    m = BlockManager([dram, nvme], {dram.name: Picky({_key(2)}), nvme.name: Picky(set())}, index)
    m.adopt_persistent(nvme.name)
    pairs = _chain(1, 2, 3, 4, 5)
    plan = m.plan_store(pairs, PB)
    fast, slow = plan.placed_by_level(m.levels)
    # DRAM refuses page 2 and holds three pages: 1, 3, 4; page 2 and 5 go to NVMe.
    assert fast.tier == dram.name and fast.keys == [_key(1), _key(3), _key(4)] and fast.index.tolist() == [0, 2, 3]
    assert slow.tier == nvme.name and slow.keys == [_key(2), _key(5)] and slow.index.tolist() == [1, 4]
    assert plan.dropped == 0 and m.still_placed(fast).all() and m.still_placed(slow).all()
    assert len(set(fast.slots)) == 3 and len(set(slow.slots)) == 2
    removed = m.removed
    m.abandon(Placed.of(dram.name, [_key(4)], [fast.slots[2]]))   # its write failed, say
    assert m.removed == removed + 1
    assert m.still_placed(fast).tolist() == [True, True, False]
    assert m.still_placed(plan.placements).tolist() == [True, True, False, True, True]   # DRAM batch first


def test_a_second_store_into_one_plan_indexes_after_the_first(
        tiers: tuple[DramTier, NvmeTier, PersistentIndex]) -> None:
    dram, nvme, index = tiers
    m = BlockManager([dram, nvme], {t.name: Picky(set()) for t in (dram, nvme)}, index)
    m.adopt_persistent(nvme.name)
    plan = m.plan_store(_chain(1, 2), PB)
    m.plan_store(_chain(7, 8), PB, plan=plan)
    assert plan.asked == 4
    assert [b.index.tolist() for b in plan.placed] == [[0, 1], [2], [3]]   # DRAM holds 3: 8 goes to NVMe


def test_a_key_named_twice_is_placed_once_even_where_it_spills_to_the_next_tier(
        tiers: tuple[DramTier, NvmeTier, PersistentIndex]) -> None:
    dram, nvme, index = tiers
    m = BlockManager([dram, nvme], {t.name: Picky(set()) for t in (dram, nvme)}, index)
    m.adopt_persistent(nvme.name)
    pairs = _chain(1, 2, 3, 4) + [(_key(2), _key(4))]   # DRAM holds 3: 4 and the second 2 are left
    plan = m.plan_store(pairs, PB)
    assert [(b.tier, b.keys, b.index.tolist()) for b in plan.placed] == [
        (dram.name, [_key(1), _key(2), _key(3)], [0, 1, 2]), (nvme.name, [_key(4)], [3])]
    assert nvme.num_free == 7 and plan.dropped == 0


def test_a_publish_that_fails_makes_nothing_of_it_visible(tiers: tuple[DramTier, NvmeTier, PersistentIndex]) -> None:
    """Placements of two tiers in one call: the NVMe page has no checksum, so the publish
    fails, and the DRAM page (a batch of its own) must not have been published before it:
    the caller abandons all of them, which takes back reservations, not published pages."""
    dram, nvme, index = tiers
    m = BlockManager([dram, nvme], {dram.name: Picky({_key(2)}), nvme.name: Picky(set())}, index)
    m.adopt_persistent(nvme.name)
    plan = m.plan_store(_chain(1, 2), PB)     # 1 in DRAM; DRAM refuses 2, which goes to NVMe
    placed = plan.placements
    assert [name for _, name, _ in placed] == [dram.name, nvme.name]
    with pytest.raises(InputError, match="no checksum"):
        m.publish(placed, {}, plan)
    assert m.leading(_key(1), 1) == [] and len(m._policies[dram.name]) == 0   # not published
    m.abandon(placed)
    m.check()
    assert dram.num_free == 3 and nvme.num_free == 8


def test_checksums_by_position_reach_the_pages_that_had_none(tiers: tuple[DramTier, NvmeTier, PersistentIndex]) -> None:
    dram, nvme, index = tiers
    refused = {_key(1), _key(2), _key(3)}   # DRAM refuses them all: they go to NVMe
    m = BlockManager([dram, nvme], {dram.name: Picky(refused), nvme.name: Picky(set())}, index)
    m.adopt_persistent(nvme.name)
    plan = m.plan_store(_chain(1, 2, 3), PB)
    [nv] = plan.placed
    assert nv.tier == nvme.name and nv.keys == [_key(1), _key(2), _key(3)]
    with pytest.raises(ValueError, match="checksums by position"):
        m.publish(nv, Sums(np.zeros(4, np.uint64), np.ones(4, bool)), plan)
    with pytest.raises(ValueError, match="for a mask of shape"):
        Sums(np.zeros(2, np.uint64), np.ones(3, bool))
    need = m.unsummed(nv.keys)
    assert need.dtype == bool and need.tolist() == [True, True, True]
    values = np.array([11, 2**64 - 1, 13], dtype=np.uint64)
    m.publish(nv, Sums(values, need), plan)
    assert [m.entry(k).checksum for k in nv.keys] == [11, 2**64 - 1, 13]  # type: ignore[union-attr]
    assert not m.unsummed(nv.keys).any()
    assert [r.checksum for r in index.get_many("nvme", nv.keys) if r is not None] == [11, 2**64 - 1, 13]
