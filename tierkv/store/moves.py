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

from tierkv.keys import PageKey
from tierkv.tiers.base import TierId


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
