"""Belady's OPT, the offline reference (``"opt"`` in the simulator; not a store policy).

It needs the future: :class:`Future` holds, for every page of every request of a
trace, where that page is needed next (a global position counting pages of requests
in order, so that within one request the deeper pages are needed later and go first,
as a prefix cache wants). The policy evicts the resident page needed farthest in the
future, and does not admit a page that is never needed again. It must be told every
request, in order, through ``on_request``. O(log n).

Each tier has its own instance, and a page reaches a tier below outside its requests
(demoted from the tier above, or copied down), so every instance remembers the next
use of every page it has been shown, not only the current request's: a page arriving
while no request names it is still ranked by when it is needed (memory: O(distinct
pages) per instance). Per-tier Belady is a heuristic for several tiers, not the
optimum (see ``docs/policies.md``, "OPT over two tiers").
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from tierkv.errors import InputError
from tierkv.keys import PageKey

NEVER = float("inf")


class Future:
    """Next-use positions for a sequence of requests, each a sequence of page keys."""

    def __init__(self, requests: Sequence[Sequence[PageKey]]) -> None:
        nxt: dict[PageKey, float] = {}
        pos = sum(len(keys) for keys in requests)
        out: list[tuple[float, ...]] = [()] * len(requests)
        for i in range(len(requests) - 1, -1, -1):
            keys = requests[i]
            pos -= len(keys)
            out[i] = tuple(nxt.get(k, NEVER) for k in keys)
            for j, k in enumerate(keys):
                nxt[k] = float(pos + j)
        self._next = out
        self._keys = [tuple(keys) for keys in requests]

    def __len__(self) -> int:
        return len(self._next)

    def next_uses(self, index: int, keys: Sequence[PageKey]) -> tuple[float, ...]:
        """Where each page of request ``index`` is needed next; ``keys`` must be that request's."""
        if index >= len(self._next) or tuple(keys) != self._keys[index]:
            raise InputError(f"request {index} does not match the future this Belady policy was built for")
        return self._next[index]


class BeladyPolicy:
    """Evict the resident page whose next use is farthest (never used again: first).

    Given its tier's ``capacity`` it also bypasses: a page of a full tier is not
    admitted when it is needed later than every resident page, as Belady's rule with
    the new page among the candidates would evict it at once. Pages inserted or admitted
    are ranked by their next use as of the last request (:meth:`on_request`), whether
    that request named them or not.
    """

    #: Admission compares a page with the farthest resident one, which changes with every
    #: eviction: the manager demotes into this tier one page at a time (not a run with one
    #: reservation), so the simulator's optimum stays exact.
    admits_alone = True

    def __init__(self, future: Future, capacity: int | None = None) -> None:
        self._future = future
        self._capacity = capacity
        self._pending: set[PageKey] = set()            # admitted since the last request, not yet inserted
        self._index = 0
        self._known: dict[PageKey, float] = {}         # every key shown so far -> its next use from now
        self._depth: dict[PageKey, int] = {}           # every key shown so far -> its place in its request
        self._next: dict[PageKey, float] = {}          # resident key -> next use
        self._parent: dict[PageKey, PageKey] = {}      # resident key -> its parent, where it has one
        self._kids: dict[PageKey, int] = {}            # key -> how many resident pages name it as parent
        # (-next use, -depth, key), stale entries skipped: of pages never needed again (the
        # only ties) the deepest go first, so a chain leaves leaf first, as the manager wants.
        self._heap: list[tuple[float, int, PageKey]] = []

    def __len__(self) -> int:
        return len(self._next)

    def on_request(self, keys: Sequence[PageKey], now: float) -> None:
        uses = self._future.next_uses(self._index, keys)
        self._index += 1
        request = dict(zip(keys, uses))
        self._known.update(request)
        self._depth.update(zip(keys, range(len(keys))))
        self._pending.clear()
        for k, nu in request.items():
            if k in self._next:
                self._set(k, nu)

    def _set(self, key: PageKey, nu: float) -> None:
        self._next[key] = nu
        depth = self._depth
        heapq.heappush(self._heap, (-nu, -depth.get(key, 0), key))
        if len(self._heap) > 2 * len(self._next) + 64:
            self._heap = [(-v, -depth.get(k, 0), k) for k, v in self._next.items()]
            heapq.heapify(self._heap)

    def insert(self, key: PageKey, parent: PageKey | None) -> None:
        self._pending.discard(key)
        if parent is not None and key not in self._next:
            self._parent[key] = parent
            self._kids[parent] = self._kids.get(parent, 0) + 1
        self._set(key, self._known.get(key, NEVER))

    def touch(self, key: PageKey) -> None:
        pass

    def remove(self, key: PageKey) -> None:
        if self._next.pop(key, None) is None:
            return
        parent = self._parent.pop(key, None)
        if parent is not None:
            left = self._kids[parent] - 1
            if left:
                self._kids[parent] = left
            else:
                del self._kids[parent]

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        out: list[PageKey] = []
        skipped: list[tuple[float, int, PageKey]] = []
        chosen: set[PageKey] = set()
        while len(out) < n and self._heap:
            entry = heapq.heappop(self._heap)
            key = entry[2]
            if self._next.get(key) != -entry[0] or key in chosen:
                continue
            if evictable(key):
                out.append(key)
                chosen.add(key)
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return out

    def admit(self, key: PageKey, parent: PageKey | None) -> bool:
        """Pages never needed again are not worth a slot, nor ones a full tier would evict first.

        This holds for pages demoted from the tier above too: Belady's rule for this tier
        would evict such a page at once, so it is dropped instead of taking the place of a
        page needed sooner. Except a page a resident page names as its parent: the child
        is reachable only through it, and a page is never needed later than its child
        (every prompt holding the child holds it, earlier), so it displaces nothing Belady
        would keep: with a finite next use it passes the test below, and never needed
        again it finds the child (never needed again too) among the farthest. Refused, it
        would be kept in the tier above (the manager does not strand a cached child) and
        offered again at every eviction there.
        """
        if key in self._kids:
            self._pending.add(key)
            return True
        nu = self._known.get(key, NEVER)
        if nu == NEVER:
            return False
        if self._capacity is not None and len(self._next) + len(self._pending) >= self._capacity:
            if not self._heap or nu > self._farthest():
                return False
        self._pending.add(key)
        return True

    def _farthest(self) -> float:
        heap = self._heap
        while heap and self._next.get(heap[0][2]) != -heap[0][0]:
            heapq.heappop(heap)
        return -heap[0][0] if heap else NEVER
