"""Least-recently-used eviction, admitting everything: the baseline policy.

O(1) per insert, touch and remove; ``victims`` walks from the oldest entry and skips
pinned or protected keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from tierkv.keys import PageKey


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
