"""The default policy: evict the leaf page with the lowest learned hit density (``"gittins"``).

Three ideas, each measured in ``docs/policies.md``:

* **Learn reuse from the whole request stream.** ``on_request`` shows every page a
  request needs, cached or not, so the policy keeps a bounded *ghost* of recently seen
  pages (last access, access count) and feeds a :class:`~tierkv.policy.hazard.ReuseModel`
  with every reuse. Pages are classed by how often they have been seen (0, 1, 2-3, 4-7,
  8+), and a new page is told apart by whether its request continues a prompt seen
  before that is not a hot shared prefix (the tail of a conversation turn) or starts a
  fresh one. The 76% of pages that are one-hit wonders sit in the new classes, whose
  learned hazard is low, so they leave young; the model also learns the think-time
  gap (a turn does not come back for tens of seconds, then often does), which LRU
  cannot wait through.
* **Prefix-aware.** Only leaves are evicted (:mod:`tierkv.policy.leaves`), so a page
  never outlives its prefix; the candidates are the oldest and the youngest leaf of
  each class (the learned index is unimodal in age), the lowest index wins.
* **Never trust noise over recency.** A candidate displaces the LRU choice (the oldest
  leaf) only if it has not been used more often than that leaf (a page both more
  recent and more frequent than LRU's victim stays), and only when its index is lower
  beyond both estimates' error bars (three standard errors, from how many reuses each
  estimate rests on). Where the model knows little (old ages, big caches) the policy
  therefore is leaf-first LRU. The pages of the request being served are never victims.

The clock counts requests, so the policy behaves the same whether a trace is replayed
at full speed or in real time. Without ``on_request`` it is leaf-first LRU on a clock
of page accesses (pages adopted at a store's start, say), which requests then continue.
With a :class:`~tierkv.policy.cost.CostModel`, indices are weighted by the seconds a
hit saves and pages not worth loading from the tier are not admitted.

Cost per access: O(log n) heap work plus O(classes) candidates per victim; the model
is refreshed every 64 requests in O(classes * bins^2) numpy work.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tierkv.keys import PageKey
from tierkv.policy.cost import CostModel
from tierkv.policy.hazard import MAX_AGE, ReuseModel, age_bin
from tierkv.policy.leaves import Candidate, LeafHeaps

#: Access-count classes 0-4 (0, 1, 2-3, 4-7, 8 or more earlier accesses), and class 5:
#: a new page whose request continues a prompt seen before (not a hot shared prefix).
CLASSES = 6
HOT_CLASS = 4
CONTINUING = 5
#: How often a page of each class has been used, for the dominance rule: new pages rank 0.
USE_RANK = (0, 1, 2, 3, 4, 0)
#: Requests between refreshes of the index table.
REFRESH_REQUESTS = 64
#: Error bars of the index, in standard errors.
CONFIDENCE_Z = 3.0


def access_class(count: int) -> int:
    """The class of a page accessed ``count`` times before (0 to ``HOT_CLASS``)."""
    return min(count.bit_length(), HOT_CLASS)


class GittinsPolicy:
    """Leaf-first eviction by learned hit density, guarded by recency. See the module doc.

    ``ghost_pages`` bounds the pages remembered beyond the resident ones (about 270 bytes
    each in CPython, so about 18 MB per tier by default); the oldest are forgotten first.
    """

    def __init__(self, cost: CostModel | None = None, ghost_pages: int = 1 << 16) -> None:
        self._leaves = LeafHeaps(CLASSES)
        self._model = ReuseModel(CLASSES)
        self._ghost: OrderedDict[PageKey, list[float]] = OrderedDict()   # key -> [last, count, class]
        self._ghost_pages = ghost_pages
        self._now = 0.0
        self._requests = 0
        self._request: dict[PageKey, int] = {}     # this request's pages -> depth
        self._cost = cost
        self._depth: dict[PageKey, int] = {}
        self._scores: dict[Candidate, tuple[float, float]] = {}

    def __len__(self) -> int:
        return len(self._leaves)

    # -- what happened ---------------------------------------------------------------------
    def on_request(self, keys: Sequence[PageKey], now: float) -> None:
        self._requests += 1
        self._now = t = self._now + 1.0
        if self._requests % REFRESH_REQUESTS == 0:
            self._model.refresh(t)
        ghost, model = self._ghost, self._model
        new = CONTINUING if self._continues(keys) else 0
        for k in keys:
            e = ghost.get(k)
            if e is None:
                e = ghost[k] = [t, 0.0, 0.0]
            else:
                model.reuse(int(e[2]), e[0], t)
                ghost.move_to_end(k)
                e[0] = t
            c = access_class(int(e[1])) if e[1] else new
            e[1] += 1
            e[2] = c
            model.start(c, t)
        self._request = {k: d for d, k in enumerate(keys)}
        self._forget(t)

    def _continues(self, keys: Sequence[PageKey]) -> bool:
        """Whether the longest prefix of ``keys`` seen before ends in a page that is not hot."""
        deepest = None
        for k in keys:
            e = self._ghost.get(k)
            if e is None:
                break
            deepest = e
        return deepest is not None and access_class(int(deepest[1])) < HOT_CLASS

    def _forget(self, t: float) -> None:
        limit = self._ghost_pages + len(self._leaves)
        ghost = self._ghost
        while ghost:
            k, e = next(iter(ghost.items()))
            if len(ghost) <= limit and t - e[0] < MAX_AGE:
                break
            ghost.popitem(last=False)
            self._model.censor(int(e[2]), e[0], t)

    def _tick(self) -> float:
        if not self._requests:          # no request hints: a clock of page accesses
            self._now += 1.0
        return self._now

    def _class(self, key: PageKey) -> int:
        e = self._ghost.get(key)
        return int(e[2]) if e is not None else 0

    def insert(self, key: PageKey, parent: PageKey | None) -> None:
        self._leaves.add(key, parent, self._class(key), self._tick())
        if self._cost is not None:
            self._depth[key] = self._depth_of(key, parent)

    def touch(self, key: PageKey) -> None:
        self._leaves.touch(key, self._class(key), self._tick())

    def remove(self, key: PageKey) -> None:
        self._leaves.discard(key)
        self._depth.pop(key, None)

    # -- what to evict -----------------------------------------------------------------------
    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        leaves = self._leaves
        leaves.undo()
        out: list[PageKey] = []
        self._scores = {}
        request = self._request

        def allowed(k: PageKey) -> bool:
            # A page the current request just used would leave its new pages without a prefix.
            return k not in request and evictable(k)

        try:
            while len(out) < n:
                cands = leaves.candidates(allowed)
                if not cands:
                    break
                key = self._choose(cands)
                leaves.take(key)
                out.append(key)
        finally:
            leaves.settle()
        return out

    def _choose(self, cands: list[Candidate]) -> PageKey:
        oldest = best = cands[0]
        best_err, best_v = self._bound(best)
        old_err, old_v = best_err, best_v
        for cand in cands:
            err, v = self._bound(cand)
            if v < best_v:
                best, best_err, best_v = cand, err, v
            if not cand[3] and (oldest[3] or cand[2] < oldest[2]):
                oldest, old_err, old_v = cand, err, v
        if best is oldest or not self._requests or USE_RANK[best[1]] > USE_RANK[oldest[1]]:
            return oldest[0]
        # The lower index wins only beyond both estimates' error bars.
        upper = best_v * (1.0 + best_err)
        lower = old_v * max(0.0, 1.0 - old_err)
        return best[0] if upper < lower else oldest[0]

    def _bound(self, cand: Candidate) -> tuple[float, float]:
        """Relative error of a candidate's score, and the score (cached for one victims call)."""
        got = self._scores.get(cand)
        if got is None:
            key, c, last, _ = cand
            b = age_bin(self._now - last)
            support = self._model.support[c][b]
            value = self._model.index[c][b]
            if self._cost is not None:
                value *= self._saved(key)
            # Fewer than one reuse seen counts as one: no reuses at all is evidence too.
            got = self._scores[cand] = (CONFIDENCE_Z / math.sqrt(max(support, 1.0)), value)
        return got

    def _saved(self, key: PageKey) -> float:
        assert self._cost is not None
        return max(self._cost.saved_s(self._depth.get(key, 0)), 0.0)

    def _depth_of(self, key: PageKey, parent: PageKey | None) -> int:
        d = self._request.get(key)
        if d is not None:
            return d
        return self._depth.get(parent, -1) + 1 if parent is not None else 0

    def admit(self, key: PageKey, parent: PageKey | None) -> bool:
        return self._cost is None or self._cost.saved_s(self._depth_of(key, parent)) > 0
