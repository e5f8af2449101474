"""Least-recently-used eviction, admitting everything: the baseline, and its prefix-aware twin.

:class:`LRUPolicy` is O(1) per insert, touch and remove; ``victims`` walks from the
oldest entry and skips pinned or protected keys. :class:`LeafLRUPolicy` evicts the
oldest *leaf* instead, so a page never outlives its prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from tierkv.keys import PageKey
from tierkv.policy.leaves import LeafHeaps


class LRUPolicy:
    """Evict the least recently used page first."""

    def __init__(self) -> None:
        self._order: OrderedDict[PageKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def on_request(self, keys: Sequence[PageKey], now: float) -> None:
        pass

    def insert(self, key: PageKey, parent: PageKey | None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: PageKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: PageKey) -> None:
        self._order.pop(key, None)

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        out: list[PageKey] = []
        for key in self._order:
            if len(out) >= n:
                break
            if evictable(key):
                out.append(key)
        return out

    def admit(self, key: PageKey, parent: PageKey | None) -> bool:
        return True


class LeafLRUPolicy:
    """Prefix-aware LRU: evict the least recently used *leaf*, so descendants go first.

    A page never outlives its prefix, and the pages of the request being served (told
    by ``on_request``) are not victims: evicting a prefix just read would leave the
    request's new pages without it. O(log n) per call (see :mod:`tierkv.policy.leaves`);
    the clock counts page accesses.
    """

    def __init__(self) -> None:
        self._leaves = LeafHeaps(1, young=False)
        self._now = 0.0
        self._request: frozenset[PageKey] = frozenset()

    def __len__(self) -> int:
        return len(self._leaves)

    def on_request(self, keys: Sequence[PageKey], now: float) -> None:
        self._request = frozenset(keys)

    def insert(self, key: PageKey, parent: PageKey | None) -> None:
        self._now += 1.0
        self._leaves.add(key, parent, 0, self._now)

    def touch(self, key: PageKey) -> None:
        self._now += 1.0
        self._leaves.touch(key, 0, self._now)

    def remove(self, key: PageKey) -> None:
        self._leaves.discard(key)

    def memory_bytes(self) -> int | None:
        """Bytes the compiled leaf heaps hold; None where they are the Python ones."""
        nbytes = getattr(self._leaves, "nbytes", None)
        return None if nbytes is None else int(nbytes())

    def remove_many(self, keys: bytes) -> None:
        """:meth:`remove` of each 16-byte key of ``keys`` (back to back), in order."""
        self._leaves.discard_many(keys)

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        leaves = self._leaves
        leaves.undo()
        out: list[PageKey] = []
        request = self._request
        try:
            while len(out) < n:
                cands = leaves.candidates(lambda k: k not in request and evictable(k))
                if not cands:
                    break
                leaves.take(cands[0][0])
                out.append(cands[0][0])
        finally:
            leaves.settle()
        return out

    def admit(self, key: PageKey, parent: PageKey | None) -> bool:
        return True
