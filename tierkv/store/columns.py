"""Page table columns that are not an array of every row.

A page table keeps most of what it knows of a page in numpy columns indexed by row
(:mod:`tierkv.store.table`). Some values are held by few rows, or are the same for
nearly all, or small for nearly all: a fast tier's slots and cached-children counts
(its own pages only: :class:`SparseColumn`, in :class:`LevelColumns` beside the dense
levels), a page's length (:class:`UniformColumn`) and the other cached-children counts,
nearly all 0 or 1 (:class:`CountColumn`: a byte a row). These keep the rows that have a
value, another value or a big one in a map from row to value (``tierkv._table.RowMap``,
or :class:`PyRowMap` where the extension is not built), indexed as the numpy column
they stand for. Not thread-safe: the manager uses them under the store lock.
"""

from __future__ import annotations

import operator
import sys
from typing import Any

import numpy as np

try:  # the compiled map; optional so that a machine without a compiler still works
    from tierkv import _table  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised where the extension is absent
    _table = None


class PyRowMap:
    """Pure-Python ``tierkv._table.RowMap``: rows to nonzero int64 values, as int64 buffers."""

    def __init__(self) -> None:
        self._d: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._d)

    @staticmethod
    def _ints(buf: bytes | np.ndarray, what: str, narrow: bool) -> list[int]:
        """bytes (int64), an int64 array or, with ``narrow``, an int32 one: as RowMap reads them."""
        if isinstance(buf, (bytes, bytearray)) and len(buf) % 8 == 0:
            return np.frombuffer(buf, dtype=np.int64).tolist()  # type: ignore[no-any-return]
        if isinstance(buf, np.ndarray) and (buf.dtype == np.int64 or (narrow and buf.dtype == np.int32)):
            return buf.ravel().tolist()  # type: ignore[no-any-return]
        got = f"an array of {buf.dtype}" if isinstance(buf, np.ndarray) else f"{len(buf)} bytes"
        raise ValueError(f"{what} must be int64{' or int32' if narrow else ''} values, got {got}")

    @classmethod
    def _rows(cls, buf: bytes | np.ndarray) -> list[int]:
        rows = cls._ints(buf, "rows", True)
        bad = [r for r in rows if not 0 <= r < (1 << 31) - 1]
        if bad:
            raise ValueError(f"a row is 0 to {(1 << 31) - 2}, got {bad[0]}")
        return rows

    def get(self, rows: bytes | np.ndarray) -> bytes:
        d = self._d
        return np.array([d.get(r, 0) for r in self._rows(rows)], dtype=np.int64).tobytes()

    def put(self, rows: bytes | np.ndarray, values: bytes | np.ndarray) -> None:
        self._update(rows, values, False)

    def add(self, rows: bytes | np.ndarray, deltas: bytes | np.ndarray) -> None:
        self._update(rows, deltas, True)

    def _update(self, rows: bytes | np.ndarray, values: bytes | np.ndarray, add: bool) -> None:
        rs, vs = self._rows(rows), self._ints(values, "values", False)
        if len(rs) != len(vs):
            raise ValueError(f"{len(rs)} rows and {len(vs)} values")
        d = self._d
        for r, v in zip(rs, vs):
            v = d.get(r, 0) + v if add else v
            if v:
                d[r] = v
            else:
                d.pop(r, None)

    def get1(self, row: int) -> int:
        return self._d.get(self._rows(np.array([row], dtype=np.int64).tobytes())[0], 0)

    def put1(self, row: int, value: int) -> None:
        self._update(np.array([row], dtype=np.int64).tobytes(), np.array([value], dtype=np.int64).tobytes(), False)

    def items(self) -> tuple[bytes, bytes]:
        return (np.array(list(self._d), dtype=np.int64).tobytes(),
                np.array(list(self._d.values()), dtype=np.int64).tobytes())

    @property
    def nbytes(self) -> int:
        return sys.getsizeof(self._d)


_ROW_TYPES = (np.dtype(np.int32), np.dtype(np.int64))


def _int_rows(idx: object, what: str) -> np.ndarray:
    """Integer rows as a contiguous int32 or int64 array (what a row map reads as is);
    TypeError naming ``what`` for anything else (a mask would be read as rows 0 and 1)."""
    rows = np.asarray(idx)
    if rows.dtype == np.int32 or rows.dtype == np.int64:
        return np.ascontiguousarray(rows)
    if rows.size == 0:                    # an empty list is a float array
        return np.zeros(rows.shape, dtype=np.int64)
    if rows.dtype.kind not in "iu":
        raise TypeError(f"{what} takes integer rows, got an array of {rows.dtype}")
    return np.ascontiguousarray(rows, dtype=np.int64)


class SparseColumn:
    """One level's column of the table where few rows have a value (a fast tier's slots
    and cached-child counts): the rows that do, in a map (``tierkv._table.RowMap``, about
    17-34 bytes a row held), instead of an array of every row (4 bytes a row of the
    table). Indexed like a 1-D numpy array by a row (a scalar of ``dtype``) or an integer
    array of rows (an array of ``dtype``); assigning sets, and a 0 removes the row."""

    def __init__(self, dtype: np.dtype | type) -> None:
        self.dtype = np.dtype(dtype)
        self._map: Any = _table.RowMap() if _table is not None else PyRowMap()

    def __len__(self) -> int:
        """Rows that have a value."""
        return len(self._map)

    @staticmethod
    def _rows(idx: np.ndarray) -> np.ndarray:
        return _int_rows(idx, "a sparse column")

    def __getitem__(self, idx: int | np.integer | np.ndarray) -> Any:   # a scalar or an array, as numpy's
        if type(idx) is np.ndarray and idx.ndim == 1 and idx.dtype in _ROW_TYPES and idx.flags.c_contiguous:
            return np.frombuffer(self._map.get(idx), dtype=np.int64).astype(self.dtype)   # the manager's reads
        if isinstance(idx, (int, np.integer)):
            return self.dtype.type(self._map.get1(int(idx)))
        rows = self._rows(idx)
        got = np.frombuffer(self._map.get(rows.ravel()), dtype=np.int64).astype(self.dtype)
        return got.reshape(rows.shape) if rows.ndim != 1 else got

    def __setitem__(self, idx: int | np.integer | np.ndarray, value: object) -> None:
        if (type(idx) is np.ndarray and type(value) is np.ndarray and idx.ndim == 1 and idx.shape == value.shape
                and idx.dtype in _ROW_TYPES and idx.flags.c_contiguous):   # the manager's writes
            self._map.put(idx, value.astype(self.dtype).astype(np.int64))
            return
        if isinstance(idx, (int, np.integer)):
            self._map.put1(int(idx), int(value))  # type: ignore[call-overload]
            return
        rows = self._rows(idx).ravel()
        vals = np.broadcast_to(np.asarray(value, dtype=self.dtype), rows.shape).astype(np.int64)
        self._map.put(rows, np.ascontiguousarray(vals))

    def add_at(self, rows: np.ndarray, delta: int | np.ndarray) -> None:
        """``numpy.add.at``: ``delta`` added once for each occurrence of a row."""
        r = self._rows(rows).ravel()
        self._map.add(r, np.full(r.shape, delta, dtype=np.int64) if type(delta) is int else
                      np.ascontiguousarray(np.broadcast_to(np.asarray(delta, dtype=np.int64), r.shape)))

    def dense(self, n: int) -> np.ndarray:
        """The column as an array of ``n`` rows."""
        out = np.zeros(n, dtype=self.dtype)
        rows, vals = self._map.items()
        out[np.frombuffer(rows, dtype=np.int64)] = np.frombuffer(vals, dtype=np.int64)
        return out

    @property
    def nbytes(self) -> int:
        return int(self._map.nbytes)


class UniformColumn:
    """A value per row where nearly every row has the same one (a page's length: the pages
    of a put share one, and a store's puts mostly the page size): that value, and in a map
    the rows that have another (stored plus one, so that 0 can be one). The common value is
    the first one set; rows never set (or freed) read as it (0 before any is set: no reader
    asks a row that holds no page). Once more than 1/8 of the rows
    (and over 4,096) have another value it turns into an array of every row for good.
    Indexed like a 1-D numpy array by a row or an integer array of rows."""

    DENSE_AFTER = 4096

    def __init__(self, dtype: np.dtype | type) -> None:
        self.dtype = np.dtype(dtype)
        self.common = 0
        self._fixed = False
        self._others = SparseColumn(np.int64)
        self._dense: np.ndarray | None = None
        self._n = 0

    def grow(self, cap: int) -> None:
        if self._dense is not None:
            new = np.zeros(cap, dtype=self.dtype)
            new[:len(self._dense)] = self._dense
            self._dense = new
        self._n = cap

    @property
    def others(self) -> int | None:
        """Rows held with another value than the common one (None once dense)."""
        return None if self._dense is not None else len(self._others)

    def __getitem__(self, idx: int | np.integer | np.ndarray) -> Any:   # a scalar or an array, as numpy's
        if self._dense is not None:
            return self._dense[idx]
        if isinstance(idx, (int, np.integer)):
            v = self._others._map.get1(int(idx)) if len(self._others) else 0
            return self.dtype.type(v - 1 if v else self.common)
        if not len(self._others):         # every row the common value: most stores, always
            rows = _int_rows(idx, "a uniform column")
            return np.full(rows.shape, self.common, dtype=self.dtype)
        got = self._others[idx]
        return np.where(got != 0, got - 1, self.common).astype(self.dtype)

    def __setitem__(self, idx: int | np.integer | np.ndarray, value: object) -> None:
        if self._dense is not None:
            self._dense[idx] = value
            return
        if self._fixed and not len(self._others) and bool((np.asarray(value) == self.common).all()):
            return                        # the common value where every row has it: most writes
        vals = np.asarray(value, dtype=self.dtype).astype(np.int64)
        if not self._fixed and vals.size:
            self.common, self._fixed = int(vals.flat[0]), True
        if not len(self._others) and bool((vals == self.common).all()):
            return                        # nothing to note, nothing to take back
        self._others[idx] = np.where(vals != self.common, vals + 1, 0) if vals.ndim else \
            (int(vals) + 1 if int(vals) != self.common else 0)
        if len(self._others) > max(self.DENSE_AFTER, self._n // 8):
            self._dense = self.dense()

    def forget(self, rows: int | np.ndarray) -> None:
        """Rows freed: they read as the common value again (0 once dense), their map entries go."""
        if self._dense is not None:
            self._dense[rows] = 0
        elif len(self._others):
            self._others[rows] = 0

    def dense(self) -> np.ndarray:
        """The column as an array of every row."""
        if self._dense is not None:
            return self._dense.copy()
        out = np.full(self._n, self.common, dtype=self.dtype)
        rows, vals = self._others._map.items()
        out[np.frombuffer(rows, dtype=np.int64)] = np.frombuffer(vals, dtype=np.int64) - 1
        return out

    @property
    def nbytes(self) -> int:
        return int(self._dense.nbytes) if self._dense is not None else self._others.nbytes


#: The unsigned integer type of each signed one's size: a view in which negatives are huge.
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class CountColumn:
    """A count per row that is nearly always small (a page's cached children: 0 or 1 along
    a prompt, more only where prompts branch): a byte per row (an int32 array would take
    four), and the rows that count :attr:`BIG` or more in a map (their byte :attr:`BIG`).
    Indexed like a 1-D numpy int32 array by a row (an int) or an integer array of rows (an
    int32 array); assigning sets. :attr:`bytes` is nonzero exactly where the count is. A
    count is never negative: assigning one raises ValueError and changes nothing."""

    BIG = 255
    dtype = np.dtype(np.int32)

    def __init__(self) -> None:
        self.bytes = np.zeros(0, dtype=np.uint8)
        self._map: Any = _table.RowMap() if _table is not None else PyRowMap()

    def __len__(self) -> int:
        return len(self.bytes)

    def grow(self, cap: int) -> None:
        new = np.zeros(cap, dtype=np.uint8)
        new[:len(self.bytes)] = self.bytes
        self.bytes = new

    @property
    def big(self) -> int:
        """Rows whose count is in the map."""
        return len(self._map)

    @staticmethod
    def _rows(idx: object) -> np.ndarray:
        return _int_rows(idx, "a count column")

    def __getitem__(self, idx: int | np.integer | np.ndarray) -> Any:   # an int or an int32 array
        if isinstance(idx, (int, np.integer)):
            v = self.bytes.item(idx)
            return v if v != self.BIG else self._map.get1(int(idx))
        rows = self._rows(idx)
        if not rows.ndim:                 # a 0-d array names one row: a scalar, as numpy's
            return self[int(rows)]
        v = self.bytes[rows]
        out = v.astype(np.int32)
        if not out.size:
            return out
        if len(self._map):
            at = v == self.BIG
            if at.any():
                out[at] = np.frombuffer(self._map.get(np.ascontiguousarray(rows[at])), dtype=np.int64)
        return out

    def __setitem__(self, idx: int | np.integer | np.ndarray, value: object) -> None:
        if isinstance(idx, (int, np.integer)):
            v = int(value)  # type: ignore[call-overload]
            if 0 <= v < self.BIG and not (len(self._map) and self.bytes.item(idx) == self.BIG):
                self.bytes[idx] = v       # nearly every write
                return
            if v < 0:
                raise ValueError(f"a count is 0 or more, got {v} for row {int(idx)}")
            self._in_range(np.asarray(idx))   # before the map changes: a refused write changes nothing
            self._map.put1(int(idx), v if v >= self.BIG else 0)
            self.bytes[idx] = min(v, self.BIG)
            return
        rows = self._rows(idx)
        vals = value if type(value) is np.ndarray and value.shape == rows.shape else \
            np.broadcast_to(np.asarray(value), rows.shape)
        if not vals.size:
            return
        if vals.dtype.kind not in "iu":
            raise TypeError(f"a count column holds integers, got {vals.dtype}")
        if not len(self._map):
            u = vals.view(_UNSIGNED[vals.itemsize]) if vals.dtype.kind == "i" else vals   # a negative is huge
            if u.max() < self.BIG:
                self.bytes[rows] = vals   # every count small, none big before: nearly every write
                return
        vals = vals.astype(np.int64).ravel()
        rows = rows.ravel()
        if int(vals.min()) < 0:
            bad = int(np.argmin(vals))
            raise ValueError(f"a count is 0 or more, got {int(vals[bad])} for row {int(rows[bad])}")
        if len(rows) > 1:                 # a row named twice gets its last value, as numpy's
            last = len(rows) - 1 - np.unique(rows[::-1], return_index=True)[1]
            rows, vals = rows[last], vals[last]
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        self._in_range(rows)
        # The map takes the rows counted BIG or more, and lets go of the others (0 removes).
        self._map.put(rows, np.where(vals >= self.BIG, vals, 0))
        self.bytes[rows] = np.minimum(vals, self.BIG)

    def _in_range(self, rows: np.ndarray) -> None:
        """IndexError unless every row is one of the column's (0 to len - 1: the map's rows
        are never negative)."""
        if rows.size and not (0 <= int(rows.min()) and int(rows.max()) < len(self.bytes)):
            bad = rows[(rows < 0) | (rows >= len(self.bytes))].flat[0]
            raise IndexError(f"row {int(bad)} is not one of the count column's {len(self.bytes)} rows")

    def add_unique(self, rows: np.ndarray, delta: int | np.ndarray) -> None:
        """``c[rows] += delta`` for rows that are all distinct."""
        if type(delta) is int and 0 < delta < self.BIG and not len(self._map) and type(rows) is np.ndarray \
                and rows.dtype.kind in "iu":
            v = self.bytes[rows]
            if not v.size:
                return
            if int(v.max()) < self.BIG - delta:   # every sum small, none big before: a put's parents
                self.bytes[rows] = v + np.uint8(delta)
                return
        self[rows] = self[rows] + delta

    def add_at(self, rows: np.ndarray, delta: int) -> None:
        """``numpy.add.at``: ``delta`` added once for each occurrence of a row."""
        rows = self._rows(rows).ravel()
        if len(rows):
            u, counts = np.unique(rows, return_counts=True)
            self[u] = self[u] + counts * delta

    def dense(self, n: int | None = None) -> np.ndarray:
        """The column as an int32 array of every row (``n``: its length, as grown)."""
        assert n is None or n == len(self.bytes), "a count column has a count for every row"
        return self[np.arange(len(self.bytes))]  # type: ignore[no-any-return]

    def check(self) -> None:
        """AssertionError unless the map holds exactly the rows whose byte is BIG, each with a
        count of BIG or more."""
        rows, vals = self._map.items()
        at = np.frombuffer(rows, dtype=np.int64)
        assert np.array_equal(np.sort(at), np.flatnonzero(self.bytes == self.BIG)), "count column: map vs bytes"
        assert bool((np.frombuffer(vals, dtype=np.int64) >= self.BIG).all()), "count column: a small count in the map"

    @property
    def nbytes(self) -> int:
        return int(self.bytes.nbytes) + int(self._map.nbytes)


class LevelColumns:
    """A value per level and row (a tier's slots, or cached children in it): each level a
    numpy array of every row (*dense*) or a :class:`SparseColumn`. Indexed as the 2-D array
    ``[level, rows]`` it stands for: ``c[lvl, r]``, ``c[lvl, rows]``, ``c[:, rows]`` (levels
    by rows), ``c[levels, rows]`` (a level per row); ``c[lvl]`` is that level's column.
    With ``counts`` (nonnegative int32 counts) the dense levels are :class:`CountColumn`."""

    def __init__(self, dtype: np.dtype | type, sparse: list[bool], counts: bool = False) -> None:
        self.dtype = np.dtype(dtype)
        if counts and self.dtype != CountColumn.dtype:
            raise ValueError(f"count levels are {CountColumn.dtype}, got {self.dtype}")
        self.cols: list[np.ndarray | SparseColumn | CountColumn] = [
            SparseColumn(self.dtype) if sp else CountColumn() if counts else np.zeros(0, dtype=self.dtype)
            for sp in sparse]
        self._n = 0

    def grow(self, cap: int) -> None:
        """Dense levels to ``cap`` rows (sparse ones need no room)."""
        for i, col in enumerate(self.cols):
            if isinstance(col, np.ndarray):
                new = np.zeros(cap, dtype=self.dtype)
                new[:len(col)] = col
                self.cols[i] = new
            elif isinstance(col, CountColumn):
                col.grow(cap)
        self._n = cap

    @property
    def sparse(self) -> list[bool]:
        return [isinstance(c, SparseColumn) for c in self.cols]

    def __getitem__(self, idx: object) -> Any:   # as numpy's indexing: an array, a scalar or a column
        if type(idx) is tuple and type(idx[0]) is int:   # [lvl, r] and [lvl, rows]: most reads
            return self.cols[idx[0]][idx[1]]  # type: ignore[index]
        if not isinstance(idx, tuple):
            return self.cols[operator.index(idx)]  # type: ignore[arg-type]
        lvl, rows = idx
        if isinstance(lvl, slice):
            got = [c[rows] for c in self.cols[lvl]]
            return np.array(got, dtype=self.dtype) if np.isscalar(got[0]) or np.ndim(got[0]) == 0 else np.stack(got)
        if isinstance(lvl, np.ndarray):
            rows = np.asarray(rows)
            levels = lvl
            if levels.shape != rows.shape:
                levels, rows = np.broadcast_arrays(levels, rows)
            if not levels.size:
                return np.zeros(levels.shape, dtype=self.dtype)
            lo, hi = int(levels.min()), int(levels.max())
            if lo < 0 or hi >= len(self.cols):
                raise IndexError(f"levels {lo} to {hi} of a table of {len(self.cols)} levels")
            if lo == hi:                  # one level: most reads
                return self.cols[lo][rows]  # type: ignore[index]
            out = np.zeros(levels.shape, dtype=self.dtype)
            for v, col in enumerate(self.cols):
                m = levels == v
                if m.any():
                    out[m] = col[rows[m]]
            return out
        return self.cols[operator.index(lvl)][rows]  # type: ignore[arg-type, index]

    def __setitem__(self, idx: tuple[int, object], value: object) -> None:
        lvl, rows = idx
        self.cols[lvl][rows] = value  # type: ignore[index]

    def add_unique(self, lvl: int, rows: np.ndarray, delta: int | np.ndarray) -> None:
        """``c[lvl, rows] += delta`` for rows that are all distinct, in one call for a sparse level."""
        col = self.cols[lvl]
        if isinstance(col, SparseColumn):
            col.add_at(rows, delta)
        elif isinstance(col, CountColumn):
            col.add_unique(rows, delta)
        else:
            col[rows] += delta

    def only_at(self, lvl: int, row: int) -> bool:
        """Whether ``row`` has no value at any level but ``lvl`` (per eviction candidate:
        the maps read directly)."""
        for i, c in enumerate(self.cols):
            if i != lvl and (c._map.get1(row) if type(c) is SparseColumn else c.bytes[row] if type(c) is CountColumn
                             else c[row]):
                return False
        return True

    def add_at(self, lvl: int, rows: np.ndarray, delta: int) -> None:
        """``numpy.add.at`` on one level's column: once for each occurrence of a row."""
        col = self.cols[lvl]
        if isinstance(col, np.ndarray):
            np.add.at(col, rows, delta)
        else:
            col.add_at(rows, delta)

    def dense(self) -> np.ndarray:
        """Every level as one levels-by-rows array (for checks)."""
        return np.stack([c if isinstance(c, np.ndarray) else c.dense(self._n) for c in self.cols]) \
            if self.cols else np.zeros((0, self._n), dtype=self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self.cols)
