"""What the block manager hands out: page entries, locations, moves and plans.

Plain data: :class:`Entry` is a snapshot of the manager's bookkeeping of one page,
:class:`PageLocation` the frozen view callers get, :class:`Move` and :class:`MovePlan` what
a store, promotion or eviction needs done, executed by :mod:`tierkv.store.transfer` and
completed by :class:`tierkv.store.manager.BlockManager` (which re-exports these names).
Tiers are named by their identity (:data:`~tierkv.tiers.base.TierId`), never by kind:
a store may hold two tiers of one kind. Which tier is faster is the manager's to say
(its ``levels``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tierkv.keys import KEY_BYTES, PageKey, take_keys
from tierkv.store.table import NO_LEVEL
from tierkv.tiers.base import TierId

#: :attr:`Lead.levels` of a page whose every copy is on a degraded tier.
NO_SOURCE = NO_LEVEL


@dataclass(eq=False)
class Entry:
    """A snapshot of the manager's bookkeeping of one page (changing it changes nothing there)."""

    key: PageKey
    parent: PageKey | None
    nbytes: int
    checksum: int | None = None
    slots: dict[TierId, int] = field(default_factory=dict)   # fastest tier first
    pins: int = 0
    #: Which incarnation of the page's row this is a snapshot of (see ``BlockManager.current``).
    gen: int = 0


@dataclass
class Lead:
    """The leading cached pages of a request, column by column: what a get or a prefetch
    reads, with no object per page.

    ``keys``: their 16-byte keys back to back; ``levels[i]`` (uint8): the level of the tier
    to read page ``i`` from, its fastest copy on a tier that serves I/O (:data:`NO_SOURCE`
    where there is none); ``slots[i]``: its slot there (a read-only store's coded tier
    gives block views); ``sums[i]``: its checksum (0 where it has none: every page on a
    persistent tier has one).
    """

    keys: bytes
    levels: np.ndarray
    slots: list[Any]
    sums: list[int]

    def __len__(self) -> int:
        return len(self.levels)

    def key(self, i: int) -> PageKey:
        return PageKey(self.keys[i * KEY_BYTES:(i + 1) * KEY_BYTES])

    def keys_of(self, start: int, stop: int) -> bytes:
        """The keys of pages ``start .. stop-1``, back to back."""
        return self.keys[start * KEY_BYTES:stop * KEY_BYTES]

    def run_until(self, stop: np.ndarray) -> int:
        """How many leading pages come before the first where the boolean mask ``stop`` is set."""
        hit = np.flatnonzero(stop)
        return int(hit[0]) if len(hit) else len(self)

    def sourced(self) -> int:
        """How many leading pages have a copy to read (before the first :data:`NO_SOURCE`)."""
        return self.run_until(self.levels == NO_SOURCE)

    def take(self, which: np.ndarray) -> Lead:
        """The pages where the boolean mask ``which`` is set, in order."""
        idx = np.flatnonzero(which).tolist()
        return Lead(take_keys(self.keys, which), self.levels[which],
                    [self.slots[i] for i in idx], [self.sums[i] for i in idx])


@dataclass(frozen=True)
class PageLocation:
    """Where a page lives: its fastest tier, every (tier, slot) it occupies (fastest first),
    and its metadata."""

    key: PageKey
    tier: TierId
    slots: tuple[tuple[TierId, int], ...]
    nbytes: int
    checksum: int | None
    parent: PageKey | None
    pins: int


@dataclass(frozen=True)
class Move:
    """Copy ``key`` from ``src``/``src_slot`` to ``dst``/``dst_slot``; the source slot is then free."""

    key: PageKey
    src: TierId
    src_slot: int
    dst: TierId
    dst_slot: int


@dataclass
class MovePlan:
    """What one store, promotion or eviction needs done, in execution order.

    ``moves`` run deepest tier first, then ``placements`` are written; each batch is
    published with one index commit that also carries the ``deletes`` (records of
    evicted persistent pages) of its tier.
    """

    moves: list[Move] = field(default_factory=list)
    placements: list[tuple[PageKey, TierId, int]] = field(default_factory=list)
    deletes: dict[TierId, list[PageKey]] = field(default_factory=dict)
    dropped: int = 0
    evicted: int = 0
    # Parents of pages this plan moves down into each tier: a tier's policy learns of a
    # moved page only at publish, so until then its parent looks like a leaf there and
    # must not be evicted from that tier (the page would outlive its prefix).
    parents_below: dict[TierId, set[PageKey]] = field(default_factory=dict)
    # Pages a victims call offered whose last copy could neither move down nor be dropped
    # (cached descendants depend on them): they stay, and are not offered again.
    kept: set[PageKey] = field(default_factory=set)

    def ordered_moves(self, levels: Mapping[TierId, int]) -> list[Move]:
        """The moves, those out of the slowest tiers first (``levels``: 0 is the fastest)."""
        return sorted(self.moves, key=lambda m: -levels[m.src])
