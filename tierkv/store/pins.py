"""Pins as the store hands them out: what each ``pin`` call took, so ``unpin`` releases
exactly that.

Pins on a page are counts in the block manager (policies only see unpinned pages).
A count alone cannot say which pages one holder's ``unpin`` should release: a shorter
prompt's holder would release a longer one's pin, and a page that left the store and
came back unpinned would hide the pages after it. The ledger keeps, per ``pin`` call,
the page keys and the manager entries it pinned; ``unpin`` releases the longest
outstanding pin whose keys are a prefix of the tokens' keys (pins on one prefix are
interchangeable, so every holder that unpins what it pinned releases one), and skips
entries that have left the store since. Each pin has an owner (None: the store's own
callers): an unpin considers only pins of its owner, and :meth:`PinLedger.release`
drops all of one owner's, so the node service, whose owners are its connections, never
releases one client's pin for another (a client's longer pin on the same prompt).
Used by :class:`tierkv.store.api.Store` under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.keys import KEY_BYTES
from tierkv.store.manager import BlockManager, Entry


@dataclass(frozen=True)
class _Pin:
    """One ``pin`` call: the keys of the pages it pinned, concatenated, their entries, and
    who took it."""

    keys: bytes
    entries: list[Entry]
    owner: int | None


class PinLedger:
    """The outstanding pins of one store, by the key of their first page."""

    def __init__(self, manager: BlockManager) -> None:
        self._manager = manager
        self._held: dict[bytes, list[_Pin]] = {}

    def pin(self, entries: list[Entry], owner: int | None = None) -> int:
        """Pin ``entries`` (a prompt's leading cached pages) as one call of ``owner``;
        returns how many."""
        if entries:
            for e in entries:
                self._manager.pin(e.key, +1)
            self._held.setdefault(entries[0].key, []).append(_Pin(b"".join(e.key for e in entries), entries, owner))
        return len(entries)

    def unpin(self, blob: bytes, owner: int | None = None) -> int:
        """Release the longest outstanding pin of ``owner`` whose keys start ``blob`` (a
        prompt's key blob); returns how many pages it unpinned (0 when none is outstanding)."""
        held = self._held.get(blob[:KEY_BYTES])
        fits = [i for i, p in enumerate(held or ()) if p.owner == owner and blob.startswith(p.keys)]
        if not held or not fits:
            return 0
        taken = held.pop(max(fits, key=lambda i: len(held[i].keys)))
        if not held:
            del self._held[blob[:KEY_BYTES]]
        return self._release(taken)

    def release(self, owner: int) -> int:
        """Release every outstanding pin of ``owner``; returns how many pages that unpinned."""
        released = 0
        for first in list(self._held):
            held = self._held[first]
            mine = [p for p in held if p.owner == owner]
            if not mine:
                continue
            held[:] = [p for p in held if p.owner != owner]
            if not held:
                del self._held[first]
            released += sum(map(self._release, mine))
        return released

    def _release(self, taken: _Pin) -> int:
        released = 0
        for e in taken.entries:
            if self._manager.current(e):  # not removed (and maybe stored again) since
                self._manager.pin(e.key, -1)
                released += 1
        return released

    def __len__(self) -> int:
        return sum(len(v) for v in self._held.values())
