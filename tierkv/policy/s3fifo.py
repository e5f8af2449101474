"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost FIFO.

New pages enter the small queue (10% of the pages held); one that was read while there
moves to the main queue when it reaches the end, the others leave and are remembered
in the ghost queue, and a page inserted again while remembered goes straight to main.
Main is a CLOCK with a 2-bit counter. It filters one-hit wonders well on web traces;
it is here as the admission-aware baseline (``"s3fifo"``) and is not prefix-aware.

The tier's size is not told to a policy, so "10%" is of the pages resident when
victims are asked for (the tier is full then). O(1) amortized per call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from tierkv.keys import PageKey

SMALL_SHARE = 0.1
MAX_FREQ = 3


class S3FIFOPolicy:
    """Small/main/ghost FIFOs with lazy promotion; see the module doc."""

    def __init__(self) -> None:
        self._small: OrderedDict[PageKey, None] = OrderedDict()
        self._main: OrderedDict[PageKey, None] = OrderedDict()
        self._ghost: OrderedDict[PageKey, None] = OrderedDict()
        self._freq: dict[PageKey, int] = {}
        self._pending: dict[PageKey, None] = {}   # victims handed out, not yet removed

    def __len__(self) -> int:
        return len(self._freq)

    def on_request(self, keys: Sequence[PageKey], now: float) -> None:
        pass

    def insert(self, key: PageKey, parent: PageKey | None) -> None:
        self._undo()
        if key in self._freq:
            self.remove(key)
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._freq[key] = 0

    def touch(self, key: PageKey) -> None:
        f = self._freq.get(key)
        if f is not None and f < MAX_FREQ:
            self._freq[key] = f + 1

    def remove(self, key: PageKey) -> None:
        if self._freq.pop(key, None) is not None:
            self._pending.pop(key, None)
            self._small.pop(key, None)
            self._main.pop(key, None)

    def _undo(self) -> None:
        """Victims handed out but never removed go back to the front of main."""
        for key in self._pending:
            self._main[key] = None
            self._main.move_to_end(key, last=False)
        self._pending.clear()

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        self._undo()
        out = self._pending
        # Each page is looked at a bounded number of times: a promotion or a CLOCK
        # decrement per visit, and MAX_FREQ + 2 visits exhaust any page.
        budget = (MAX_FREQ + 2) * (len(self._freq) + 1)
        while len(out) < n and budget > 0:
            budget -= 1
            small_due = len(self._small) >= SMALL_SHARE * len(self._freq) or not self._main
            key = self._evict_small(evictable) if small_due else None
            if key is None:
                key = self._evict_main(evictable)
            if key is None and not small_due:
                key = self._evict_small(evictable)
            if key is None:
                break
            if key is not _MOVED:
                out[key] = None
        return list(out)

    @staticmethod
    def _first(queue: OrderedDict[PageKey, None], evictable: Callable[[PageKey], bool]) -> PageKey | None:
        """The first evictable page; pages that are not (pinned, protected) move to the back,
        so the next look does not walk past them again (a second chance, as CLOCK gives)."""
        for _ in range(len(queue)):
            key = next(iter(queue))
            if evictable(key):
                return key
            queue.move_to_end(key)
        return None

    def _evict_small(self, evictable: Callable[[PageKey], bool]) -> PageKey | None:
        key = self._first(self._small, evictable)
        if key is None:
            return None
        if self._freq[key] > 0:
            del self._small[key]
            self._main[key] = None
            self._freq[key] = 0
            return _MOVED
        del self._small[key]
        self._ghost[key] = None
        if len(self._ghost) > max(len(self._main), 1):
            self._ghost.popitem(last=False)
        return key

    def _evict_main(self, evictable: Callable[[PageKey], bool]) -> PageKey | None:
        key = self._first(self._main, evictable)
        if key is None:
            return None
        if self._freq[key] > 0:
            self._freq[key] -= 1
            self._main.move_to_end(key)
            return _MOVED
        del self._main[key]
        return key

    def admit(self, key: PageKey, parent: PageKey | None) -> bool:
        return True


_MOVED = PageKey(b"")   # sentinel: a page changed queues, nothing was evicted
