"""Belady's OPT, the offline reference (``"opt"`` in the simulator; not a store policy).

It needs the future: :class:`Future` holds, for every page of every request of a
trace, where that page is needed next (a global position counting pages of requests
in order, so that within one request the deeper pages are needed later and go first,
as a prefix cache wants). The policy evicts the resident page needed farthest in the
future, and does not admit a page of the current request that is never needed again.
It must be told every request, in order, through ``on_request``. O(log n).
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
    the new page among the candidates would evict it at once.
    """

    def __init__(self, future: Future, capacity: int | None = None) -> None:
        self._future = future
        self._capacity = capacity
        self._admitted = 0
        self._index = 0
        self._request: dict[PageKey, float] = {}
        self._next: dict[PageKey, float] = {}          # resident key -> next use
        self._heap: list[tuple[float, PageKey]] = []   # (-next use, key), stale entries skipped

    def __len__(self) -> int:
        return len(self._next)

    def on_request(self, keys: Sequence[PageKey], now: float) -> None:
        uses = self._future.next_uses(self._index, keys)
        self._index += 1
        self._request = dict(zip(keys, uses))
        self._admitted = 0
        for k, nu in self._request.items():
            if k in self._next:
                self._set(k, nu)

    def _set(self, key: PageKey, nu: float) -> None:
        self._next[key] = nu
        heapq.heappush(self._heap, (-nu, key))
        if len(self._heap) > 2 * len(self._next) + 64:
            self._heap = [(-v, k) for k, v in self._next.items()]
            heapq.heapify(self._heap)

    def insert(self, key: PageKey, parent: PageKey | None) -> None:
        self._set(key, self._request.get(key, NEVER))

    def touch(self, key: PageKey) -> None:
        pass

    def remove(self, key: PageKey) -> None:
        self._next.pop(key, None)

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        out: list[PageKey] = []
        skipped: list[tuple[float, PageKey]] = []
        chosen: set[PageKey] = set()
        while len(out) < n and self._heap:
            neg, key = heapq.heappop(self._heap)
            if self._next.get(key) != -neg or key in chosen:
                continue
            if evictable(key):
                out.append(key)
                chosen.add(key)
            skipped.append((neg, key))
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return out

    def admit(self, key: PageKey, parent: PageKey | None) -> bool:
        """Pages never needed again are not worth a slot, nor ones a full tier would evict first."""
        nu = self._request.get(key, 0.0)
        if nu == NEVER:
            return False
        if self._capacity is not None and len(self._next) + self._admitted >= self._capacity:
            if not self._heap or nu > self._farthest():
                return False
        self._admitted += 1
        return True

    def _farthest(self) -> float:
        heap = self._heap
        while heap and self._next.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)
        return -heap[0][0] if heap else NEVER
