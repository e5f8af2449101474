"""What the Store API's calls return (:mod:`tierkv.store.api` re-exports them). Immutable data."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tierkv.tiers.base import TierKind

_KIND_BY_RANK = {kind.rank: kind for kind in TierKind}


@dataclass(frozen=True)
class LookupResult:
    """How much of a prompt is cached: leading full pages, and the fastest tier of each.

    ``tier_ranks`` holds one byte per cached page (its fastest tier's rank); ``tiers``
    and ``pages_per_tier`` decode it on demand, so a lookup costs no per-page Python work.
    """

    cached_pages: int
    cached_tokens: int
    total_pages: int
    tier_ranks: bytes = field(repr=False)
    derived: int = 0   # of them, derived pages (lookup(accept="derived") only), the last ones
    lossy: int = 0     # of them, lossy pages (lookup(accept_lossy=...) only), the last ones

    @property
    def tiers(self) -> tuple[TierKind, ...]:
        return tuple(_KIND_BY_RANK[r] for r in self.tier_ranks)

    @property
    def pages_per_tier(self) -> dict[TierKind, int]:
        return {kind: self.tier_ranks.count(kind.rank) for kind in TierKind if kind.rank in self.tier_ranks}


@dataclass(frozen=True)
class GetResult:
    """Leading pages loaded into the caller's buffer and the tier each came from."""

    pages: int
    tokens: int
    tiers: tuple[TierKind, ...]
    derived: int = 0   # of them, derived pages (moved by a splice; get(accept="derived") only), the last ones
    lossy: int = 0     # of them, lossy pages (get(accept_lossy=...) only), the last ones
    #: With lossy pages: ``bool [pages, tokens_per_page]``, the tokens their coding evicted
    #: (their rows in the caller's buffer are zero; an engine drops them, keeping the
    #: positions of those after). None otherwise.
    evicted: np.ndarray | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Lent:
    """Leading pages lent in place from the DRAM tier (``Store.lend``): page ``i`` is row
    ``slots[i]`` of the tier's buffer until ``Store.end_lend(token)``."""

    pages: int
    tokens: int
    slots: tuple[int, ...]
    token: int
    pool: int = 0   # the buffer's identity (``Store.lend_pool``): a restarted daemon's is another


@dataclass(frozen=True)
class PutResult:
    """``stored`` new pages, ``already_present`` skipped, ``dropped`` that found no room."""

    stored: int
    already_present: int
    dropped: int
