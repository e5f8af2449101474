"""The simulator's store: the real block manager over byte-less tiers, called as a store calls it.

:class:`SimManager` runs :class:`tierkv.store.manager.BlockManager` itself, with
:class:`~tierkv.sim.tiers.SimTier` tiers and no index, and makes for one request the
manager calls that :mod:`tierkv.store.api` and :mod:`tierkv.store.transfer` make when
``tierkv replay`` drives a store (lookup, get, put), in the same order; only the byte
copies are left out. So a policy, the manager's eviction, demotion, promotion and
prefix rules behave here exactly as in the store, and nothing is mirrored by hand:

1. ``lookup``: the leading resident pages and the level of each one's fastest tier
   (``manager.resident.prefix_values``);
2. ``note_request(keys)``, once per request (the store's ``get`` shows the request, or
   its ``put`` when nothing was cached);
3. ``get``: each leading page is counted and ``touch``-ed in its fastest tier; pages
   found only below the top tier are promoted unless promotion is off: one
   ``plan_promote`` per source tier, the request's leading pages protected (the store
   takes the source tiers in set order, here in level order: the same with two tiers);
4. ``put``: the request's pages with no copy anywhere go to ``plan_store`` (the cached
   ones as its ``prefix``); a put larger than every tier together is refused
   (CapacityError, counted in ``rejected``).

Each plan runs as ``Transfers.run`` runs it: moves grouped by (source, destination),
out of the slowest tiers first, each group ``publish``-ed, then placements grouped by
tier, fastest first, each ``publish``-ed, then ``commit_deletes`` (a no-op without an
index). Pages bound for a persistent tier are published with a checksum of 0.

Called by :mod:`tierkv.sim.run` and the tests; single-threaded. Keys of 16 bytes (what
:class:`~tierkv.sim.run.Workload` makes) are the manager's keys as they are; any other
key is replaced by a 16-byte digest of it (:func:`as_page_keys`), and reported back as given.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from tierkv.errors import CapacityError
from tierkv.keys import KEY_BYTES, PageKey
from tierkv.policy.base import Policy
from tierkv.sim.tiers import SIM_PAGE_BYTES, sim_tiers
from tierkv.store.manager import BlockManager
from tierkv.store.moves import MovePlan
from tierkv.tiers.base import TierId

_NO_CHECKSUMS: dict[PageKey, int] = {}


def page_key(key: bytes) -> PageKey:
    """``key`` as a 16-byte page key: itself if it has 16 bytes, else its 16-byte BLAKE2b digest."""
    if len(key) == KEY_BYTES:
        return PageKey(key)
    return PageKey(hashlib.blake2b(key, digest_size=KEY_BYTES, person=b"tierkv-sim").digest())


def as_page_keys(keys: Sequence[PageKey]) -> tuple[PageKey, ...]:
    """One request's keys as the manager's 16-byte keys (:func:`page_key`); unchanged if they are."""
    if all(len(k) == KEY_BYTES for k in keys):
        return tuple(keys)
    return tuple(page_key(k) for k in keys)


class SimManager:
    """A :class:`BlockManager` over tiers of ``capacities`` pages (fastest first), one policy
    each from ``make`` (called fastest tier first); ``promote``: promote hits from slower tiers.

    ``tier_hits[i]`` counts pages served from tier ``i``; ``rejected`` the puts refused for
    being larger than every tier together. InputError for no tiers, more than four, or a
    tier of no slots.
    """

    def __init__(self, capacities: Sequence[int], make: Callable[[], Policy], promote: bool = True) -> None:
        self.capacities = list(capacities)
        self.tiers = sim_tiers(self.capacities)
        self.policies = [make() for _ in self.tiers]
        self.manager = BlockManager(self.tiers, {t.name: p for t, p in zip(self.tiers, self.policies)}, None)
        self.promote = promote
        self.tier_hits = [0] * len(self.tiers)
        self.rejected = 0
        self._names: list[TierId] = [t.name for t in self.tiers]   # by level
        self._persistent = {t.name for t in self.tiers if t.persistent}
        self._given: dict[PageKey, PageKey] = {}   # digest -> the key a caller gave, where they differ
        self._seen: list[tuple[PageKey, ...]] = []  # every request's keys (for ``where``)

    # -- one request ---------------------------------------------------------------------
    def request(self, keys: Sequence[PageKey], now: float = 0.0) -> int:
        """Run one request whose full pages are ``keys``; returns how many leading pages hit.

        A request without a full page never reaches the store. ``now`` (the request's
        arrival) is not passed on: the manager's ``note_request`` stamps the request with
        its own clock, as in the store (no policy reads it).
        """
        if not keys:
            return 0
        if all(len(k) == KEY_BYTES for k in keys):
            ks = tuple(keys)
        else:
            ks = tuple(page_key(k) for k in keys)
            self._given.update(zip(ks, keys))
        self._seen.append(ks)
        m = self.manager
        levels = m.resident.prefix_values(b"".join(ks))    # Store.lookup
        m.note_request(ks)                                   # once per request, before its touches
        if levels:
            self._get(ks[:len(levels)], levels)
        self._put(ks)
        return len(levels)

    def _get(self, hits: Sequence[PageKey], levels: bytes) -> None:
        """Store.get: each page read from its fastest tier (Transfers.read), then promoted."""
        touch, names, tier_hits = self.manager.touch, self._names, self.tier_hits
        for k, level in zip(hits, levels):
            touch(k, names[level])
            tier_hits[level] += 1
        if self.promote and any(levels):
            protect = set(hits)
            for level in sorted(set(levels) - {0}):    # Store._promote: one plan per source tier
                picked = [k for k, lv in zip(hits, levels) if lv == level]
                self._run(self.manager.plan_promote(picked, names[0], protect))

    def _put(self, keys: Sequence[PageKey]) -> None:
        """Store.put: the pages no tier holds are stored, the cached ones are the plan's prefix.

        The store asks ``manager.entry(key) is None``; here every plan is published before
        the next call, so a page the manager holds is exactly a resident one.
        """
        resident = self.manager.resident
        new: list[tuple[PageKey, PageKey | None]] = []
        prefix: list[PageKey] = []
        for j, k in enumerate(keys):
            if k in resident:
                prefix.append(k)
            else:
                new.append((k, keys[j - 1] if j else None))
        if not new:
            return
        try:
            plan = self.manager.plan_store(new, SIM_PAGE_BYTES, prefix=prefix)
        except CapacityError:   # more new pages than all tiers hold: the engine goes on uncached
            self.rejected += 1
            return
        self._run(plan)

    def _run(self, plan: MovePlan) -> None:
        """Transfers.run without the copies: publish each group of moves, then of placements."""
        m = self.manager
        levels = m.levels
        for moves in plan.move_groups(levels):
            m.publish(moves.placed(), self._checksums(moves.dst, moves.keys), plan)
        for batch in plan.placed_by_level(levels):
            m.publish(batch, self._checksums(batch.tier, batch.keys), plan)
        m.commit_deletes(plan)

    def _checksums(self, name: TierId, keys: list[PageKey]) -> dict[PageKey, int]:
        return dict.fromkeys(keys, 0) if name in self._persistent else _NO_CHECKSUMS

    # -- inspection (tests) ------------------------------------------------------------------
    @property
    def used(self) -> list[int]:
        """Slots in use per tier, fastest first."""
        return [t.num_slots - t.num_free for t in self.tiers]

    def _keys_seen(self) -> dict[PageKey, None]:
        return dict.fromkeys(k for keys in self._seen for k in keys)

    @property
    def where(self) -> dict[PageKey, int]:
        """Every cached page (as the caller gave its key) -> bit ``i`` set when tier ``i`` holds it.

        A snapshot built from ``manager.locate``: O(pages requested so far).
        """
        out: dict[PageKey, int] = {}
        levels = self.manager.levels
        for k in self._keys_seen():
            loc = self.manager.locate(k)
            if loc is not None:
                out[self._given.get(k, k)] = sum(1 << levels[name] for name, _ in loc.slots)
        return out

    @property
    def parent(self) -> dict[PageKey, PageKey | None]:
        """Every cached page -> its parent (keys as the caller gave them); a snapshot, as ``where``."""
        out: dict[PageKey, PageKey | None] = {}
        for k in self._keys_seen():
            loc = self.manager.locate(k)
            if loc is not None:
                out[self._given.get(k, k)] = None if loc.parent is None else self._given.get(loc.parent, loc.parent)
        return out
