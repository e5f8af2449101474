"""The page table: the C core against the pure-Python one, and the manager's columns."""

from __future__ import annotations

import random
from typing import Any
from pathlib import Path

import numpy as np
import pytest

from tierkv.errors import InputError
from tierkv.keys import PageKey
from tierkv.store.table import (NO_LEVEL, LevelColumns, PageTable, PyCore, PyRowMap, SparseColumn, UniformColumn,
                                new_core, rows_of)

native = pytest.mark.skipif(type(new_core()) is PyCore, reason="tierkv._table is not built")


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big") if i % 3 else random.Random(i).randbytes(16)


@native
def test_the_c_core_answers_as_the_python_core_does_through_random_operations() -> None:
    rng = random.Random(7)
    cores = [new_core(), PyCore()]
    known: list[bytes] = []
    for step in range(4000):
        op = rng.random()
        if op < 0.4 or not known:
            blob = b"".join(_key(rng.randrange(3000)) for _ in range(rng.randrange(1, 20)))
            got = [c.ensure(blob) for c in cores]
            # Row numbers may differ; which keys were new may not.
            assert got[0][1] == got[1][1]
            known.extend(blob[i:i + 16] for i in range(0, len(blob), 16))
        elif op < 0.55:
            key = rng.choice(known)
            rows = [c.row(key) for c in cores]
            assert (rows[0] < 0) == (rows[1] < 0)
            if rows[0] >= 0:
                for c, r in zip(cores, rows):
                    c.release(np.array([r], dtype=np.int32).tobytes())
        elif op < 0.75:
            key = rng.choice(known)
            rows = [c.row(key) for c in cores]
            if rows[0] >= 0:
                level = rng.choice([0, 1, 2, NO_LEVEL])
                for c, r in zip(cores, rows):
                    c.set_levels(np.array([r], dtype=np.int32).tobytes(), level)
        else:
            blob = b"".join(rng.choice(known) for _ in range(rng.randrange(0, 12)))
            assert cores[0].prefix_values(blob) == cores[1].prefix_values(blob)
            assert cores[0].prefix_len(blob) == cores[1].prefix_len(blob)
            a, b = (rows_of(c.prefix_rows(blob)) for c in cores)
            assert [c.keys(r.tobytes()) for c, r in zip(cores, (a, b))] == [blob[:16 * len(a)]] * 2
            assert (rows_of(cores[0].find(blob)) >= 0).tolist() == (rows_of(cores[1].find(blob)) >= 0).tolist()
        assert len(cores[0]) == len(cores[1]) and cores[0].rows == cores[1].rows, step
    live = [c.keys(c.live_rows()) for c in cores]
    assert sorted(live[0][i:i + 16] for i in range(0, len(live[0]), 16)) == \
        sorted(live[1][i:i + 16] for i in range(0, len(live[1]), 16))


@native
def test_long_prefix_scans_answer_as_the_python_core_does() -> None:
    """The C scan reads a key's map slot ahead and its row's key and level ahead of that
    (prefix_scan): blobs longer than its lookahead, misses, unpublished and released rows
    at every position, keys that share probe chains, any start, answer as key-by-key
    lookups do."""
    rng = random.Random(11)
    cores = [new_core(), PyCore()]
    pool = [_key(i) for i in range(6000)]
    for c in cores:
        c.ensure(b"".join(pool))
    for key in pool:   # published at random levels, some unpublished or released
        r, level = rng.random(), rng.randrange(3)
        for c in cores:
            row = np.array([c.row(key)], dtype=np.int32).tobytes()
            if r < 0.04:
                c.release(row)
            else:
                c.set_levels(row, NO_LEVEL if r < 0.08 else level)
    absent = [(10_000 + i).to_bytes(16, "little") for i in range(50)]
    for _ in range(400):
        keys = [rng.choice(pool) for _ in range(rng.randrange(0, 300))]
        if keys and rng.random() < 0.5:
            keys[rng.randrange(len(keys))] = rng.choice(absent)
        blob = b"".join(keys)
        want = cores[1].prefix_values(blob)
        assert cores[0].prefix_values(blob) == want
        start = rng.randrange(len(keys) + 1)
        assert cores[0].prefix_len(blob, start) == cores[1].prefix_len(blob, start)
        lead = b""
        for k in keys:   # key by key, as a lookup of one key at a time answers
            one = cores[0].get(k)
            if one is None:
                break
            lead += bytes((one,))
        assert want == lead


@pytest.mark.parametrize("core", [pytest.param("c", marks=native), "py"])
def test_bad_input_is_refused_with_a_clear_error(core: str) -> None:
    c = new_core() if core == "c" else PyCore()
    with pytest.raises(ValueError, match="16-byte keys"):
        c.ensure(b"x" * 17)
    with pytest.raises(ValueError, match="16 bytes"):
        c.row(b"short")
    with pytest.raises(KeyError, match="row 5"):
        c.release(np.array([5], dtype=np.int32).tobytes())
    rows, _ = c.ensure(b"k" * 16)
    with pytest.raises(ValueError, match="1 rows but 2 levels"):
        c.set_levels(rows, b"\0\0")


@native
def test_rows_are_reused_and_the_table_grows_past_its_first_capacity() -> None:
    t = PageTable(2)
    blob = b"".join(i.to_bytes(16, "little") for i in range(1, 5001))
    rows, fresh = t.ensure(blob)
    assert fresh.all() and len(set(rows.tolist())) == 5000 and t.core.rows == 5000
    assert len(t.parent) >= t.core.capacity >= 5000
    t.release(rows[:100])
    again, fresh = t.ensure(blob[:1600])
    assert fresh.all() and set(again.tolist()) == set(rows[:100].tolist())   # freed rows come back first
    assert (rows_of(t.core.find(blob)) >= 0).all()


@native
def test_keys_already_in_the_table_grow_nothing() -> None:
    """A reopen ensures every parent after its page: a blob of keys the table holds must
    not grow the rows or the map as if they were new (it doubled both: 80 -> 159 bytes a
    page after reopening 1M pages)."""
    core = new_core()
    blob = b"".join(i.to_bytes(16, "little") for i in range(1, 70_001))
    core.ensure(blob)
    capacity, nbytes = core.capacity, core.nbytes
    _, fresh = core.ensure(blob + blob)
    assert not any(fresh) and (core.capacity, core.nbytes) == (capacity, nbytes)
    more = b"".join(i.to_bytes(16, "little") for i in range(70_001, 70_101))
    _, fresh = core.ensure(blob + more)
    assert sum(fresh) == 100 and core.rows == 70_100 and core.capacity <= 2 * capacity


@native
@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
@pytest.mark.parametrize("start", range(12))
def test_a_failed_growth_takes_back_the_calls_new_rows(start: int, shared: bool) -> None:
    """Allocations fail from the start-th on (the result buffers, the map, the records):
    ensure either gives every key a row or raises having added none, the free rows as
    they were. On a key table a ghost shares, the keys it remembers stay its own."""
    testcapi = pytest.importorskip("_testcapi")
    more = b"".join(i.to_bytes(16, "little") for i in range(5001, 6001))
    remembered = [PageKey(more[i:i + 16]) for i in range(8000, 8320, 16)]
    ghost = None
    if shared:
        from tierkv.policy import gittins
        if gittins._ghost is None:
            pytest.skip("tierkv.policy._ghost is not built")
        keys = gittins._ghost.new_keys()
        ghost = gittins._ghost.Ghost(gittins.MAX_AGE, keys=keys)
        ghost.on_request(remembered, 1.0, 100)
        core = new_core(keys)
    else:
        core = new_core()
    first = b"".join(i.to_bytes(16, "little") for i in range(1, 1001))
    rows, _ = core.ensure(first)
    free = rows_of(rows)[:10]
    core.release(free.tobytes())                        # ten rows on the free stack
    failed = False
    testcapi.set_nomemory(start, 0)
    try:
        core.ensure(more)
    except MemoryError:
        failed = True
    finally:
        testcapi.remove_mem_hooks()
    if not failed:
        assert core.rows == 1990 and (rows_of(core.find(more)) >= 0).all()
        return
    assert core.rows == 990 and (rows_of(core.find(more)) < 0).all()
    if ghost is not None:   # the keys it added are gone from the key table, the ghost's stay
        assert all(ghost.entry(k) is not None for k in remembered)
        assert gittins._ghost.keys_len(keys) == 990 + len(remembered)
    again, fresh = core.ensure(more[:160])
    assert all(fresh) and set(rows_of(again).tolist()) == set(free.tolist())   # the free stack as it was
    assert (rows_of(core.find(more[:160])) >= 0).all() and (rows_of(core.find(more[160:])) < 0).all()

def test_depths_count_ancestors() -> None:
    t = PageTable(1)
    rows, _ = t.ensure(b"".join(i.to_bytes(16, "little") for i in range(1, 301)))
    for i in range(1, 300):          # one chain of 300 pages: parent of page i is page i - 1
        t.parent[rows[i]] = rows[i - 1] + 1
    assert t.depths()[rows].tolist() == list(range(300))


def _row_maps() -> list[Any]:
    from tierkv.store import table
    return [PyRowMap()] + ([table._table.RowMap()] if table._table is not None else [])


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
    from tierkv.store import table
    if maps == "py":
        monkeypatch.setattr(table, "_table", None)
    elif table._table is None:
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


def test_pages_of_another_length_leave_no_entry_behind_when_they_go() -> None:
    """Pages of an odd length are the length column's exceptions; once they leave the
    store (forgotten, or their parent placeholders released) no entry of theirs stays."""
    from tierkv.policy import make_policy
    from tierkv.sim.tiers import sim_tiers
    from tierkv.store.manager import BlockManager

    tiers = sim_tiers([4, 64])
    m = BlockManager(tiers, {t.name: make_policy("lru") for t in tiers}, None)

    def store(first: int, n: int, nbytes: int) -> list[PageKey]:
        keys = [PageKey(i.to_bytes(16, "big")) for i in range(first, first + n)]
        plan = m.plan_store([(k, keys[j - 1] if j else None) for j, k in enumerate(keys)], nbytes)
        for moves in plan.move_groups(m.levels):
            m.publish(moves.placed(), dict.fromkeys(moves.keys, 0), plan)
        for batch in plan.placed_by_level(m.levels):
            m.publish(batch, dict.fromkeys(batch.keys, 0), plan)
        m.commit_deletes(plan)
        return keys

    store(1, 8, 4096)
    odd = store(100, 6, 1000)
    col = m.table.nbytes
    assert col.common == 4096 and col.others == 6
    assert [m.entry(k).nbytes for k in odd] == [1000] * 6   # type: ignore[union-attr]
    m.forget(odd[0])                        # its chain goes with it
    m.check()
    assert col.others == 0 and all(m.entry(k) is None for k in odd)


def test_a_small_fast_tier_keeps_sparse_columns(tmp_path: Path) -> None:
    """DRAM with at most 1/8 of the store's slots keeps its slots and child counts for its
    own pages only; a big one, and the slowest tier, keep a column of every row."""
    from tests.conftest import make_config
    from tierkv.store.api import Store
    for dram, want in ((3, [True, False]), (6, [False, False])):
        with Store.open(make_config(tmp_path / str(dram), dram, 40)) as s:
            assert s._manager.table.slot.sparse == s._manager.table.kids.sparse == want


@pytest.mark.parametrize("dram", [6, 3], ids=["dense", "sparse"])
@pytest.mark.parametrize("policy", ["gittins", "lru", "s3fifo"])
def test_the_managers_columns_stay_consistent_through_random_store_traffic(tmp_path: Path, policy: str,
                                                                             dram: int) -> None:
    from tests.conftest import LAYOUT, make_config, page_data
    from tierkv.store.api import Store

    tpp = LAYOUT.tokens_per_page
    rng = np.random.default_rng(3)
    bases = [rng.integers(0, 50000, 12 * tpp) for _ in range(6)]
    cfg = make_config(tmp_path / "s", dram, 20 if dram == 6 else 40, policy=policy)
    with Store.open(cfg) as s:
        assert s._manager.table.slot.sparse == [dram == 3, False]
        for step in range(300):
            base = bases[int(rng.integers(len(bases)))]
            n = int(rng.integers(1, 13))
            tokens = base[:n * tpp].copy()
            if rng.random() < 0.3:                  # a branch: same prefix, different tail
                tokens[-tpp:] = rng.integers(0, 50000, tpp)
            if rng.random() < 0.5:
                s.put(tokens, page_data(step, n))
            else:
                s.get(tokens, np.zeros((n, LAYOUT.page_bytes), dtype=np.uint8))
            if rng.random() < 0.1:
                s.pin(tokens)
            elif rng.random() < 0.1:
                s.unpin(tokens)
            s._manager.check()
    with Store.open(cfg) as s:                      # reopened from the index
        s._manager.check()
        assert len(s._manager) > 0


@pytest.mark.parametrize("core", [pytest.param("c", marks=native), "py"])
def test_levels_outside_a_byte_are_refused(core: str) -> None:
    c = new_core() if core == "c" else PyCore()
    rows, _ = c.ensure(b"k" * 16)
    for bad in (-1, 256):
        with pytest.raises((ValueError, OverflowError)):
            c.set_levels(rows, bad)
    assert c.get(b"k" * 16) is None and c.row(b"k" * 16) >= 0



def test_a_tier_with_more_slots_than_the_slot_column_holds_is_refused() -> None:
    from tierkv.policy import make_policy
    from tierkv.sim.tiers import sim_tiers
    from tierkv.store.manager import BlockManager
    from tierkv.store.table import MAX_SLOTS

    tiers = sim_tiers([4, 8])
    tiers[1].num_slots = MAX_SLOTS + 1   # as a 16 TiB tier of 4 KiB pages would have; not allocated here
    with pytest.raises(InputError, match=r"the \w+ tier has 4,294,967,296 slots; a tier holds at most 4,294,967,295"):
        BlockManager(tiers, {t.name: make_policy("lru") for t in tiers}, None)
    tiers[1].num_slots = MAX_SLOTS
    BlockManager(tiers, {t.name: make_policy("lru") for t in tiers}, None)
