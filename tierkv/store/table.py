"""The block manager's page table: every page a row of arrays, no Python object per page.

A :class:`PageTable` maps 16-byte page keys to dense rows (the C core in
``tierkv._table``, or :class:`PyCore` where the extension is not built) and keeps what
the manager knows of each page in numpy columns indexed by row: its parent's row, its
length, checksum, generation, a bit mask of the tiers holding it, its slot in each tier,
and how many of its children are cached (per tier, and at all). All columns encode
"none" as 0 (slots and parent rows are stored plus one), so capacity grown but not yet
used costs no resident memory. A tier that holds a small share of the pages (a node's
DRAM) keeps its slot and children columns for its own rows only (:mod:`tierkv.store.columns`),
the length is one common value and the rows with another, the children counts are a
byte a row (and a map of the rows that count 255 or more), and
pins live in a dict of the rows pinned now: a handful at any time.

A row exists while its page has a copy in some tier, or while a cached page names it
as parent (a *placeholder*: its children must be told apart from orphans when it
arrives). The core's per-row level (the fastest tier the page is published in) makes
the table the store's resident-key index as well: ``core.prefix_len`` and
``core.prefix_values`` answer a lookup in one C scan. Used by
:mod:`tierkv.store.manager` under the store lock; not thread-safe.
"""

from __future__ import annotations

import sys

import numpy as np

from tierkv.keys import KEY_BYTES, PageKey, split_keys
from tierkv.store.columns import CountColumn, LevelColumns, UniformColumn

try:  # the compiled core; optional so that a machine without a compiler still works
    from tierkv import _table  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised where the extension is absent
    _table = None

#: The core's level of a row that is not published.
NO_LEVEL = 0xFF
#: Lowest set bit of a tier mask, as a level (0xFF for an empty mask).
LOWEST_LEVEL = np.array([NO_LEVEL] + [(m & -m).bit_length() - 1 for m in range(1, 256)], dtype=np.uint8)
#: Most tiers a table tracks (the tier mask is one byte).
MAX_TIERS = 8
#: A tier holds at most this many slots: the slot column keeps slot + 1 in 32 bits.
MAX_SLOTS = (1 << 32) - 1


class PyCore:
    """Pure-Python page table core: the same contract as ``tierkv._table.PageTable``."""

    def __init__(self) -> None:
        self._row: dict[bytes, int] = {}
        self._keys: list[bytes] = []
        self._level: list[int] = []
        self._free: list[int] = []
        self._published = 0

    @property
    def rows(self) -> int:
        return len(self._row)

    @property
    def capacity(self) -> int:
        # Ahead of use, doubling (as the C core grows), so the columns are not copied per row.
        return max(1024, 1 << max(len(self._keys) - 1, 0).bit_length())

    @property
    def nbytes(self) -> int:
        """An estimate of the memory held: the dict, the lists and the key objects."""
        return (sys.getsizeof(self._row) + sys.getsizeof(self._keys) + sys.getsizeof(self._level)
                + sys.getsizeof(self._free) + len(self._keys) * sys.getsizeof(bytes(KEY_BYTES)))

    def _rows_of(self, rows: bytes) -> list[int]:
        out = np.frombuffer(rows, dtype=np.int32).tolist()
        for r in out:
            if not 0 <= r < len(self._keys) or self._level[r] < 0:
                raise KeyError(f"row {r} is not a page of this table")
        return out

    @staticmethod
    def _split(blob: bytes) -> list[PageKey]:
        if len(blob) % KEY_BYTES:
            raise ValueError(f"blob must hold whole {KEY_BYTES}-byte keys, got {len(blob)} bytes")
        return split_keys(bytes(blob))

    def find(self, blob: bytes) -> bytes:
        return np.array([self._row.get(k, -1) for k in self._split(blob)], dtype=np.int32).tobytes()

    def row(self, key: bytes) -> int:
        if len(key) != KEY_BYTES:
            raise ValueError(f"page key must be {KEY_BYTES} bytes, got {len(key)}")
        return self._row.get(bytes(key), -1)

    def ensure(self, blob: bytes) -> tuple[bytes, bytes]:
        rows, fresh = [], []
        for k in self._split(blob):
            r = self._row.get(k, -1)
            fresh.append(r < 0)
            if r < 0:
                if self._free:
                    r = self._free.pop()
                    self._keys[r], self._level[r] = k, NO_LEVEL
                else:
                    r = len(self._keys)
                    self._keys.append(k)
                    self._level.append(NO_LEVEL)
                self._row[k] = r
            rows.append(r)
        return np.array(rows, dtype=np.int32).tobytes(), bytes(fresh)

    def release(self, rows: bytes) -> None:
        for r in self._rows_of(rows):
            if self._level[r] < 0:
                continue
            self._published -= self._level[r] != NO_LEVEL
            del self._row[self._keys[r]]
            self._level[r] = -1
            self._free.append(r)

    def keys(self, rows: bytes) -> bytes:
        return b"".join(self._keys[r] for r in self._rows_of(rows))

    def key(self, row: int) -> bytes:
        return self.keys(np.array([row], dtype=np.int32).tobytes())

    def set_levels(self, rows: bytes, levels: bytes | int) -> None:
        rs = self._rows_of(rows)
        if isinstance(levels, int) and not 0 <= levels <= NO_LEVEL:
            raise ValueError(f"a level is in [0, 255], got {levels}")
        lv = [levels] * len(rs) if isinstance(levels, int) else list(levels)
        if len(lv) != len(rs):
            raise ValueError(f"set_levels: {len(rs)} rows but {len(lv)} levels")
        for r, v in zip(rs, lv):
            self._published += (self._level[r] == NO_LEVEL) - (v == NO_LEVEL)
            self._level[r] = v

    def levels(self, rows: bytes) -> bytes:
        return bytes(self._level[r] for r in self._rows_of(rows))

    def live_rows(self) -> bytes:
        return np.array(sorted(self._row.values()), dtype=np.int32).tobytes()

    def _published_level(self, key: bytes) -> int:
        r = self._row.get(key, -1)
        return NO_LEVEL if r < 0 else self._level[r]

    def prefix_values(self, blob: bytes) -> bytes:
        out = bytearray()
        for k in self._split(blob):
            v = self._published_level(k)
            if v == NO_LEVEL:
                break
            out.append(v)
        return bytes(out)

    def prefix_len(self, blob: bytes, start: int = 0) -> int:
        n = len(blob) // KEY_BYTES
        if not 0 <= start <= n:
            raise ValueError(f"start must lie in [0, {n}], got {start}")
        return len(self.prefix_values(blob[start * KEY_BYTES:]))

    def prefix_rows(self, blob: bytes) -> bytes:
        n = len(self.prefix_values(blob))
        return self.find(blob[:n * KEY_BYTES])

    def get(self, key: bytes) -> int | None:
        v = self._published_level(bytes(key))
        return None if v == NO_LEVEL else v

    def __len__(self) -> int:
        return self._published

    def __contains__(self, key: object) -> bool:
        return isinstance(key, (bytes, bytearray, memoryview)) and self.get(bytes(key)) is not None


def new_core(keys: object = None) -> PyCore:
    """The compiled core where it is built, else :class:`PyCore`. ``keys``: a policy's key
    table (``tierkv.policy._ghost.new_keys()``) for the compiled core to keep its keys in;
    ignored by :class:`PyCore`."""
    if _table is None:
        return PyCore()
    return _table.PageTable() if keys is None else _table.PageTable(keys=keys)  # type: ignore[no-any-return]


def rows_of(raw: bytes) -> np.ndarray:
    """An int32 row buffer from the core as an array (read-only view)."""
    return np.frombuffer(raw, dtype=np.int32)


class PageTable:
    """The core plus the manager's numpy columns for ``tiers`` tiers (levels 0..tiers-1)."""

    def __init__(self, tiers: int, wide_slots: bool = False, keys: object = None,
                 sparse: list[bool] | None = None) -> None:
        """``wide_slots``: 64-bit slots, for tiers whose slots are handles that are never
        reused (a block-addressed tier's), where 32 bits would wrap in a long run.
        ``keys``: a policy's key table to share (see :func:`new_core`): the keys that
        policy holds then cost the table nothing more; ValueError if another page table
        uses it already. ``sparse``: per level, whether its slot and cached-children
        columns are kept for the rows that have a value only (:class:`SparseColumn`: a
        tier holding a small share of the pages); default none."""
        if not 1 <= tiers <= MAX_TIERS:
            raise ValueError(f"a page table tracks 1 to {MAX_TIERS} tiers, got {tiers}")
        sparse = [False] * tiers if sparse is None else list(sparse)
        if len(sparse) != tiers:
            raise ValueError(f"sparse names {len(sparse)} levels for a table of {tiers} tiers")
        self.core = new_core(keys)
        self.tiers = tiers
        self._cap = 0
        self.parent = np.zeros(0, dtype=np.int32)     # parent row + 1; 0: none
        self.nbytes = UniformColumn(np.uint32)        # a page's length: mostly one for all
        self.checksum = np.zeros(0, dtype=np.uint64)
        self.has_sum = np.zeros(0, dtype=np.bool_)
        # Pins of the rows pinned now (row -> count > 0): a handful at any time, so a dict,
        # not 4 bytes on every row.
        self.pins: dict[int, int] = {}
        self.gen = np.zeros(0, dtype=np.uint32)       # the incarnation of the row's page (set by the manager)
        self.where = np.zeros(0, dtype=np.uint8)      # bit i: level i holds a copy
        self.nkids = CountColumn()                    # children with a copy anywhere: mostly 0 or 1
        # slot + 1 per level; 0: none (so slots < MAX_SLOTS, unless wide)
        self.slot = LevelColumns(np.int64 if wide_slots else np.uint32, sparse)
        self.kids = LevelColumns(np.int32, sparse, counts=True)   # children with a copy in each level
        self.grow()

    def grow(self) -> None:
        """Extend the columns to the core's capacity (call after every ``ensure``)."""
        cap = self.core.capacity
        if cap <= self._cap:
            return
        for name in ("parent", "checksum", "has_sum", "gen", "where"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)
        self.nbytes.grow(cap)
        self.nkids.grow(cap)
        self.slot.grow(cap)
        self.kids.grow(cap)
        self._cap = cap

    def ensure(self, blob: bytes) -> tuple[np.ndarray, np.ndarray]:
        """Rows of the keys in ``blob`` (new rows for new keys) and which rows are new."""
        raw, fresh = self.core.ensure(blob)
        self.grow()
        return rows_of(raw), np.frombuffer(fresh, dtype=np.bool_)

    def release(self, rows: np.ndarray) -> None:
        """Free rows with no copy and no cached child; their columns are zeroed for reuse."""
        self.parent[rows] = 0
        self.nbytes.forget(rows)
        self.checksum[rows] = 0
        self.has_sum[rows] = False
        self.unpin(rows)
        self.core.release(np.ascontiguousarray(rows, dtype=np.int32).tobytes())

    def pinned(self, rows: np.ndarray) -> np.ndarray:
        """Whether each row of ``rows`` is pinned (a bool array)."""
        if not self.pins:
            return np.zeros(len(rows), dtype=np.bool_)
        return np.isin(rows, np.fromiter(self.pins, dtype=np.int64, count=len(self.pins)))

    def unpin(self, rows: np.ndarray) -> None:
        """Forget the pins of ``rows`` (their pages left the store)."""
        if self.pins:
            for r in np.asarray(rows).ravel().tolist():
                self.pins.pop(r, None)

    def key(self, row: int) -> bytes:
        return self.core.key(row)  # type: ignore[no-any-return]

    def keys(self, rows: np.ndarray) -> list[PageKey]:
        return split_keys(self.core.keys(np.ascontiguousarray(rows, dtype=np.int32).tobytes()))

    def depths(self) -> np.ndarray:
        """Each row's number of ancestors in the table (pointer doubling: O(rows log depth))."""
        n = len(self.parent)
        up = self.parent.astype(np.int64) - 1
        root = up < 0
        up[root] = np.flatnonzero(root)
        dist = (~root).astype(np.int64)
        for _ in range(64):
            nxt = up[up]
            if np.array_equal(nxt, up):
                break
            dist += np.where(up != np.arange(n), dist[up], 0)
            up = nxt
        return dist

    @property
    def memory_bytes(self) -> int:
        """Bytes allocated for the table: the core's keys, levels and map (not a policy's key
        table it shares: the policy counts that), the columns and the pins."""
        cols = (self.parent, self.nbytes, self.checksum, self.has_sum, self.gen, self.where, self.nkids, self.slot,
                self.kids)
        return int(self.core.nbytes) + sum(c.nbytes for c in cols) + sys.getsizeof(self.pins)

    def fastest(self, rows: np.ndarray) -> np.ndarray:
        """The level of each row's fastest copy (0xFF: none)."""
        return LOWEST_LEVEL[self.where[rows]]


