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

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby, repeat
from operator import itemgetter
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


@dataclass(eq=False)
class Moves:
    """Pages copied from tier ``src`` to tier ``dst``, as columns: ``keys[i]`` from slot
    ``src_slots[i]`` into slot ``dst_slots[i]``; each source slot is then free."""

    src: TierId
    dst: TierId
    keys: list[PageKey]
    src_slots: list[int]
    dst_slots: list[int]

    def __post_init__(self) -> None:
        if not len(self.keys) == len(self.src_slots) == len(self.dst_slots):
            raise ValueError(f"moves of {len(self.keys)} keys with {len(self.src_slots)} source and "
                             f"{len(self.dst_slots)} destination slots")

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[Move]:
        """Each move on its own (checks and tests)."""
        return (Move(k, self.src, s, self.dst, d) for k, s, d in zip(self.keys, self.src_slots, self.dst_slots))

    def placed(self) -> Placed:
        """What the moves place in ``dst``, to publish (or abandon) as a batch."""
        return Placed.of(self.dst, self.keys, self.dst_slots)


@dataclass(eq=False)
class Sums:
    """Checksums of a batch's pages by position: ``values[i]`` (uint64) is page ``i``'s
    where ``need[i]`` (the pages that had none yet); what a write hashed, for ``publish``."""

    values: np.ndarray
    need: np.ndarray

    def __post_init__(self) -> None:
        if self.values.shape != self.need.shape or self.values.ndim != 1:
            raise ValueError(f"checksums of shape {self.values.shape} for a mask of shape {self.need.shape}")


#: A page's parent where it has none, in a blob of parents (a key no page has: keys are hashes).
NO_PARENT = PageKey(bytes(KEY_BYTES))


@dataclass(eq=False)
class NewPages:
    """Pages to store that no tier holds, as columns: ``keys`` (a list, and ``blob``, the
    same 16-byte keys back to back), ``parents``: each page's parent key back to back,
    meaningful where the boolean ``has_parent`` is set."""

    keys: list[PageKey]
    blob: bytes
    parents: bytes
    has_parent: np.ndarray

    @classmethod
    def of(cls, pages: Sequence[tuple[PageKey, PageKey | None]]) -> NewPages:
        """The columns of a list of (key, parent)."""
        keys = [k for k, _ in pages]
        has = np.fromiter((p is not None for _, p in pages), dtype=bool, count=len(pages))
        return cls(keys, b"".join(keys), b"".join([NO_PARENT if p is None else p for _, p in pages]), has)

    def __len__(self) -> int:
        return len(self.keys)

    def take(self, which: np.ndarray) -> NewPages:
        """The pages where the boolean mask ``which`` is set, in order."""
        return NewPages([k for k, good in zip(self.keys, which.tolist()) if good], take_keys(self.blob, which),
                        take_keys(self.parents, which), self.has_parent[which])

    def pairs(self) -> list[tuple[PageKey, PageKey | None]]:
        """(key, parent) of each page, in order."""
        p = self.parents
        return [(k, PageKey(p[i * KEY_BYTES:(i + 1) * KEY_BYTES]) if has else None)
                for i, (k, has) in enumerate(zip(self.keys, self.has_parent.tolist()))]


@dataclass(eq=False)
class Placed:
    """New pages a plan reserved slots for in one tier, as columns.

    ``keys`` and ``blob`` (the same 16-byte keys back to back), ``slots[i]``: the slot
    reserved for ``keys[i]``; ``index[i]``: that page's position in what the plan was
    asked to place (int64), so the caller finds its bytes without a map from keys.
    """

    tier: TierId
    keys: list[PageKey]
    blob: bytes
    slots: list[int]
    index: np.ndarray

    @classmethod
    def of(cls, tier: TierId, keys: Sequence[PageKey], slots: Sequence[int]) -> Placed:
        """Placements of ``keys`` into ``slots`` of ``tier``, indexed in their order."""
        if len(keys) != len(slots):
            raise ValueError(f"{len(keys)} keys and {len(slots)} slots do not make placements")
        keys = list(keys)
        return cls(tier, keys, b"".join(keys), list(slots), np.arange(len(keys), dtype=np.int64))

    def __len__(self) -> int:
        return len(self.keys)

    def take(self, which: np.ndarray) -> Placed:
        """The placements where the boolean mask ``which`` is set, in order."""
        idx = np.flatnonzero(which).tolist()
        return Placed(self.tier, [self.keys[i] for i in idx], take_keys(self.blob, which),
                      [self.slots[i] for i in idx], self.index[which])

    def tuples(self) -> list[tuple[PageKey, TierId, int]]:
        """(key, tier, slot) of each placement, in order."""
        return list(zip(self.keys, repeat(self.tier), self.slots))


def as_placed(placed: Placed | Sequence[tuple[PageKey, TierId, int]]) -> list[Placed]:
    """Placements as :class:`Placed` batches, one per run of one tier, in order."""
    if isinstance(placed, Placed):
        return [placed]
    return [Placed.of(name, [k for k, _, _ in group], [s for _, _, s in group])
            for name, group in ((n, list(g)) for n, g in groupby(placed, key=itemgetter(1)))]


@dataclass
class MovePlan:
    """What one store, promotion or eviction needs done, in execution order.

    ``moves`` (batches of one source and one destination tier) run deepest tier first,
    then the new pages of ``placed`` (one batch per tier, in the order they were planned)
    are written; each batch is published with one index commit that also carries the
    ``deletes`` (records of evicted persistent pages) of its tier.
    """

    moves: list[Moves] = field(default_factory=list)
    placed: list[Placed] = field(default_factory=list)
    # How many pages this plan was asked to place so far: a batch's ``index`` counts from
    # here, so indices stay distinct across several store calls into one plan.
    asked: int = 0
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

    @property
    def placements(self) -> list[tuple[PageKey, TierId, int]]:
        """(key, tier, slot) of every new page placed, batch by batch."""
        return [p for batch in self.placed for p in batch.tuples()]

    def placed_by_level(self, levels: Mapping[TierId, int]) -> list[Placed]:
        """The new pages' batches, one per tier, fastest tier first (a tier's batches
        merged in plan order)."""
        if len(self.placed) <= 1:
            return [b for b in self.placed if len(b)]
        out: dict[TierId, list[Placed]] = {}
        for batch in sorted(self.placed, key=lambda b: levels[b.tier]):
            if len(batch):
                out.setdefault(batch.tier, []).append(batch)
        return [bs[0] if len(bs) == 1 else _merged(bs) for bs in out.values()]

    @property
    def moved(self) -> int:
        """How many pages the plan moves."""
        return sum(map(len, self.moves))

    def move_groups(self, levels: Mapping[TierId, int]) -> list[Moves]:
        """The moves, those out of the slowest tiers first (``levels``: 0 is the fastest),
        in plan order otherwise; neighbouring batches between the same two tiers merged."""
        out: list[Moves] = []
        for m in sorted(self.moves, key=lambda m: -levels[m.src]):
            if not len(m):
                continue
            last = out[-1] if out else None
            if last is not None and (last.src, last.dst) == (m.src, m.dst):
                out[-1] = Moves(m.src, m.dst, last.keys + m.keys, last.src_slots + m.src_slots,
                                last.dst_slots + m.dst_slots)
            else:
                out.append(m)
        return out


def _merged(batches: list[Placed]) -> Placed:
    """One tier's batches as one, in order (their ``index`` entries kept as they were)."""
    return Placed(batches[0].tier, [k for b in batches for k in b.keys], b"".join(b.blob for b in batches),
                  [s for b in batches for s in b.slots], np.concatenate([b.index for b in batches]))
