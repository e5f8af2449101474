"""The default policy: evict the leaf page with the lowest learned hit density (``"gittins"``).

Five ideas, each measured in ``docs/policies.md``:

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
* **Know what has been left behind.** When a request follows a cached prompt only up to
  some page that is not a hot shared prefix and then differs (an edited or regenerated
  turn), the rest of the earlier prompt is *abandoned*: its pages move to a class of
  their own, whose reuse is learned like any other (on the Mooncake trace they almost
  never come back), so they leave first.
* **Do not admit what would be the next victim.** Once the tier is full, a new page of
  the request being served is not admitted when its class's index at age 0 is below,
  beyond both error bars, the index of the page the policy would evict to make room for
  it; the pages after it in the prompt are then not admitted either, so what is kept
  stays a prefix. A page more used than that victim is admitted (the dominance rule
  below); pages demoted from a tier above are always admitted.
* **Never trust noise over recency.** A candidate displaces the LRU choice (the oldest
  leaf) only if it has not been used more often than that leaf (a page both more
  recent and more frequent than LRU's victim stays), and only when its index is lower
  beyond both estimates' error bars (three standard errors, from how many reuses each
  estimate rests on). Where the model knows little (old ages, big caches) the policy
  therefore is leaf-first LRU. The pages of the request being served are never victims.

The clock counts requests, so the policy behaves the same whether a trace is replayed
at full speed or in real time. Without ``on_request`` it is leaf-first LRU on a clock
of page accesses (pages adopted at a store's start, say), which requests then continue.
With a :class:`~tierkv.recompute.CostModel` of its tier (``GittinsPolicy(cost=...)``;
no store config builds one, the figures in ``docs/policies.md`` are without), indices
are weighted by the seconds a hit saves and pages not worth loading from the tier are
not admitted.

Cost per access: O(log n) heap work plus O(classes) candidates per victim and once per
request for admission; marking an abandoned branch costs O(log n) per page of it (each
page is marked at most once per access); the model is refreshed every 64 requests in
O(classes * bins^2) numpy work.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from tierkv.errors import InputError
from tierkv.keys import KEY_BYTES, PageKey
from tierkv.policy import hazard
from tierkv.policy.hazard import MAX_AGE, ReuseModel, age_bin
from tierkv.policy.leaves import Candidate, LeafHeaps, NativeLeafHeaps
from tierkv.recompute import CostModel

try:  # the compiled ghost; optional so that a machine without a compiler still works
    from tierkv.policy import _ghost  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised where the extension is absent
    _ghost = None

#: Access-count classes 0-4 (0, 1, 2-3, 4-7, 8 or more earlier accesses); class 5: a new
#: page whose request continues a prompt seen before (not a hot shared prefix); class 6:
#: a page of a branch that a later request left (abandoned).
CLASSES = 7
HOT_CLASS = 4
CONTINUING = 5
ABANDONED = 6
#: How often a page of each class has been used, for the dominance rule: new and
#: abandoned pages rank 0.
USE_RANK = (0, 1, 2, 3, 4, 0, 0)
_USE_RANK_BYTES = bytes(USE_RANK)
#: Requests between refreshes of the index table.
REFRESH_REQUESTS = 64
#: Error bars of the index, in standard errors.
CONFIDENCE_Z = 3.0


def access_class(count: int) -> int:
    """The class of a page accessed ``count`` times before (0 to ``HOT_CLASS``)."""
    return min(count.bit_length(), HOT_CLASS)


#: Whether policies keep their ghost compiled by default (see :class:`GittinsPolicy`).
NATIVE_GHOST = (
    _ghost is not None and os.environ.get("TIERKV_PURE_POLICY") != "1"
    and (_ghost.HOT_CLASS, _ghost.CONTINUING, _ghost.ABANDONED) == (HOT_CLASS, CONTINUING, ABANDONED)
    and (_ghost.START, _ghost.REUSE, _ghost.CENSOR) == (hazard.START, hazard.REUSE, hazard.CENSOR)
)


class GittinsPolicy:
    """Leaf-first eviction by learned hit density, guarded by recency. See the module doc.

    ``ghost_pages`` bounds the pages remembered beyond the resident ones; the oldest are
    forgotten first. The ghost (per page: last access, count, class, the next page of its
    last request) is compiled (``tierkv.policy._ghost``: a 20-byte node per page, in the
    page's 56-byte record of a key table it shares with the compiled leaf heaps, whose
    node is there too; the whole per-request pass in C) where the extensions are built,
    unless ``native=False`` or ``TIERKV_PURE_POLICY=1`` was set when this module was
    first imported; otherwise it is an ``OrderedDict`` of lists (about 270 bytes per
    page). The same switch runs the
    victims loop in C (``LeafHeaps.choose_victims``, scored from the same tables) where
    the native heaps are built. Both decide the same, to the bit
    (tests/policy/test_gittins_native.py); the compiled one takes only page keys
    of 1 to 16 bytes (:class:`~tierkv.errors.InputError` otherwise).
    """

    def __init__(self, cost: CostModel | None = None, ghost_pages: int = 1 << 16,
                 native: bool | None = None) -> None:
        use_native = NATIVE_GHOST if native is None else native and _ghost is not None
        # The compiled ghost and leaf heaps hold one copy of the keys they share (most
        # resident pages are remembered too): one key table for both.
        self._keys = _ghost.new_keys() if use_native and LeafHeaps is NativeLeafHeaps else None
        self._leaves = LeafHeaps(CLASSES) if self._keys is None else NativeLeafHeaps(CLASSES, keys=self._keys)
        self._model = ReuseModel(CLASSES)
        self._native = _ghost.Ghost(MAX_AGE, keys=self._keys) if use_native else None
        # The same switch picks the compiled victims loop (where the native heaps have it).
        self._native_victims = use_native
        self._ghost: OrderedDict[PageKey, list[float]] = OrderedDict()   # key -> [last, count, class]
        self._ghost_pages = ghost_pages
        self._now = 0.0
        self._requests = 0
        self._request_keys: tuple[PageKey, ...] = ()   # this request's pages, in order
        self._request_map: dict[PageKey, int] | None = {}   # the same -> depth, once asked for (_request)
        self._cost = cost
        self._depth: dict[PageKey, int] = {}
        self._scores: dict[Candidate, tuple[float, float]] = {}
        self._next: dict[PageKey, PageKey] = {}    # page -> the page after it in its last request
        self._room = 0                             # resident pages when victims were last asked for (0: never)
        self._admitted = 0                         # pages of this request admitted so far
        self._bar: tuple[int, float, float] | None = None   # this request's admission bar
        self._refused = False                      # a page of this request was refused

    def __len__(self) -> int:
        return len(self._leaves)

    @property
    def _request(self) -> dict[PageKey, int]:
        """This request's pages -> their depth in it, built when first asked for: a tier
        that admits without weighing and evicts nothing never asks (a get, or a put into
        a tier with room, in the other tiers)."""
        got = self._request_map
        if got is None:
            keys = self._request_keys
            got = self._request_map = dict(zip(keys, range(len(keys))))
        return got

    # -- what happened ---------------------------------------------------------------------
    def on_request(self, keys: Sequence[PageKey], now: float) -> None:
        self._requests += 1
        self._now = t = self._now + 1.0
        self._model.advance(t)   # after a long stretch without requests (a reopen's inserts)
        if self._requests % REFRESH_REQUESTS == 0:
            self._model.refresh(t)
        if self._native is not None:
            self._request_native(keys, t)
        else:
            self._request_python(keys, t)
        self._request_keys, self._request_map = tuple(keys), None
        self._admitted, self._bar, self._refused = 0, None, False

    def _request_native(self, keys: Sequence[PageKey], t: float) -> None:
        """The pass of :meth:`_request_python` in one compiled call, the model fed in bulk."""
        assert self._native is not None
        leaves = self._leaves
        kinds, classes, times, moved = self._native.on_request(keys, t, self._ghost_pages + len(leaves))
        for k in moved:                 # residents of an abandoned branch keep their age
            if k in leaves:
                leaves.touch(k, ABANDONED, leaves.last_of(k))
        self._model.record_many(kinds, classes, times, t)

    def _request_python(self, keys: Sequence[PageKey], t: float) -> None:
        ghost, model, after = self._ghost, self._model, self._next
        new = CONTINUING if self._continues(keys) else 0
        for i, k in enumerate(keys):
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
            if i + 1 < len(keys):
                after[k] = keys[i + 1]
            else:
                after.pop(k, None)
        self._forget(t)

    def _continues(self, keys: Sequence[PageKey]) -> bool:
        """Whether the longest prefix of ``keys`` seen before ends in a page that is not hot.

        If it does and the prompt that page was last seen in went on differently, the
        rest of that prompt is marked abandoned (before this request's accesses).
        """
        deepest: PageKey | None = None
        depth = 0
        for k in keys:
            if k not in self._ghost:
                break
            deepest, depth = k, depth + 1
        if deepest is None or access_class(int(self._ghost[deepest][1])) >= HOT_CLASS:
            return False
        left = self._next.get(deepest)
        if left is not None and (depth == len(keys) or left != keys[depth]):
            self._abandon(left, self._ghost[deepest][0])
        return True

    def _abandon(self, key: PageKey | None, t0: float) -> None:
        """Move the pages of the branch from ``key`` on, last seen together at ``t0``, to ABANDONED.

        Their open reuse observations are censored in their old class and restarted,
        at the same last access, in the abandoned one; residents keep their age.
        """
        ghost, model, leaves = self._ghost, self._model, self._leaves
        while key is not None:
            e = ghost.get(key)
            if e is None or e[0] != t0 or int(e[2]) == ABANDONED:
                return
            model.censor(int(e[2]), t0, self._now)
            model.start(ABANDONED, t0)
            e[2] = ABANDONED
            if key in leaves:
                leaves.touch(key, ABANDONED, leaves.last_of(key))
            key = self._next.get(key)

    def _forget(self, t: float) -> None:
        limit = self._ghost_pages + len(self._leaves)
        ghost = self._ghost
        while ghost:
            k, e = next(iter(ghost.items()))
            if len(ghost) <= limit and t - e[0] < MAX_AGE:
                break
            ghost.popitem(last=False)
            self._next.pop(k, None)
            self._model.censor(int(e[2]), e[0], t)

    def _tick(self) -> float:
        if not self._requests:          # no request hints: a clock of page accesses
            self._now += 1.0
        return self._now

    def _class(self, key: PageKey) -> int:
        if self._native is not None:
            return int(self._native.class_of(key))
        e = self._ghost.get(key)
        return int(e[2]) if e is not None else 0

    def insert(self, key: PageKey, parent: PageKey | None) -> None:
        self._leaves.add(key, parent, self._class(key), self._tick())
        if self._cost is not None:
            self._depth[key] = self._depth_of(key, parent)

    def insert_many(self, keys: bytes, parents: bytes, has_parent: bytes) -> None:
        """:meth:`insert` of each 16-byte key of ``keys`` in order, in one call (the pages a
        reopen adopts): ``parents`` likewise, used where ``has_parent`` (a byte per page) is
        nonzero. The same state as the calls one by one."""
        n = len(keys) // KEY_BYTES
        add_many = getattr(self._leaves, "add_many", None)
        if add_many is None or self._cost is not None or len(keys) % KEY_BYTES:
            for i in range(n):
                j = i * KEY_BYTES
                self.insert(PageKey(keys[j:j + KEY_BYTES]),
                            PageKey(parents[j:j + KEY_BYTES]) if has_parent[i] else None)
            return
        if self._native is not None:
            classes = self._native.classes_of(keys) if len(self._native) else bytes(n)
        elif self._ghost:
            classes = bytes(self._class(PageKey(keys[j:j + KEY_BYTES])) for j in range(0, len(keys), KEY_BYTES))
        else:
            classes = bytes(n)              # nothing remembered: every page is class 0
        step = 0.0 if self._requests else 1.0
        t0 = self._now + step
        add_many(keys, parents, has_parent, classes, t0, step)
        self._now = t0 + (n - 1) * step if n else self._now

    def touch(self, key: PageKey) -> None:
        self._leaves.touch(key, self._class(key), self._tick())

    def touch_many(self, keys: bytes) -> None:
        """:meth:`touch` of each 16-byte key of ``keys`` in order, in one call (a get's hits):
        the same state as the calls one by one."""
        n = len(keys) // KEY_BYTES
        if len(keys) % KEY_BYTES:
            raise InputError(f"touch_many takes 16-byte keys back to back, got {len(keys)} bytes")
        if self._native is not None:
            classes = self._native.classes_of(keys) if len(self._native) else bytes(n)
        else:
            classes = bytes(self._class(PageKey(keys[j:j + KEY_BYTES])) for j in range(0, len(keys), KEY_BYTES))
        step = 0.0 if self._requests else 1.0
        t0 = self._now + step
        self._leaves.touch_many(keys, classes, t0, step)
        self._now = t0 + (n - 1) * step if n else self._now

    def remove(self, key: PageKey) -> None:
        self._leaves.discard(key)
        self._depth.pop(key, None)

    def key_table(self) -> object | None:
        """The key table the compiled ghost and leaf heaps share (a capsule), for the store's
        page table to keep its keys in too (``tierkv._table.PageTable(keys=...)``); None
        where they are the Python ones."""
        return self._keys

    def memory_bytes(self) -> int | None:
        """Bytes the compiled leaf heaps, ghost and their key table hold; None where either
        is the Python one."""
        nbytes = getattr(self._leaves, "nbytes", None)
        if nbytes is None or self._native is None:
            return None
        shared = 0 if self._keys is None else int(_ghost.keys_nbytes(self._keys))
        return int(nbytes()) + int(self._native.nbytes()) + shared

    def remove_many(self, keys: bytes) -> None:
        """:meth:`remove` of each 16-byte key of ``keys`` (back to back), in order."""
        self._leaves.discard_many(keys)
        if self._depth:
            for j in range(0, len(keys), KEY_BYTES):
                self._depth.pop(PageKey(keys[j:j + KEY_BYTES]), None)

    # -- what to evict -----------------------------------------------------------------------
    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        leaves = self._leaves
        leaves.undo()
        self._room = len(leaves)
        out: list[PageKey] = []
        self._scores = {}
        request = self._request

        def allowed(k: PageKey) -> bool:
            # A page the current request just used would leave its new pages without a prefix.
            return k not in request and evictable(k)

        choose = getattr(leaves, "choose_victims", None)
        try:
            if choose is not None and self._cost is None and self._native_victims:
                # The loop below in one compiled call (the native heaps), scored from the same
                # tables; the request's pages excluded there, without a Python call each.
                index, support = self._model.tables()
                return choose(n, evictable, index, support, self._now, CONFIDENCE_Z, _USE_RANK_BYTES,
                              bool(self._requests), hazard._LOG_GROWTH, hazard.BINS, request)
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
            got = self._scores[cand] = self._score(key, c, self._now - last)
        return got

    def _score(self, key: PageKey, c: int, age: float) -> tuple[float, float]:
        """Relative error and value of the index of page ``key`` of class ``c`` at ``age``."""
        b = age_bin(age)
        support = self._model.support[c][b]
        value = self._model.index[c][b]
        if self._cost is not None:
            value *= self._saved(key)
        # Fewer than one reuse seen counts as one: no reuses at all is evidence too.
        return CONFIDENCE_Z / math.sqrt(max(support, 1.0)), value

    def _saved(self, key: PageKey) -> float:
        assert self._cost is not None
        depth = self._depth.get(key)
        if depth is None:               # a page of this request, not inserted yet
            depth = self._request.get(key, 0)
        return max(self._cost.saved_s(depth), 0.0)

    def _depth_of(self, key: PageKey, parent: PageKey | None) -> int:
        d = self._request.get(key)
        if d is not None:
            return d
        return self._depth.get(parent, -1) + 1 if parent is not None else 0

    def admit(self, key: PageKey, parent: PageKey | None) -> bool:
        if self._cost is not None and self._cost.saved_s(self._depth_of(key, parent)) <= 0:
            return False
        if key not in self._request:        # demoted from the tier above, or no request hints
            return True
        if self._refused:                   # what is kept of a prompt stays a prefix
            return False
        if self._room and len(self._leaves) + self._admitted >= self._room:
            self._refused = not self._beats_victim(key)
        if self._refused:
            return False
        self._admitted += 1
        return True

    def admit_all(self, keys: Sequence[PageKey]) -> bool:
        """Whether :meth:`admit` would take every one of ``keys`` in order without weighing
        any (no cost model, and the tier has room for all): then they are admitted, with
        the same state as calls one by one; False, nothing changed, where each must be
        asked (:meth:`admit_many`)."""
        if self._cost is None and not self._refused and (not self._room
                                                         or len(self._leaves) + self._admitted + len(keys) <= self._room):
            request = self._request_keys
            # A put's new pages are most often the request's pages themselves (the same
            # objects): all of them count, without the request's map.
            same = len(keys) == len(request) and tuple(keys) == request
            self._admitted += len(keys) if same else sum(map(self._request.__contains__, keys))
            return True
        return False

    def admit_many(self, pages: Sequence[tuple[PageKey, PageKey | None]]) -> list[bool]:
        """:meth:`admit` of each (key, parent) in order, in one call: the same answers and state.
        While the tier has room for all of them no page is weighed against a victim."""
        got = self.admit_keys([k for k, _ in pages])
        return [self.admit(k, p) for k, p in pages] if got is None else got

    def admit_keys(self, keys: Sequence[PageKey]) -> list[bool] | None:
        """:meth:`admit_many` from the pages' keys alone, which is all it weighs without a
        cost model (the manager need not build the (key, parent) pairs); None, nothing
        changed, where a cost model needs the parents."""
        n = len(keys)
        if self.admit_all(keys):
            return [True] * n
        if self._cost is not None:
            return None
        # admit() page by page, in bulk: pages not of this request are taken; of those that
        # are, the first ones fill what room is left unweighed, and the rest are weighed
        # against the victim in order until one is refused, which refuses all after it.
        # Without a cost model a page's weighing depends on its class alone, so each class
        # is weighed once, in the order of its first page (as the calls one by one would).
        out = np.ones(n, dtype=bool)
        ours = np.flatnonzero(np.fromiter(map(self._request.__contains__, keys), dtype=bool, count=n))
        if self._refused:
            out[ours] = False
            return out.tolist()  # type: ignore[no-any-return]
        room = self._room
        free = max(0, room - len(self._leaves) - self._admitted) if room else len(ours)
        weigh = ours[free:]
        stop = len(weigh)
        if stop:
            classes = self._classes([keys[i] for i in weigh.tolist()])
            _, first = np.unique(classes, return_index=True)
            for j in np.sort(first).tolist():   # each class at its first page, in page order
                if not self._beats_victim(keys[int(weigh[j])]):
                    stop = j
                    break
        self._admitted += min(free, len(ours)) + stop
        if stop < len(weigh):
            self._refused = True
            out[weigh[stop:]] = False
        return out.tolist()  # type: ignore[no-any-return]

    def _classes(self, keys: list[PageKey]) -> np.ndarray:
        """:meth:`_class` of each key, as uint8 (one compiled call where the ghost is)."""
        if self._native is not None:
            return np.frombuffer(self._native.classes_of(b"".join(keys)), dtype=np.uint8)
        return np.array([self._class(k) for k in keys], dtype=np.uint8)

    def _beats_victim(self, key: PageKey) -> bool:
        """Whether a new page is worth the page that would be evicted for it (see the module doc)."""
        if self._bar is None:
            self._bar = self._victim_score()
        rank, err, value = self._bar
        c = self._class(key)
        if USE_RANK[c] > rank:
            return True
        page_err, page_value = self._score(key, c, 0.0)
        return not page_value * (1.0 + page_err) < value * max(0.0, 1.0 - err)

    def _victim_score(self) -> tuple[int, float, float]:
        """Use rank, relative error and index of the page the next victims call would take first."""
        leaves, request = self._leaves, self._request
        leaves.undo()
        self._scores = {}
        try:
            cands = leaves.candidates(lambda k: k not in request)
            if not cands:
                return 0, 0.0, 0.0      # nothing to evict for it: the bar is zero
            key = self._choose(cands)
            cand = next(c for c in cands if c[0] == key)
            return (USE_RANK[cand[1]], *self._bound(cand))
        finally:
            leaves.settle()
