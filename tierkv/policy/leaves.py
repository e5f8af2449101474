"""The resident pages of one tier as a prefix forest, with its leaves in two-ended heaps.

A page is useless without every page before it, so prefix-aware policies only ever
evict *leaves*: pages none of whose children are resident in the tier. Descendants
therefore always leave before their ancestors, and a prefix is never left with holes.
:class:`PyLeafHeaps` keeps, per class, the leaves ordered by last access and hands out
the oldest and the youngest of each class as eviction candidates; taking a leaf may
turn its parent into a leaf, which then becomes a candidate in the same call.

Victims handed out are *pending* until the manager removes them (``discard``); if
it does not, the next call puts them back (``undo``). O(log n) per operation.
Used by :mod:`tierkv.policy.gittins` and :mod:`tierkv.policy.lru`; not thread-safe.

:data:`LeafHeaps` is what the policies build: the compiled twin
(``tierkv.policy._leaves``, about 45 bytes per page of a prefix chain instead of
220-280, no Python object per page; about 37 more when the page is a leaf) where the
extension is built, this class otherwise, or when
``TIERKV_PURE_POLICY=1`` is set when the module is first imported. Both give the same
candidates in the same order (tests/policy/test_leaves_native.py); the compiled one
takes only page keys of 1 to 16 bytes (:class:`~tierkv.errors.InputError` otherwise)
and holds last accesses as floats.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Callable

from tierkv.errors import InputError
from tierkv.keys import KEY_BYTES, PageKey

#: An eviction candidate: ``(key, class, last access, from the young end)``.
Candidate = tuple[PageKey, int, float, bool]


class PyLeafHeaps:
    """Parent links, resident-child counts and per-class leaf heaps of one tier's pages."""

    def __init__(self, classes: int, young: bool = True) -> None:
        self.parent: dict[PageKey, PageKey | None] = {}
        self.last: dict[PageKey, float] = {}
        self.cls: dict[PageKey, int] = {}
        self._kids: dict[PageKey, int] = {}    # resident children, also of absent parents
        self._seq: dict[PageKey, int] = {}     # present only while the key is a leaf
        self._next = 0
        self._young = young
        self._old: list[list[tuple[float, int, PageKey]]] = [[] for _ in range(classes)]
        self._new: list[list[tuple[float, int, PageKey]]] = [[] for _ in range(classes)]
        self._leaves = [0] * classes
        self._pending: dict[PageKey, None] = {}
        self._stash: list[tuple[list[tuple[float, int, PageKey]], tuple[float, int, PageKey]]] = []
        self._allowed: set[PageKey] = set()   # leaves evictable said yes to in this victims call
        # Heads found by ``candidates`` within one victims call; classes changed since then.
        self._heads: list[list[Candidate]] = [[] for _ in range(classes)]
        self._dirty = set(range(classes))

    def __len__(self) -> int:
        return len(self.last)

    def __contains__(self, key: object) -> bool:
        return key in self.last

    def last_of(self, key: PageKey) -> float:
        """The last access of the resident ``key`` (KeyError if it is not)."""
        return self.last[key]

    def class_of(self, key: PageKey) -> int:
        """The class of the resident ``key`` (KeyError if it is not)."""
        return self.cls[key]

    def parent_of(self, key: PageKey) -> PageKey | None:
        """The parent of the resident ``key`` (KeyError if it is not)."""
        return self.parent[key]

    # -- changes -----------------------------------------------------------------------
    def add(self, key: PageKey, parent: PageKey | None, cls: int, t: float) -> None:
        """``key`` became resident (a leaf, since its children cannot be resident yet).

        Parent links must form a forest; a page that is its own parent is refused.
        """
        if parent == key:
            raise InputError(f"page key {key!r} cannot be its own parent")
        self.undo()
        if key in self.last:
            self.discard(key)
        self.parent[key] = parent
        self.last[key] = t
        self.cls[key] = cls
        self._kids.setdefault(key, 0)
        if parent is not None:
            self._adopt(parent)
        if self._kids[key] == 0:
            self._leaf(key)

    def touch(self, key: PageKey, cls: int, t: float) -> None:
        """``key`` was accessed at ``t`` and now belongs to class ``cls``."""
        self.undo()
        if key not in self.last:
            return
        if self._kids[key] == 0:
            self._unleaf(key)
        self.last[key] = t
        self.cls[key] = cls
        if self._kids[key] == 0:
            self._leaf(key)

    def touch_many(self, keys: bytes, classes: bytes, t0: float, step: float) -> None:
        """:meth:`touch` of each 16-byte key of ``keys`` in order, class ``classes[i]``, at
        ``t0 + i * step`` (the native heaps' batch call)."""
        if len(keys) % KEY_BYTES or len(classes) != len(keys) // KEY_BYTES:
            raise InputError(f"touch_many: {len(keys)} bytes of 16-byte keys and {len(classes)} classes do not "
                             "describe one batch")
        self.undo()
        for i, c in enumerate(classes):
            self.touch(PageKey(keys[i * KEY_BYTES:(i + 1) * KEY_BYTES]), c, t0 + i * step)

    def add_many(self, keys: bytes, parents: bytes, has_parent: bytes, classes: bytes, t0: float,
                 step: float) -> None:
        """:meth:`add` of each 16-byte key of ``keys`` in order, its parent from ``parents``
        where ``has_parent`` (a byte per page) is nonzero, class ``classes[i]``, at ``t0 + i *
        step`` (the native heaps' batch call)."""
        n = len(keys) // KEY_BYTES
        if len(keys) % KEY_BYTES or len(parents) != len(keys) or len(has_parent) != n or len(classes) != n:
            raise InputError(f"add_many: {len(keys)} bytes of 16-byte keys, {len(parents)} of parents, "
                             f"{len(has_parent)} has_parent and {len(classes)} classes do not describe one batch")
        for i in range(n):   # refused before anything is added, as the native call does
            j = i * KEY_BYTES
            if classes[i] >= len(self._old):
                raise InputError(f"add_many: class {classes[i]} of page {i} is out of range [0, {len(self._old)})")
            if has_parent[i] and keys[j:j + KEY_BYTES] == parents[j:j + KEY_BYTES]:
                raise InputError(f"add_many: page {i} cannot be its own parent")
        for i in range(n):
            j = i * KEY_BYTES
            self.add(PageKey(keys[j:j + KEY_BYTES]), PageKey(parents[j:j + KEY_BYTES]) if has_parent[i] else None,
                     classes[i], t0 + i * step)

    def discard(self, key: PageKey) -> None:
        """``key`` left the tier. Removing a pending victim settles it."""
        if key not in self.last:
            return
        if key in self._pending:
            del self._pending[key]
        else:
            self.undo()
            if self._kids[key] == 0:
                self._unleaf(key)
            self._orphan(key)
        del self.last[key], self.cls[key], self.parent[key]
        if self._kids[key] == 0:
            del self._kids[key]

    def discard_many(self, keys: bytes) -> None:
        """:meth:`discard` of each 16-byte key of ``keys`` (back to back), in order."""
        if len(keys) % KEY_BYTES:
            raise InputError(f"discard_many: {len(keys)} bytes are not 16-byte keys back to back")
        for j in range(0, len(keys), KEY_BYTES):
            self.discard(PageKey(keys[j:j + KEY_BYTES]))

    # -- eviction --------------------------------------------------------------------------
    def candidates(self, evictable: Callable[[PageKey], bool]) -> list[Candidate]:
        """The oldest (and, if enabled, the youngest) evictable leaf of every class.

        Within one victims call (until :meth:`settle`) ``evictable`` must not change:
        the heads of classes untouched since the last call are reused, and a leaf it
        allowed is not asked again.
        """
        for c in self._dirty:
            heads = self._heads[c]
            heads.clear()
            entry = self._head(self._old[c], evictable, False)
            if entry is not None:
                heads.append((entry[2], c, entry[0], False))
            if self._young:
                entry = self._head(self._new[c], evictable, True)
                if entry is not None:
                    heads.append((entry[2], c, -entry[0], True))
        self._dirty.clear()
        return [cand for heads in self._heads for cand in heads]

    def take(self, key: PageKey) -> None:
        """Mark the leaf ``key`` as a victim; its parent may become a leaf.

        KeyError if ``key`` is not resident; :class:`~tierkv.errors.InputError` if it has
        resident children (it is no leaf: a page is useless without its prefix). A key
        taken already (and not discarded or put back since) is left as it is."""
        if key not in self.last:
            raise KeyError(key)
        if key in self._pending:
            return
        if self._kids.get(key, 0):
            raise InputError(f"take: page {key!r} has resident children: only a leaf can be a victim")
        self._unleaf(key)
        self._orphan(key)
        self._pending[key] = None

    def settle(self) -> None:
        """End of a victims call: heap entries skipped as unevictable go back."""
        for heap, entry in self._stash:
            heapq.heappush(heap, entry)
        self._stash.clear()
        self._allowed.clear()
        self._dirty.update(range(len(self._old)))

    def undo(self) -> None:
        """Victims handed out but never removed stay resident after all."""
        pending, self._pending = self._pending, {}
        self._allowed.clear()
        for key in reversed(pending):
            parent = self.parent[key]
            if parent is not None:
                self._adopt(parent)
            self._leaf(key)

    # -- internals --------------------------------------------------------------------------
    def _adopt(self, parent: PageKey) -> None:
        """One more resident child of ``parent`` (resident or not: it may arrive later)."""
        kids = self._kids.get(parent, 0)
        if kids == 0 and parent in self.last:
            self._unleaf(parent)
        self._kids[parent] = kids + 1

    def _orphan(self, key: PageKey) -> None:
        parent = self.parent[key]
        if parent is None:
            return
        kids = self._kids[parent] - 1
        if kids:
            self._kids[parent] = kids
        elif parent in self.last:
            self._kids[parent] = 0
            self._leaf(parent)
        else:
            del self._kids[parent]

    def _leaf(self, key: PageKey) -> None:
        self._next += 1
        s = self._next
        self._seq[key] = s
        c, t = self.cls[key], self.last[key]
        self._leaves[c] += 1
        self._dirty.add(c)
        heapq.heappush(self._old[c], (t, s, key))
        if self._young:
            heapq.heappush(self._new[c], (-t, -s, key))
        # Each touch of a leaf leaves a stale entry behind; a tier that never fills never
        # pops them, so both heaps are compacted once they outgrow the live leaves.
        bound = 2 * self._leaves[c] + 64
        if len(self._old[c]) > bound or len(self._new[c]) > bound:
            self._compact(c)

    def _unleaf(self, key: PageKey) -> None:
        if self._seq.pop(key, None) is not None:
            c = self.cls[key]
            self._leaves[c] -= 1
            self._dirty.add(c)

    def _compact(self, c: int) -> None:
        """Drop stale entries (the young heap's sink and are never popped; the old heap's are
        popped only by victims calls, which a tier that never fills does not make)."""
        for heap, sign in ((self._old[c], 1), (self._new[c], -1)):
            live = [e for e in heap if self._seq.get(e[2]) == sign * e[1]]
            heapq.heapify(live)
            heap[:] = live

    def _head(self, heap: list[tuple[float, int, PageKey]], evictable: Callable[[PageKey], bool],
              young: bool) -> tuple[float, int, PageKey] | None:
        sign = -1 if young else 1
        while heap:
            entry = heap[0]
            if self._seq.get(entry[2]) != sign * entry[1]:
                heapq.heappop(heap)
            elif entry[2] in self._allowed or evictable(entry[2]):
                self._allowed.add(entry[2])
                return entry
            else:
                self._stash.append((heap, heapq.heappop(heap)))
        return None


try:  # the compiled twin; optional so that a machine without a compiler still works
    from tierkv.policy._leaves import LeafHeaps as NativeLeafHeaps  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - exercised where the extension is absent
    NativeLeafHeaps = None

#: The leaf heaps the policies build (see the module doc).
LeafHeaps: type[PyLeafHeaps] = (
    PyLeafHeaps if NativeLeafHeaps is None or os.environ.get("TIERKV_PURE_POLICY") == "1" else NativeLeafHeaps
)


def native_available() -> bool:
    """Whether :data:`LeafHeaps` is the compiled class."""
    return LeafHeaps is not PyLeafHeaps
