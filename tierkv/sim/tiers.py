"""Byte-less tiers: what the simulator gives the real block manager in place of DRAM and NVMe.

A :class:`SimTier` is a :class:`~tierkv.tiers.base.Tier` with everything the manager
asks of a tier (a name, a kind, a persistence flag, ``num_slots``/``num_free``, slots
handed out lowest first by the base class's allocator, ``free``/``claim``, ``flush``,
``close``) and no medium: it holds no bytes, so ``read`` and ``write`` raise
InputError after the base class's checks. The manager never moves bytes, so it runs
on these unchanged; :mod:`tierkv.store.transfer`, which does, must never be given one.

:func:`sim_tiers` builds the simulator's tiers from capacities in pages, fastest first.
Called by :mod:`tierkv.sim.mirror`; the slot bookkeeping is as thread-safe as the base
class's (the simulator is single-threaded).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tierkv.errors import InputError
from tierkv.tiers.aligned import ALIGN
from tierkv.tiers.base import Tier, TierKind

#: Names of simulated tiers, fastest first (``tierkv sim``'s ``tier_hit_rate`` keys).
TIER_NAMES = ("dram", "nvme", "tier2", "tier3")
# Their kinds: the manager orders tiers by kind (stable within one), so these keep the
# names' order; a kind also says which copies a real store would make, which nothing here does.
_KINDS = (TierKind.DRAM, TierKind.NVME, TierKind.NVMEOF, TierKind.NVMEOF)
#: The page size the simulated tiers and the manager's entries record (nothing is allocated).
SIM_PAGE_BYTES = ALIGN


class SimTier(Tier):
    """``num_slots`` slots of ``slot_bytes`` that hold nothing; ``kind`` and ``persistent`` as given.

    ``available`` is True until ``close`` (a simulated tier is never degraded).
    """

    def __init__(self, num_slots: int, *, kind: TierKind, name: str, persistent: bool,
                 slot_bytes: int = SIM_PAGE_BYTES) -> None:
        self.kind = kind
        self.persistent = persistent
        super().__init__(num_slots, slot_bytes, name=name)

    def _write(self, slots: Sequence[int], src: np.ndarray) -> None:
        raise InputError(f"the {self.name} tier is simulated and holds no bytes: it cannot write {len(slots)} pages")

    def _read(self, slots: Sequence[int], dst: np.ndarray) -> None:
        raise InputError(f"the {self.name} tier is simulated and holds no bytes: it cannot read {len(slots)} pages")

    def __repr__(self) -> str:
        return (f"SimTier({self.name!r}, {self.kind.value}, {self.num_slots} slots, "
                f"{'persistent' if self.persistent else 'volatile'})")


def sim_tiers(capacities: Sequence[int]) -> list[SimTier]:
    """Tiers of ``capacities`` pages, fastest first, named as :data:`TIER_NAMES`.

    Every tier but the last is volatile and the last one is persistent, as in a store of
    DRAM over NVMe: a full volatile tier with a tier below demotes in batches
    (:data:`~tierkv.store.manager.DEMOTION_BATCH`), a persistent one page by page.
    InputError for no tiers, more than :data:`TIER_NAMES`, or a tier of no slots.
    """
    if not capacities or len(capacities) > len(TIER_NAMES):
        raise InputError(f"1 to {len(TIER_NAMES)} tiers can be simulated, got {len(capacities)}")
    if min(capacities) < 1:
        raise InputError(f"every simulated tier needs at least one slot, got {list(capacities)}")
    last = len(capacities) - 1
    return [SimTier(n, kind=_KINDS[i], name=TIER_NAMES[i], persistent=i == last) for i, n in enumerate(capacities)]
