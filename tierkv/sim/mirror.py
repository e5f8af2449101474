"""The simulator's block manager: the store's policy calls, without bytes, slots or an index.

:class:`SimManager` mirrors what :class:`tierkv.store.manager.BlockManager`, :mod:`tierkv.store.api`
and :mod:`tierkv.store.transfer` ask of the per-tier policies for one request, in the same
order, so a policy class behaves here exactly as it does in the store:

1. ``on_request(keys, now)`` on every tier's policy (the request-level hint);
2. ``get``: the leading cached pages are touched in order, each in its fastest tier;
   pages found only below the top tier are promoted (inclusive copy-up, victims asked
   of the top tier with the leading pages protected), unless promotion is off;
3. ``put``: the request's full pages with no copy anywhere are offered to each tier,
   fastest first: ``admit`` per page, then ``victims`` for the room still missing
   (the request's new pages protected); a victim whose last copy leaves is demoted to
   the next tier down if that tier's policy admits it, else dropped. Demoted pages are
   inserted below before the new pages are inserted, as the transfers publish them.
   A full tier that has a tier below evicts at least ``DEMOTION_BATCH`` pages (at most
   1/16 of it) at a time, as the manager does; every tier but the last is taken to be
   volatile, the last one persistent. As in the manager, a page's parent is not evicted
   from the tier the page is being demoted into, and a page whose last copy can neither
   move down nor be dropped (cached descendants depend on it) stays for that plan.

Called by :mod:`tierkv.sim.run`; single-threaded. Keys are whatever the caller
supplies (the simulator uses 8-byte block ids).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tierkv.errors import InputError
from tierkv.keys import PageKey
from tierkv.store.manager import DEMOTION_BATCH
from tierkv.policy.base import Policy


class SimManager:
    """Tiers of ``capacities`` slots (fastest first), one policy each, pages as bit masks of tiers."""

    def __init__(self, capacities: Sequence[int], make: Callable[[], Policy], promote: bool = True) -> None:
        if not capacities or min(capacities) < 1:
            raise InputError(f"every simulated tier needs at least one slot, got {list(capacities)}")
        self.capacities = list(capacities)
        self.policies = [make() for _ in capacities]
        self.used = [0] * len(capacities)
        self.promote = promote
        self.where: dict[PageKey, int] = {}       # key -> bit i set when tier i holds it
        self.parent: dict[PageKey, PageKey | None] = {}
        self.kids: dict[PageKey, set[PageKey]] = {}  # cached children of each page
        self.tier_hits = [0] * len(capacities)
        self.rejected = 0                         # puts larger than every tier together
        self._parents_below: dict[int, set[PageKey]] = {}   # per plan, as MovePlan.parents_below
        self._kept: set[PageKey] = set()                     # per plan, as MovePlan.kept

    # -- one request ---------------------------------------------------------------------
    def request(self, keys: Sequence[PageKey], now: float) -> int:
        """Run one request whose full pages are ``keys``; returns how many leading pages hit.

        A request without a full page never reaches the store (nothing to look up or keep).
        """
        if not keys:
            return 0
        for p in self.policies:
            p.on_request(keys, now)
        where = self.where
        lead = 0
        for k in keys:
            if k not in where:
                break
            lead += 1
        if lead:
            self._get(keys[:lead])
        self._put(keys, lead)
        return lead

    def _get(self, hits: Sequence[PageKey]) -> None:
        where, policies, tier_hits = self.where, self.policies, self.tier_hits
        below_top: list[PageKey] = []
        for k in hits:
            t = _fastest(where[k])
            policies[t].touch(k)
            tier_hits[t] += 1
            if t:
                below_top.append(k)
        if below_top and self.promote:
            self._promote(below_top, set(hits))

    def _promote(self, keys: list[PageKey], protect: set[PageKey]) -> None:
        self._parents_below, self._kept = {}, set()
        moves: list[tuple[PageKey, int]] = []
        got = self._reserve(0, len(keys), protect | set(keys), moves)
        self._publish(moves, [(k, 0) for k in keys[:got]])

    def _put(self, keys: Sequence[PageKey], lead: int) -> None:
        where = self.where
        new = [(k, keys[i - 1] if i else None) for i, k in enumerate(keys) if i >= lead and k not in where]
        if not new:
            return
        if len(new) > sum(self.capacities):
            self.rejected += 1
            return
        protect = {k for k, _ in new}
        self._parents_below, self._kept = {}, set()
        moves: list[tuple[PageKey, int]] = []
        placed: list[tuple[PageKey, int]] = []
        todo = new
        for t, policy in enumerate(self.policies):
            if not todo:
                break
            admitted = [(k, p) for k, p in todo if policy.admit(k, p)]
            got = self._reserve(t, len(admitted), protect, moves)
            for k, p in admitted[:got]:
                placed.append((k, t))
                where[k] = 1 << t
                self.parent[k] = p
                if p is not None:
                    self.kids.setdefault(p, set()).add(k)
            done = {k for k, _ in admitted[:got]}
            todo = [(k, p) for k, p in todo if k not in done]
        self._publish(moves, placed)

    # -- room ------------------------------------------------------------------------------
    def _reserve(self, t: int, n: int, protect: set[PageKey], moves: list[tuple[PageKey, int]]) -> int:
        """Make room for up to ``n`` pages in tier ``t``; returns how many slots it took."""
        need = n - (self.capacities[t] - self.used[t])
        if need > 0 and t + 1 < len(self.capacities):
            need = max(need, min(DEMOTION_BATCH, self.capacities[t] // 16))
        if need > 0:
            last, bit, kids, where = t + 1 == len(self.capacities), 1 << t, self.kids, self.where
            faster = bit - 1
            parents, kept = self._parents_below.get(t, ()), self._kept

            def evictable(k: PageKey) -> bool:
                # As the manager: the last tier keeps the last copy of a page while a
                # child of it lives in a faster tier (dropping it would orphan the child).
                if k in protect or k in parents or k in kept:
                    return False
                if last and where[k] == bit:
                    return not any(where[c] & faster for c in kids.get(k, ()))
                return True

            for victim in self.policies[t].victims(need, evictable):
                self._evict(victim, t, protect, moves)
        got = min(n, self.capacities[t] - self.used[t])
        self.used[t] += got
        return got

    def _evict(self, key: PageKey, t: int, protect: set[PageKey], moves: list[tuple[PageKey, int]]) -> None:
        mask = self.where[key] & ~(1 << t)
        lower = t + 1
        got = 0
        if not mask and lower < len(self.policies):  # its last copy: demoted, or dropped
            parent = self.parent[key]
            if self.policies[lower].admit(key, parent):
                if parent is not None:  # as the manager's MovePlan.parents_below
                    self._parents_below.setdefault(lower, set()).add(parent)
                got = self._reserve(lower, 1, protect | {key}, moves)
            if not got and self.kids.get(key):  # as MovePlan.kept: cached descendants depend on it
                self._kept.add(key)
                return
        self.policies[t].remove(key)
        self.used[t] -= 1
        if not mask:
            if not got:
                self._drop(key)
                return
            moves.append((key, lower))
            mask = 1 << lower
        self.where[key] = mask

    def _drop(self, key: PageKey) -> None:
        del self.where[key]
        parent = self.parent.pop(key)
        if parent is not None:
            sib = self.kids[parent]
            sib.discard(key)
            if not sib:
                del self.kids[parent]

    def _publish(self, moves: list[tuple[PageKey, int]], placed: list[tuple[PageKey, int]]) -> None:
        """Insert demoted pages (deepest tier first), then placed pages (fastest tier first)."""
        where, policies = self.where, self.policies
        for k, t in sorted(moves, key=lambda m: -m[1]) + sorted(placed, key=lambda p: p[1]):
            if k in where:  # a page demoted and then evicted again within one plan is gone
                where[k] |= 1 << t
                policies[t].insert(k, self.parent[k])


def _fastest(mask: int) -> int:
    return (mask & -mask).bit_length() - 1
