"""The simulator's byte-less tiers: the slot half of the tier contract, and no bytes.

The slot tests of the conformance suite run here on :class:`SimTier` unchanged (imported
below; they take this module's ``tier_factory``). The suite's byte tests cannot: a
simulated tier refuses every read and write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from tierkv.errors import CapacityError, InputError, StoreClosedError
from tierkv.keys import PageKey
from tierkv.policy import make_policy
from tierkv.sim.mirror import SimManager, page_key
from tierkv.sim.tiers import TIER_NAMES, SimTier, sim_tiers
from tierkv.store.manager import BlockManager
from tierkv.tiers.base import Tier, TierKind
from tests.tiers.test_conformance import test_context_manager_closes as test_context_manager_closes
from tests.tiers.test_conformance import test_free_errors as test_free_errors

TierFactory = Callable[[int, int], Tier]


@pytest.fixture
def tier_factory() -> Iterator[TierFactory]:
    """``make(num_slots, page_bytes)``: a volatile simulated DRAM tier; all closed at teardown."""
    built: list[Tier] = []

    def make(num_slots: int, page_bytes: int) -> Tier:
        tier = SimTier(num_slots, kind=TierKind.DRAM, name="dram", persistent=False, slot_bytes=page_bytes)
        built.append(tier)
        return tier

    yield make
    for tier in built:
        tier.close()


def test_slots_are_handed_out_lowest_first_until_full(tier_factory: TierFactory) -> None:
    tier = tier_factory(4, 4096)
    assert tier.allocate(3) == [0, 1, 2] and tier.num_free == 1
    with pytest.raises(CapacityError):
        tier.allocate(2)
    tier.free([1])
    assert tier.allocate(2) == [1, 3] and tier.num_free == 0
    with pytest.raises(InputError, match="claimed twice"):
        tier.claim([0])


@pytest.mark.parametrize("op", ["write", "read"])
def test_it_holds_no_bytes(tier_factory: TierFactory, op: str) -> None:
    tier = tier_factory(4, 4096)
    slots = tier.allocate(2)
    with pytest.raises(InputError, match="holds no bytes"):
        getattr(tier, op)(slots, np.zeros((2, 4096), dtype=np.uint8))
    with pytest.raises(InputError, match="holds no bytes"):
        tier.write(slots, np.zeros((2, 4096), dtype=np.uint8), checksums=True)
    with pytest.raises(InputError, match="2-D uint8"):        # the base class's checks come first
        getattr(tier, op)(slots, np.zeros((2, 1024), dtype=np.float32))
    tier.flush()
    tier.close()
    with pytest.raises(StoreClosedError):
        tier.flush()


def test_the_manager_keeps_the_simulated_tiers_in_order() -> None:
    for n in range(1, len(TIER_NAMES) + 1):
        tiers = sim_tiers(list(range(1, n + 1)))
        m = BlockManager(tiers, {t.name: make_policy("lru") for t in tiers}, None)
        assert [t.name for t in m.tiers] == list(TIER_NAMES[:n])
        assert [t.num_slots for t in m.tiers] == list(range(1, n + 1))
        assert [t.persistent for t in m.tiers] == [False] * (n - 1) + [True]   # as DRAM over NVMe


@pytest.mark.parametrize("capacities", [[], [0], [4, 0], [1, 1, 1, 1, 1]])
def test_bad_capacities(capacities: list[int]) -> None:
    with pytest.raises(InputError):
        sim_tiers(capacities)


def test_keys_of_any_length_are_reported_as_given() -> None:
    """The manager takes 16-byte keys; the simulator digests others and reports them back."""
    a, b, c = (PageKey(x) for x in (b"a", b"b", b"c"))
    assert len(page_key(a)) == 16 and page_key(page_key(a)) == page_key(a)
    m = SimManager([2, 4], lambda: make_policy("lru-leaf"))
    assert m.request((a, b), 0.0) == 0
    assert m.request((a, c), 1.0) == 1
    assert m.where == {a: 1, b: 2, c: 1}       # b, a leaf, made room for c: demoted to NVMe
    assert m.parent == {a: None, b: a, c: a} and m.used == [2, 1] and m.tier_hits == [1, 0]
