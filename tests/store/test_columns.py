"""The page table's columns that are not an array of every row: the row maps (C against
dict), the sparse and dense levels against a numpy 2-D array, the uniform length column."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from tierkv.store import columns
from tierkv.store.columns import CountColumn, LevelColumns, PyRowMap, SparseColumn, UniformColumn


def _row_maps() -> list[Any]:
    return [PyRowMap()] + ([columns._table.RowMap()] if columns._table is not None else [])


def _i64(values: list[int]) -> bytes:
    return np.array(values, dtype=np.int64).tobytes()


def test_the_row_maps_answer_alike_through_random_operations() -> None:
    """The C map against the dict one and a plain dict, through growth to thousands of rows
    and shrinking back (put, add with repeated rows, zeros removing rows)."""
    rng = random.Random(11)
    maps, ref = _row_maps(), dict[int, int]()
    for step in range(3000):
        span = 40 if step % 1000 < 500 else 20000
        rows = [rng.randrange(span) for _ in range(rng.randrange(1, 60))]
        op = rng.random()
        if op < 0.35:
            vals = [rng.choice((0, 0, 1, -5, rng.randrange(1, 1 << 40))) for _ in rows]
            for m in maps:
                m.put(_i64(rows), _i64(vals))
            for r, v in zip(rows, vals):
                ref[r] = v
        elif op < 0.6:
            deltas = [rng.choice((1, -1, 2)) for _ in rows]
            for m in maps:
                m.add(_i64(rows), _i64(deltas))
            for r, d in zip(rows, deltas):
                ref[r] = ref.get(r, 0) + d
        elif op < 0.75:                     # empty most rows again: the map shrinks
            gone = [r for r in ref if rng.random() < 0.9]
            for m in maps:
                m.put(_i64(gone), _i64([0] * len(gone)))
            for r in gone:
                ref[r] = 0
        else:
            r, v = rows[0], rng.choice((0, 3))
            for m in maps:
                m.put1(r, v)
            ref[r] = v
        ref = {r: v for r, v in ref.items() if v}
        want = [ref.get(r, 0) for r in rows]
        for m in maps:
            assert np.frombuffer(m.get(_i64(rows)), dtype=np.int64).tolist() == want
            assert [m.get1(r) for r in rows[:3]] == want[:3]
            assert len(m) == len(ref)
        if step % 100 == 0:
            for m in maps:
                got_rows, got_vals = (np.frombuffer(b, dtype=np.int64).tolist() for b in m.items())
                assert dict(zip(got_rows, got_vals)) == ref


@pytest.mark.parametrize("impl", range(2))
def test_a_row_map_refuses_bad_rows_and_buffers_and_changes_nothing(impl: int) -> None:
    maps = _row_maps()
    if impl >= len(maps):
        pytest.skip("tierkv._table is not built")
    m = maps[impl]
    m.put(_i64([5]), _i64([7]))
    for bad in (-1, (1 << 31) - 1):
        with pytest.raises(ValueError, match="a row is 0 to"):
            m.put(_i64([1, bad]), _i64([1, 1]))
        with pytest.raises(ValueError, match="a row is 0 to"):
            m.get(_i64([bad]))
    with pytest.raises(ValueError, match="2 rows and 1 values"):
        m.add(_i64([1, 2]), _i64([1]))
    with pytest.raises(ValueError):
        m.get(b"1234")                      # not int64s
    for bad_rows in (np.array([5, 0, 0, 0, 0, 0, 0, 0], dtype=np.uint8), np.array([5, 0], dtype=np.uint32),
                     np.array([5, 0, 0, 0], dtype=np.int16), np.array([5.0])):
        with pytest.raises(ValueError, match="rows must be int64 or int32 values"):
            m.get(bad_rows)                 # never its bytes read as int64 rows
    with pytest.raises(ValueError, match="values must be int64 values"):
        m.put(np.array([5], dtype=np.int32), np.array([0], dtype=np.int32))
    m.put(np.array([6], dtype=np.int32), np.array([8], dtype=np.int64))
    assert np.frombuffer(m.get(np.array([5, 6], dtype=np.int32)), dtype=np.int64).tolist() == [7, 8]
    m.put1(6, 0)
    assert len(m) == 1 and m.get1(5) == 7 and m.get1(1) == 0


@pytest.mark.parametrize("maps", ["c", "py"])
def test_level_columns_index_as_the_2d_array_they_stand_for(maps: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sparse and dense levels mixed, against a numpy [level, row] array, through every
    way the manager indexes them (sparse levels in the C map, or the dict one where the
    extension is not built)."""
    if maps == "py":
        monkeypatch.setattr(columns, "_table", None)
    elif columns._table is None:
        pytest.skip("tierkv._table is not built")
    rng = np.random.default_rng(5)
    n = 3000
    cols = LevelColumns(np.uint32, [True, False, True])
    cols.grow(n)
    ref = np.zeros((3, n), dtype=np.uint32)
    for step in range(2000):
        lvl = int(rng.integers(3))
        rows = rng.integers(0, n, int(rng.integers(1, 30)))
        op = rng.random()
        if op < 0.3:
            vals = rng.choice([0, 1, 7, 4_000_000_000], len(rows)).astype(np.int64)
            cols[lvl, rows] = vals
            ref[lvl, rows] = vals
        elif op < 0.45:
            r = int(rows[0])
            cols[lvl, r] += 1
            ref[lvl, r] += 1
            cols[lvl, np.int32(r)] = cols[lvl, r] - 1
            ref[lvl, r] -= 1
        elif op < 0.6:
            u = np.unique(rows)             # a fancy += adds once a row, as numpy's does
            cols[lvl, u] += 2
            ref[lvl, u] += 2
            cols.add_unique(lvl, u.astype(np.int32), 3)
            ref[lvl, u] += 3
        elif op < 0.75:
            cols.add_at(lvl, rows, 1)       # repeated rows count each time
            np.add.at(ref[lvl], rows, 1)
        elif op < 0.85:
            levels = rng.integers(0, 3, len(rows))
            assert np.array_equal(cols[levels, rows], ref[levels, rows])
        else:
            assert np.array_equal(cols[:, rows], ref[:, rows])
            assert np.array_equal(cols[:, int(rows[0])], ref[:, int(rows[0])])
        assert np.array_equal(cols[lvl, rows], ref[lvl, rows])
        assert cols[lvl, int(rows[0])] == ref[lvl, rows[0]] and type(cols[lvl, int(rows[0])]) is np.uint32
        assert cols.only_at(lvl, int(rows[0])) == (not np.delete(ref[:, rows[0]], lvl).any())
    assert np.array_equal(cols.dense(), ref)
    assert len(cols[0]) == int(np.count_nonzero(ref[0]))
    with pytest.raises(TypeError, match="integer rows"):
        cols[0, ref[0] > 0]                 # a mask is not rows
    with pytest.raises(IndexError, match="levels -1 to 0"):
        cols[np.array([-1, 0]), np.array([1, 2])]
    assert cols[0, []].shape == (0,) and cols[np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)].shape == (0,)
    assert cols.sparse == [True, False, True] and isinstance(cols[2], SparseColumn)
    assert isinstance(cols[0]._map, PyRowMap) == (maps == "py")


@pytest.mark.parametrize(("dense_after", "common"), [(4096, 0.9), (40, 0.3)], ids=["sparse", "turns-dense"])
def test_a_uniform_column_reads_as_the_array_it_stands_for(dense_after: int, common: float) -> None:
    """Mostly one value (a page length), some others and zeros, rows freed and the table
    grown, against a numpy column; with many other values it turns into an array, same
    answers. Rows never set read as the first value set."""
    rng = np.random.default_rng(9)
    col = UniformColumn(np.uint32)
    col.DENSE_AFTER = dense_after
    col.grow(1000)
    ref = np.zeros(1000, dtype=np.uint32)
    assert col[5] == 0 and col.others == 0
    held = np.zeros(1000, dtype=bool)
    first: int | None = None
    for step in range(3000):
        if step == 1500:
            col.grow(4000)
            ref = np.concatenate([ref, np.zeros(3000, dtype=np.uint32)])
            held = np.concatenate([held, np.zeros(3000, dtype=bool)])
        rows = np.unique(rng.integers(0, len(ref), int(rng.integers(1, 20))))
        op = rng.random()
        if op < 0.5:
            vals = np.where(rng.random(len(rows)) < common, 4096, rng.choice([0, 17, 2 ** 32 - 1], len(rows)))
            col[rows] = vals
            ref[rows] = vals
            held[rows] = True
            first = int(vals[0]) if first is None else first
        elif op < 0.6:
            r, v = int(rows[0]), int(rng.choice([4096, 12]))
            first = v if first is None else first
            col[r] = v
            ref[r] = v
            held[r] = True
        elif op < 0.7:
            col.forget(rows)                # freed: never read until set again
            held[rows] = False
        live = np.flatnonzero(held)
        if len(live):
            assert np.array_equal(col[live], ref[live]) and col[live].dtype == np.uint32
            r = int(live[rng.integers(len(live))])
            assert col[r] == ref[r] and type(col[r]) is np.uint32
        assert np.array_equal(col.dense()[held], ref[held])
    assert col.common == first and (col.others is None) == (dense_after == 40)
    if col.others is not None:
        with pytest.raises(TypeError, match="integer rows"):
            col[held]                           # a mask is not rows
    if col.others is not None:                  # what it keeps: the rows held with another length, at most
        assert col.others <= int((held & (ref != first)).sum())


@pytest.mark.parametrize("maps", ["c", "py"])
def test_a_count_column_reads_as_the_int32_array_it_stands_for(maps: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counts around the byte's limit (254, 255, 256 and far above) set, added (once a row
    and once an occurrence) and taken back, against a numpy int32 column: same reads, the
    map holding exactly the rows at 255 or more."""
    if maps == "py":
        monkeypatch.setattr(columns, "_table", None)
    elif columns._table is None:
        pytest.skip("tierkv._table is not built")
    rng = np.random.default_rng(17)
    col = CountColumn()
    col.grow(500)
    ref = np.zeros(500, dtype=np.int32)
    for step in range(4000):
        if step == 2000:
            col.grow(1500)
            ref = np.concatenate([ref, np.zeros(1000, dtype=np.int32)])
        rows = rng.integers(0, len(ref), int(rng.integers(1, 12)))
        op = rng.random()
        if op < 0.25:
            vals = rng.choice([0, 1, 2, 254, 255, 256, 70_000], len(rows)).astype(np.int32)
            col[rows] = vals                # a row named twice keeps its last value
            ref[rows] = vals
        elif op < 0.45:
            u = np.unique(rows)
            d = int(rng.choice([1, 2, 300]))
            if rng.random() < 0.5:
                col[u] += d
            else:                           # the put's fast path where every sum stays small
                col.add_unique(u.astype(np.int32), d if rng.random() < 0.7 else np.full(len(u), d))
            ref[u] += d
        elif op < 0.65:
            ok = rows[ref[rows] >= np.bincount(rows, minlength=len(ref))[rows]]
            col.add_at(ok, -1)              # each occurrence takes one
            np.subtract.at(ref, ok, 1)
        elif op < 0.8:
            col.add_at(rows, 1)
            np.add.at(ref, rows, 1)
        else:
            r = int(rows[0])
            col[r] += 1
            ref[r] += 1
            v = col[r] - 1 if rng.random() < 0.5 else int(rng.choice([255, 3]))
            col[np.int64(r)] = v
            ref[r] = v
        got = col[rows]
        assert got.dtype == np.int32 and np.array_equal(got, ref[rows]), step
        assert col[int(rows[0])] == ref[rows[0]] and type(col[int(rows[0])]) is int
        col.check()
    assert np.array_equal(col.dense(), ref) and col.big == int((ref >= 255).sum()) > 0
    small = CountColumn()                   # a byte a row while counts stay small
    small.grow(len(ref))
    small[np.arange(len(ref))] = np.arange(len(ref)) % 3
    assert small.nbytes < ref.nbytes / 3 and small.big == 0


def test_a_count_columns_small_counts_add_as_numpy_does_until_one_turns_big() -> None:
    """The put's path: distinct rows gaining a child each while no count is big (bytes
    only), up to and past 255, where the row moves to the map."""
    rng = np.random.default_rng(23)
    col = CountColumn()
    col.grow(16)
    ref = np.zeros(16, dtype=np.int64)
    for _ in range(1000):
        rows = rng.choice(16, int(rng.integers(0, 8)), replace=False).astype(np.int32)
        d = int(rng.choice([1, 1, 1, 3]))
        col.add_unique(rows, d)
        ref[rows] += d
        assert np.array_equal(col.dense(), ref) and col.big == int((ref >= 255).sum())
        col.check()
    assert col.big > 0


def test_a_count_column_refuses_what_is_no_count_and_changes_nothing() -> None:
    col = CountColumn()
    col.grow(10)
    col[np.array([1, 2])] = np.array([3, 300])
    with pytest.raises(ValueError, match="0 or more, got -1 for row 4"):
        col[np.array([3, 4])] = np.array([1, -1])
    with pytest.raises(ValueError, match="0 or more, got -2 for row 5"):
        col[5] = -2
    with pytest.raises(ValueError, match="0 or more"):
        col.add_at(np.array([1, 1, 1, 1]), -1)
    with pytest.raises(TypeError, match="integer rows"):
        col[np.ones(10, dtype=bool)]        # a mask is not rows
    with pytest.raises(TypeError, match="integers"):
        col[np.array([1])] = np.array([1.5])
    with pytest.raises(IndexError, match="row 12 is not one of the count column's 10 rows"):
        col[12] = 300                       # past the end: neither the bytes nor the map change
    with pytest.raises(IndexError, match="row -1 is not one"):
        col[np.array([3, -1])] = np.array([1, 400])
    assert col.dense().tolist() == [0, 3, 300, 0, 0, 0, 0, 0, 0, 0]
    col.check()
    assert col[np.array(2)] == 300 and col[np.array(1)] == 3    # a 0-d array names one row
    with pytest.raises(ValueError, match="count levels are int32"):
        LevelColumns(np.uint32, [False], counts=True)
    levels = LevelColumns(np.int32, [True, False], counts=True)
    levels.grow(10)
    levels.add_at(1, np.array([2] * 400), 1)
    levels.add_unique(0, np.array([2]), 5)
    assert levels[:, 2].tolist() == [5, 400] and not levels.only_at(1, 2) and levels[1].big == 1
    assert levels.dense()[:, 2].tolist() == [5, 400]
