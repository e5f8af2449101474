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


def _lowest(free: list[bool], n: int, contiguous: bool) -> list[int]:
    """The slots a first-fit allocator hands out: the lowest run of n free ones where
    contiguous and one exists, else the n lowest free."""
    if contiguous and n > 1:
        run = 0
        for s, f in enumerate(free):
            run = run + 1 if f else 0
            if run == n:
                return list(range(s - n + 1, s + 1))
    return [s for s, f in enumerate(free) if f][:n]


@pytest.mark.parametrize("seed", range(6))
def test_allocator_hands_out_what_first_fit_would(seed: int) -> None:
    """Random allocations and frees against a plain model of first fit: holes shorter and
    longer than the ask, at the low mark and above it, runs that end at the last slot."""
    import random

    rng = random.Random(seed)
    size = rng.choice([17, 64, 300])
    a, free = SlotAllocator(size), [True] * size
    for _ in range(400):
        held = [s for s, f in enumerate(free) if not f]
        if held and (rng.random() < 0.45 or sum(free) == 0):
            gone = rng.sample(held, rng.randint(1, min(len(held), 40)))
            a.free(gone)
            for s in gone:
                free[s] = True
        else:
            n = rng.randint(1, max(1, min(sum(free), rng.choice([1, 3, 8, 40]))))
            contiguous = rng.random() < 0.5
            want = _lowest(free, n, contiguous)
            assert a.allocate(n, contiguous) == want
            for s in want:
                free[s] = False
        assert a.num_free == sum(free)


def test_allocated_slots_carry_their_array_and_drop_it_when_changed() -> None:
    """What allocate hands out is a list whose numpy array comes without converting it
    again; the array is read-only (a caller cannot change it under the list), and any
    change to the list is seen by the next conversion."""
    import pickle

    import numpy as np

    from tierkv.tiers.base import SlotList

    a = SlotAllocator(64)
    a.allocate(3)
    a.free([1])
    for slots in (a.allocate(4), a.allocate(5, contiguous=True)):   # the window scan, then the run
        assert isinstance(slots, SlotList)
        arr = np.asarray(slots, dtype=np.int64)
        assert arr.tolist() == list(slots) and np.asarray(slots) is arr
        with pytest.raises(ValueError):
            arr[0] = 7
        assert np.array(slots, copy=True).flags.writeable
        assert np.asarray(slots, dtype=np.uint64).tolist() == list(slots)
        assert pickle.loads(pickle.dumps(slots)) == list(slots) and type(pickle.loads(pickle.dumps(slots))) is list
    changed = a.allocate(20)   # a changed list converts as a plain list: a float stays one, for the checks
    changed[5] = 2.5  # type: ignore[call-overload]
    assert np.asarray(changed).dtype.kind == "f"
    from tierkv.tiers.dram import DramTier
    with DramTier(64, 4096) as tier:
        slots = tier.allocate(20)
        slots[5] = 2.5  # type: ignore[call-overload]
        with pytest.raises(InputError, match="whole numbers"):
            tier.write(slots, np.zeros((20, 4096), np.uint8))
    fresh = a.allocate(2)
    with pytest.raises(ValueError):
        np.asarray(fresh, dtype=np.int32, copy=False)   # numpy 2's contract: no copy, or an error
    assert np.asarray(fresh, copy=False) is np.asarray(fresh)
    assert SlotList(iter([3, 4])) == [3, 4] and np.asarray(SlotList(iter([3, 4]))).tolist() == [3, 4]
    import dataclasses

    @dataclasses.dataclass
    class Held:
        slots: list[int]

    held = a.allocate(2)
    assert dataclasses.asdict(Held(held)) == {"slots": list(held)}
    for change in (lambda s: s.append(40), lambda s: s.__setitem__(0, 41), lambda s: s.sort(reverse=True),
                   lambda s: s.__delitem__(0), lambda s: s.extend([42, 43]), lambda s: s.pop(),
                   lambda s: s.insert(0, 44), lambda s: s.remove(s[-1]), lambda s: s.reverse(), lambda s: s.clear(),
                   lambda s: s.__iadd__([45]), lambda s: s.__imul__(2), lambda s: s.__setitem__(slice(0, 2), [46])):
        s = SlotList(np.arange(10, 16))
        change(s)
        assert np.asarray(s, dtype=np.int64).tolist() == list(s)
