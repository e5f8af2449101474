"""What the block manager hands out: page entries, locations, moves and plans.

Plain data: :class:`Entry` is the manager's mutable bookkeeping of one page,
:class:`PageLocation` the frozen view callers get, :class:`Move` and :class:`MovePlan` what
a store, promotion or eviction needs done, executed by :mod:`tierkv.store.transfer` and
completed by :class:`tierkv.store.manager.BlockManager` (which re-exports these names).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.keys import PageKey
from tierkv.tiers.base import TierKind


@dataclass(eq=False)
class Entry:
    """Mutable bookkeeping of one page (internal: callers see :class:`PageLocation`)."""

    key: PageKey
    parent: PageKey | None
    nbytes: int
    checksum: int | None = None
    slots: dict[TierKind, int] = field(default_factory=dict)
    pins: int = 0

    @property
    def fastest(self) -> TierKind:
        return min(self.slots, key=lambda k: k.rank)


@dataclass(frozen=True)
class PageLocation:
    """Where a page lives: its fastest tier, every (tier, slot) it occupies, and its metadata."""

    key: PageKey
    tier: TierKind
    slots: tuple[tuple[TierKind, int], ...]
    nbytes: int
    checksum: int | None
    parent: PageKey | None
    pins: int


@dataclass(frozen=True)
class Move:
    """Copy ``key`` from ``src``/``src_slot`` to ``dst``/``dst_slot``; the source slot is then free."""

    key: PageKey
    src: TierKind
    src_slot: int
    dst: TierKind
    dst_slot: int


@dataclass
class MovePlan:
    """What one store, promotion or eviction needs done, in execution order.

    ``moves`` run deepest tier first, then ``placements`` are written; each batch is
    published with one index commit that also carries the ``deletes`` (records of
    evicted persistent pages) of its tier.
    """

    moves: list[Move] = field(default_factory=list)
    placements: list[tuple[PageKey, TierKind, int]] = field(default_factory=list)
    deletes: dict[TierKind, list[PageKey]] = field(default_factory=dict)
    dropped: int = 0
    evicted: int = 0
    # Parents of pages this plan moves down into each tier: a tier's policy learns of a
    # moved page only at publish, so until then its parent looks like a leaf there and
    # must not be evicted from that tier (the page would outlive its prefix).
    parents_below: dict[TierKind, set[PageKey]] = field(default_factory=dict)
    # Pages a victims call offered whose last copy could neither move down nor be dropped
    # (cached descendants depend on them): they stay, and are not offered again.
    kept: set[PageKey] = field(default_factory=set)

    def ordered_moves(self) -> list[Move]:
        return sorted(self.moves, key=lambda m: -m.src.rank)
