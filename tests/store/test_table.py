"""The page table: the C core against the pure-Python one, and the manager's columns."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tierkv.errors import InputError
from tierkv.keys import PageKey
from tierkv.store.table import NO_LEVEL, PageTable, PyCore, new_core, rows_of

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


@pytest.mark.parametrize("policy", ["lru", "gittins"])
def test_a_page_with_hundreds_of_cached_children_counts_them_all(policy: str) -> None:
    """The children counts are a byte a row, and a map for the rows with 255 or more: a
    shared prefix page with 600 branches counts each, in both tiers, through the bulk put
    (one call naming it 300 times), puts of one page, demotions and evictions, and back
    down to none when its children go."""
    from tierkv.policy import make_policy
    from tierkv.sim.tiers import sim_tiers
    from tierkv.store.manager import BlockManager

    tiers = sim_tiers([64, 700])
    m = BlockManager(tiers, {t.name: make_policy(policy) for t in tiers}, None)

    def store(pages: list[tuple[PageKey, PageKey | None]]) -> None:
        plan = m.plan_store(pages, 4096)
        for moves in plan.move_groups(m.levels):
            m.publish(moves.placed(), dict.fromkeys(moves.keys, 0), plan)
        for batch in plan.placed_by_level(m.levels):
            m.publish(batch, dict.fromkeys(batch.keys, 0), plan)
        m.commit_deletes(plan)

    root = PageKey(bytes(16))
    kids = [PageKey(i.to_bytes(16, "big")) for i in range(1, 601)]
    store([(root, None)])
    store([(k, root) for k in kids[:40]])
    store([(k, root) for k in kids[40:340]])     # 300 in one call: the bulk count
    for k in kids[340:]:
        store([(k, root)])
    m.check()
    t, r = m.table, m.table.core.row(root)
    held = [k for k in kids if m.entry(k) is not None]
    assert int(t.nkids[r]) == len(held) > 255 and t.nkids.big == 1
    assert int(t.kids[1, r]) > 255            # the slow tier's count is in the map too
    for k in held[:-3]:
        m.forget(k)
    m.check()
    assert int(t.nkids[r]) == 3 and t.nkids.big == 0 and t.kids[1].big == 0


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
