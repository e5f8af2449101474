"""SlotAllocator, the free map under every tier's slots and a block tier's blocks:
first fit, runs, and frees that check everything before they change anything."""

from __future__ import annotations

import pytest

from tierkv.errors import CapacityError, InputError
from tierkv.tiers.base import SlotAllocator


def test_allocator_contiguous_first_fit() -> None:
    a = SlotAllocator(16)
    assert a.allocate(3) == [0, 1, 2]
    a.free([1])
    assert a.allocate(2, contiguous=True) == [3, 4]  # the hole at 1 is too short
    assert a.allocate(2) == [1, 5]  # lowest first otherwise
    a.claim([7, 9])
    with pytest.raises(InputError, match="claimed twice"):
        a.claim([10, 9])
    assert a.num_free == 16 - 8  # the failed claim took nothing
    assert a.allocate(3, contiguous=True) == [10, 11, 12]
    with pytest.raises(CapacityError):
        a.allocate(6)


def test_allocator_runs_and_frees_all_or_nothing() -> None:
    """allocate_run reserves the lowest run of n free slots (None, and nothing taken, where
    none is that long); free and free_runs check every slot before they free any: one
    out of range, free already or named twice leaves the map as it was, in the loop for
    a few slots and the bulk path for many."""
    a = SlotAllocator(200)
    assert a.allocate(3) == [0, 1, 2]
    a.free([1])
    assert a.allocate_run(2) == 3 and a.num_free == 200 - 4   # the hole at 1 is too short
    assert a.allocate_run(1) == 1                              # a run of one: the hole
    assert a.allocate_run(201) is None and a.allocate_run(0) is None
    held = a.allocate(100)
    assert held == list(range(5, 105))
    free_before, map_before = a.num_free, bytes(a._used)
    for bad in ([4, 5, 5], [4, 104, 150], [4, -1], [4, 200], held[:40] + [held[0]], held[:40] + [150],
                held[:40] + [200]):
        with pytest.raises(InputError):
            a.free(bad)
        assert a.num_free == free_before and bytes(a._used) == map_before
    assert a.allocate_run(96) is None      # every slot 0..104 still held: no run fits below 105 + 96...
    assert a.allocate_run(95) == 105       # ...but 105..199 does
    a.free_runs([(105, 95)])
    for bad_runs in ([(5, 10), (10, 3)], [(5, 10), (150, 1)], [(5, 0)], [(190, 20)], [(-1, 2)]):
        with pytest.raises(InputError):
            a.free_runs(bad_runs)
        assert a.num_free == free_before and bytes(a._used) == map_before
    a.free_runs([(40, 65), (5, 35)])       # any order
    a.free(held[:0])
    assert a.num_free == free_before + 100 and a.allocate_run(195) == 5
