"""The key table a compiled ghost, leaf heaps and page table share: sharing it changes no answer.

A Ghost and a LeafHeaps on one key table (``keys=``, as GittinsPolicy builds them), and
a page table on it too (as a store's manager builds it for its slowest tier), are
driven with random operations, each beside a twin with a table of its own (the page
table's: the pure-Python core); every answer must be the same. The universe of keys is
small and the ghost's limit low, so keys are forgotten by one while another holds them,
freed and handed out again under new keys. Skipped where the extensions are not built.
"""

from __future__ import annotations

import random
import tracemalloc
from typing import Any

import numpy as np
import pytest

from tierkv.errors import InputError
from tierkv.keys import PageKey
from tierkv.policy import gittins
from tierkv.policy.leaves import NativeLeafHeaps
from tierkv.store.table import NO_LEVEL, PyCore, new_core, rows_of
from tests.policy.helpers import everything

_ghost = gittins._ghost
pytestmark = pytest.mark.skipif(_ghost is None or NativeLeafHeaps is None or type(new_core()) is PyCore,
                                reason="tierkv.policy._ghost, _leaves or tierkv._table is not built")

CLASSES = 3


def _answer(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except KeyError as e:
        return "KeyError", e.args
    except InputError:
        return "InputError", ()


class Pair:
    """One structure on the shared table and its twin on a table of its own."""

    def __init__(self, shared: Any, own: Any) -> None:
        self.shared, self.own = shared, own

    def same(self, name: str, *args: Any) -> Any:
        a = _answer(getattr(self.shared, name), *args)
        b = _answer(getattr(self.own, name), *args)
        assert a == b, f"{name}{args}: shared {a!r}, own {b!r}"
        assert len(self.shared) == len(self.own)
        return a[1]


def _keys(rng: random.Random, n: int) -> list[PageKey]:
    out: set[bytes] = set()
    while len(out) < n:
        size = rng.choice((16, 16, 1, 2, rng.randint(1, 16)))
        out.add(bytes(rng.choice((0, 1, rng.randrange(256))) for _ in range(size)))
    return [PageKey(k) for k in sorted(out)]


class Tables:
    """A page table on the shared key table and a pure-Python one: the same answers, but
    for row numbers (compared as the keys they stand for)."""

    def __init__(self, table: Any) -> None:
        self.shared, self.own = new_core(table), PyCore()

    def row(self, key: bytes) -> tuple[bytes, bytes]:
        rows = [c.row(key) for c in (self.shared, self.own)]
        assert (rows[0] < 0) == (rows[1] < 0), key
        return tuple(np.array([r], dtype=np.int32).tobytes() for r in rows)  # type: ignore[return-value]

    def step(self, rng: random.Random, long: list[PageKey]) -> None:
        a, b = self.shared, self.own
        op = rng.random()
        if op < 0.35:
            blob = b"".join(rng.choices(long, k=rng.randint(1, 6)))
            (ra, fa), (rb, fb) = a.ensure(blob), b.ensure(blob)
            assert fa == fb and a.keys(ra) == b.keys(rb) == blob
        elif op < 0.55:
            key = rng.choice(long)
            ra, rb = self.row(key)
            if a.row(key) >= 0:
                a.release(ra + ra)            # a row twice in one release
                b.release(rb)
        elif op < 0.75:
            key = rng.choice(long)
            ra, rb = self.row(key)
            if a.row(key) >= 0:
                level = rng.choice((0, 1, NO_LEVEL))
                a.set_levels(ra, level)
                b.set_levels(rb, level)
                assert a.levels(ra) == b.levels(rb)
        else:
            blob = b"".join(rng.choices(long, k=rng.randint(0, 8)))
            assert a.prefix_values(blob) == b.prefix_values(blob)
            assert a.prefix_len(blob) == b.prefix_len(blob)
            assert a.keys(a.prefix_rows(blob)) == b.keys(b.prefix_rows(blob))
            assert (rows_of(a.find(blob)) >= 0).tolist() == (rows_of(b.find(blob)) >= 0).tolist()
        assert len(a) == len(b) and a.rows == b.rows
        assert a.capacity > max(rows_of(a.live_rows()), default=-1)

    def check(self, keys: list[PageKey]) -> None:
        a, b = self.shared, self.own
        for key in keys:
            if len(key) == 16:
                assert a.get(key) == b.get(key) and (key in a) == (key in b)
                self.row(key)
            else:   # a shorter key of the ghost's or leaf heaps' is no page of the table
                assert a.get(key.ljust(16, b"\0")) == b.get(key.ljust(16, b"\0"))
        assert sorted(a.keys(a.live_rows())[i:i + 16] for i in range(0, 16 * a.rows, 16)) == \
            sorted(b.keys(b.live_rows())[i:i + 16] for i in range(0, 16 * b.rows, 16))


def _check(ghost: Pair, heaps: Pair, keys: list[PageKey]) -> None:
    ghost.same("keys")
    for key in keys:
        ghost.same("entry", key)
        ghost.same("class_of", key)
        heaps.same("__contains__", key)
        if key in heaps.own:
            for name in ("last_of", "class_of", "parent_of"):
                heaps.same(name, key)
    long = b"".join(k for k in keys if len(k) == 16)
    ghost.same("classes_of", long)


def _drive(seed: int, steps: int, pages: bool = False) -> None:
    rng = random.Random(seed)
    keys = _keys(rng, rng.choice((10, 30, 80)))
    long = [k for k in keys if len(k) == 16]
    table = _ghost.new_keys()
    ghost = Pair(_ghost.Ghost(gittins.MAX_AGE, keys=table), _ghost.Ghost(gittins.MAX_AGE))
    heaps: Any = Pair(NativeLeafHeaps(CLASSES, keys=table), NativeLeafHeaps(CLASSES))
    rows = Tables(table) if pages and long else None
    clock = 0.0
    for step in range(steps):
        clock += rng.choice((0.0, 1.0))
        if rows is not None and rng.random() < 0.4:
            if rng.random() < 0.01:          # a new page table on the same key table
                rows = None
                rows = Tables(table)
            rows.step(rng, long)
            continue
        op = rng.random()
        key = rng.choice(keys)
        if op < 0.25:                       # a request: the ghost forgets beyond its limit
            req = (rng.sample(keys, rng.randint(0, min(8, len(keys)))) if rng.random() < 0.7
                   else rng.choices(keys, k=rng.randint(0, 8)))      # a key twice in a request
            ghost.same("on_request", req, clock, rng.randint(0, len(keys)))
        elif op < 0.5:
            parent = rng.choice(keys) if rng.random() < 0.7 else None
            heaps.same("add", key, parent if parent != key else None, rng.randrange(CLASSES), clock)
        elif op < 0.58 and long:
            chain = rng.sample(long, rng.randint(1, min(5, len(long))))
            heaps.same("add_many", b"".join(chain), bytes(16) + b"".join(chain[:-1]),
                       bytes([0] + [1] * (len(chain) - 1)), bytes(rng.randrange(CLASSES) for _ in chain), clock, 1.0)
        elif op < 0.7:
            heaps.same("discard", key)
        elif op < 0.75 and long:
            heaps.same("discard_many", b"".join(rng.sample(long, min(3, len(long)))))
        elif op < 0.8:
            heaps.same("touch", key, rng.randrange(CLASSES), clock)
        elif op < 0.9:                      # victims, some settled, some left pending
            for _ in range(rng.randint(1, 3)):
                cands = heaps.same("candidates", everything)
                if not cands:
                    break
                heaps.same("take", rng.choice(cands)[0])
            if rng.random() < 0.7:
                heaps.same("settle")
        elif op < 0.95:
            heaps.same("undo")
        elif op < 0.97:                     # new leaf heaps on the same table: the old one's keys go first
            heaps = None
            heaps = Pair(NativeLeafHeaps(CLASSES, keys=table), NativeLeafHeaps(CLASSES))
        else:
            ghost.same("on_request", [], clock, 0)     # forget everything remembered
        if step % 40 == 0:
            _check(ghost, heaps, keys)
            if rows is not None:
                rows.check(keys)
    _check(ghost, heaps, keys)
    # The table holds what the three hold (remembered, resident, or an absent parent the
    # heaps keep, a row), nothing more: a key none holds any longer was freed.
    held = {bytes(k) for k in ghost.own.keys()} | {bytes(k) for k in keys if k in heaps.own}
    if rows is not None:
        rows.check(keys)
        held |= {bytes(k) for k in long if rows.own.row(k) >= 0}
    assert len(held) <= _ghost.keys_len(table) <= len(held) + sum(k not in heaps.own for k in keys)
    del heaps
    if rows is not None:
        in_rows = {bytes(k) for k in long if rows.own.row(k) >= 0}
        assert _ghost.keys_len(table) == len(ghost.shared) + len(in_rows - {bytes(k) for k in ghost.own.keys()})
        rows = None
    assert _ghost.keys_len(table) == len(ghost.shared)
    del ghost


@pytest.mark.parametrize("seed", range(16))
def test_a_shared_key_table_changes_no_answer(seed: int) -> None:
    _drive(seed, 1500)


@pytest.mark.parametrize("seed", range(16))
def test_a_page_table_on_the_shared_key_table_changes_no_answer(seed: int) -> None:
    """The page table's rows are ids of the key table: a row released while the ghost
    remembers its key keeps the id (and its level reads unpublished), a key the ghost
    forgets while the table holds it stays a row, ids freed by one serve the others."""
    _drive(100 + seed, 2500, pages=True)


def test_the_table_holds_each_shared_key_once() -> None:
    """Pages both remembered and resident cost one 64-byte record (key, ghost node, leaf
    node) and one map entry, not a node with the key inline in each and two maps (about
    93 bytes a page before)."""
    n = 1 << 16
    keys = [PageKey(i.to_bytes(16, "big")) for i in range(n)]
    blob = b"".join(keys)
    parents, has_parent, classes = bytes(16) + blob[:-16], bytes([0] + [1] * (n - 1)), bytes(n)
    tracemalloc.start()
    try:
        table = _ghost.new_keys()
        ghost = _ghost.Ghost(gittins.MAX_AGE, keys=table)
        heaps = NativeLeafHeaps(7, keys=table)
        for i in range(0, n, 32):
            ghost.on_request(keys[i:i + 32], float(i // 32), n)
        heaps.add_many(blob, parents, has_parent, classes, 1.0, 1.0)
        traced = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(ghost) == len(heaps) == n
    total = ghost.nbytes() + heaps.nbytes() + _ghost.keys_nbytes(table)
    assert total / n < 80, f"{total / n:.1f} bytes a page"
    assert traced / n < 80


def test_a_structure_let_go_of_frees_its_keys() -> None:
    """A leaf heaps dropped while the ghost lives on lets go of its keys: the table frees
    the ones the ghost does not hold, and their ids serve new keys."""
    table = _ghost.new_keys()
    ghost = _ghost.Ghost(gittins.MAX_AGE, keys=table)
    ghost.on_request([PageKey(b"a"), PageKey(b"b")], 1.0, 10)
    heaps = NativeLeafHeaps(1, keys=table)
    for i in range(5000):
        heaps.add(PageKey(b"k%d" % i), None, 0, float(i))
    grown = _ghost.keys_nbytes(table)
    with pytest.raises(InputError, match="serves leaf heaps already"):
        NativeLeafHeaps(1, keys=table)       # two would take each other's keys for their own
    with pytest.raises(InputError, match="serves a ghost already"):
        _ghost.Ghost(gittins.MAX_AGE, keys=table)
    del heaps
    heaps = NativeLeafHeaps(1, keys=table)
    for i in range(5000):
        heaps.add(PageKey(b"j%d" % i), None, 0, float(i))
    assert _ghost.keys_nbytes(table) == grown          # the freed ids were handed out again
    assert ghost.entry(PageKey(b"a")) is not None and PageKey(b"k1") not in heaps


@pytest.mark.parametrize("make", [lambda t: _ghost.Ghost(1.0, keys=t), lambda t: NativeLeafHeaps(1, keys=t)],
                         ids=["ghost", "leaves"])
def test_keys_must_be_a_key_table(make: Any) -> None:
    with pytest.raises(InputError, match="key table"):
        make(object())
    with pytest.raises(InputError, match="key table"):
        _ghost.keys_nbytes(b"table")


def test_a_touch_whose_class_conversion_discards_the_key_leaves_it_gone() -> None:
    """Converting touch's class may run Python code; if that code discards the page, the
    touch finds it gone (it looked the page up after converting, not before)."""
    table = _ghost.new_keys()
    heaps = NativeLeafHeaps(2, keys=table)
    ghost = _ghost.Ghost(gittins.MAX_AGE, keys=table)

    class Cls:
        def __index__(self) -> int:
            heaps.discard(PageKey(b"a"))
            ghost.on_request([PageKey(b"zz")], 9.0, 0)      # the ghost may take the freed id
            return 1

    heaps.add(PageKey(b"a"), None, 0, 1.0)
    heaps.touch(PageKey(b"a"), Cls(), 2.0)
    assert PageKey(b"a") not in heaps and len(heaps) == 0
    heaps.add(PageKey(b"c"), PageKey(b"b"), 0, 3.0)
    assert heaps.candidates(everything) == [(b"c", 0, 3.0, False), (b"c", 0, 3.0, True)]


def test_keys_twice_in_a_request_are_remembered_as_the_python_ghost_does() -> None:
    """A request may name a page twice, new ones included: the compiled pass looks each
    key up before it adds any, and a key added earlier in the same pass must be found."""
    from tests.policy.test_gittins_native import _same_ghost

    rng = random.Random(3)
    py, c = gittins.GittinsPolicy(native=False, ghost_pages=16), gittins.GittinsPolicy(ghost_pages=16)
    for _ in range(400):
        req = [PageKey(bytes([rng.randrange(60)]) * rng.choice((1, 16))) for _ in range(rng.randint(0, 12))]
        py.on_request(req, 0.0)
        c.on_request(req, 0.0)
        _same_ghost(py, c)
