"""GittinsPolicy with the compiled ghost against the pure-Python one: same decisions, every step.

Both are driven with the same random request streams, as a block manager with a small
tier would drive them (``on_request``, then per page touch, or admit, victims, remove
and insert), and every answer is compared: admissions, victims, the class of every
page, the ghost (order, last access, count, class, next page) and the reuse model's
histograms bit for bit. Skipped where ``tierkv.policy._ghost`` is not built.
"""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest

from tierkv.errors import InputError
from tierkv.keys import PageKey, split_keys
from tierkv.policy import gittins, hazard
from tierkv.policy.gittins import GittinsPolicy
from tierkv.policy.hazard import CENSOR, REUSE, START, ReuseModel

pytestmark = pytest.mark.skipif(gittins._ghost is None, reason="tierkv.policy._ghost is not built")


def _prompts(rng: random.Random, n: int) -> list[list[PageKey]]:
    """Requests as conversations: shared system prompts, turns that extend, edits that branch."""
    serial = iter(range(1, 1 << 30))

    def fresh(m: int) -> list[PageKey]:
        return [PageKey(next(serial).to_bytes(rng.choice((4, 16)), "big")) for _ in range(m)]

    systems = [fresh(rng.randint(1, 4)) for _ in range(3)]
    convs: list[list[PageKey]] = []
    out: list[list[PageKey]] = []
    for _ in range(n):
        r = rng.random()
        if convs and r < 0.45:                       # the next turn of a conversation
            conv = rng.choice(convs)
            conv.extend(fresh(rng.randint(0, 4)))
            keys = list(conv)
        elif convs and r < 0.6:                      # an edited turn: a branch
            conv = rng.choice(convs)
            cut = rng.randint(0, len(conv))
            keys = conv[:cut] + fresh(rng.randint(0, 3))
            convs.append(list(keys))
        elif convs and r < 0.7:                      # a prefix of an earlier prompt, repeats too
            keys = list(rng.choice(convs)[: rng.randint(0, 8)])
            if keys and rng.random() < 0.3:
                keys.append(rng.choice(keys))
        else:                                        # a new conversation
            keys = list(rng.choice(systems)) + fresh(rng.randint(0, 6))
            convs.append(list(keys))
        if len(convs) > 40:
            convs.pop(rng.randrange(len(convs)))
        out.append(keys)
    return out


def _same_ghost(py: GittinsPolicy, c: GittinsPolicy) -> None:
    native = c._native
    assert native is not None and py._native is None
    assert native.keys() == list(py._ghost)
    for key, (last, count, cls) in py._ghost.items():
        assert native.entry(key) == (last, min(int(count), 15), int(cls), py._next.get(key)), key
    for name in ("_open", "_resolved", "_reuses"):
        a, b = getattr(py._model, name), getattr(c._model, name)
        assert a.tobytes() == b.tobytes(), name


def _drive(seed: int, requests: int, capacity: int, ghost_pages: int) -> int:
    """Run both policies over one stream; the number of decisions compared."""
    rng = random.Random(seed)
    py = GittinsPolicy(ghost_pages=ghost_pages, native=False)
    c = GittinsPolicy(ghost_pages=ghost_pages, native=True)
    resident: set[PageKey] = set()
    compared = 0
    for step, keys in enumerate(_prompts(rng, requests)):
        for pol in (py, c):
            pol.on_request(keys, float(step))
        prev: PageKey | None = None
        for key in keys:
            assert py._class(key) == c._class(key)
            if key in resident:
                py.touch(key)
                c.touch(key)
            else:
                admit = py.admit(key, prev)
                assert c.admit(key, prev) == admit, (step, key)
                compared += 1
                if admit:
                    if len(resident) >= capacity:
                        pinned = {prev} if rng.random() < 0.5 else set()
                        gone = py.victims(rng.randint(1, 2), lambda k: k not in pinned)
                        assert c.victims(len(gone) or 1, lambda k: k not in pinned) == gone, step
                        compared += 1
                        for v in gone:
                            py.remove(v)
                            c.remove(v)
                            resident.discard(v)
                    py.insert(key, prev)
                    c.insert(key, prev)
                    resident.add(key)
            prev = key
        assert len(py) == len(c)
        if step % 25 == 0:
            _same_ghost(py, c)
    _same_ghost(py, c)
    return compared


@pytest.mark.parametrize("seed", range(6))
def test_same_decisions(seed: int) -> None:
    assert _drive(seed, requests=1500, capacity=12 + 8 * seed, ghost_pages=16 << (seed % 3)) > 1000


def test_same_decisions_when_pages_age_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gittins, "MAX_AGE", 40.0)    # both read it when built
    assert _drive(11, requests=800, capacity=20, ghost_pages=1 << 12) > 500


@pytest.mark.parametrize("compiled", [True, False])
def test_record_many_is_the_calls_one_by_one(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not compiled:
        monkeypatch.setattr(hazard, "_record", None)     # the numpy path
    rng = random.Random(3)
    one, many = ReuseModel(4), ReuseModel(4)
    for now in range(1, 400):
        log: list[tuple[int, int, float]] = []
        for _ in range(rng.randint(0, 30)):
            kind = rng.choice((START, REUSE, CENSOR))
            t0 = float(now if kind == START else rng.randint(max(0, now - 300), now))
            log.append((kind, rng.randrange(4), t0))
        for kind, cls, t0 in log:
            if kind == START:
                one.start(cls, t0)
            elif kind == REUSE:
                one.reuse(cls, t0, float(now))
            else:
                one.censor(cls, t0, float(now))
        kinds, classes, times = (np.array(col) for col in zip(*log)) if log else (np.zeros(0),) * 3
        many.record_many(kinds.astype(np.uint8), classes.astype(np.uint8), times.astype(np.float64), float(now))
        if now % 64 == 0:
            one.refresh(float(now))
            many.refresh(float(now))
    for name in ("_open", "_resolved", "_reuses"):
        assert getattr(one, name).tobytes() == getattr(many, name).tobytes(), name
    assert one.index == many.index


def test_keys_must_be_short_bytes() -> None:
    pol = GittinsPolicy(native=True)
    with pytest.raises(InputError):
        pol.on_request([PageKey(b"x" * 17)], 0.0)
    assert pol._class(PageKey(b"x" * 17)) == 0


def test_memory_per_remembered_page() -> None:
    n = 1 << 16
    keys = [PageKey(i.to_bytes(16, "big")) for i in range(n)]
    tracemalloc.start()
    try:
        ghost = gittins._ghost.Ghost(gittins.MAX_AGE)
        for i in range(0, n, 32):
            ghost.on_request(keys[i:i + 32], float(i // 32), n)
        traced = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(ghost) == n
    assert ghost.nbytes() / n < 52                  # its own key table: 40-byte records and the map
    assert traced / n < 52


def test_at_risk_sums_as_add_at_did() -> None:
    """``_at_risk`` sums the open pages per age bin with ``np.bincount`` over the ring's
    buckets holding any; ``np.add.at`` over every bucket, which it replaced, gives the same
    bits (both add in slot order, starting from zero)."""
    rng = random.Random(5)
    model = ReuseModel(3)
    for now in range(1, 3000, 7):
        for _ in range(rng.randint(0, 20)):
            c, t0 = rng.randrange(3), float(rng.randint(max(0, now - 50000), now))
            model.start(c, float(now))
            (model.reuse if rng.random() < 0.5 else model.censor)(c, t0, float(now))
        if now % 5 == 0:   # whole clock values (the ring's bins cached), and between them
            clock = float(now) if now % 2 else now + 0.375
            got = model._at_risk(clock)
            latest = int(clock) // hazard._BUCKET
            slots = np.arange(hazard._RING)
            bucket = latest - ((latest - slots) % hazard._RING)
            ages = np.maximum(clock - (bucket * hazard._BUCKET + hazard._BUCKET / 2), 0.0)
            bins = np.minimum((np.log1p(ages) / hazard._LOG_GROWTH).astype(np.int64), hazard.BINS - 1)
            diff = np.zeros((3, hazard.BINS + 1))
            for c in range(3):
                np.add.at(diff[c], bins + 1, -model._open[c])
                diff[c, 0] += model._open[c].sum()
            want = np.cumsum(model._resolved, axis=1)[:, :hazard.BINS] + np.cumsum(diff, axis=1)[:, :hazard.BINS]
            assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("native", [True, False])
def test_an_empty_request_is_a_request_of_no_pages(native: bool) -> None:
    p = GittinsPolicy(native=native)
    p.on_request([], 0.0)               # before any page was seen: no log allocated yet
    p.on_request([PageKey(b"a" * 16)], 1.0)
    p.on_request([], 2.0)
    p.insert(PageKey(b"a" * 16), None)
    assert len(p) == 1


@pytest.mark.parametrize("requests", [0, 3])
def test_insert_many_is_insert_one_by_one(requests: int) -> None:
    rng = random.Random(requests)
    keys = [PageKey(rng.randbytes(16)) for _ in range(300)]
    parents = [None if i % 7 == 0 else keys[i - 1] for i in range(300)]
    one, many = GittinsPolicy(native=True), GittinsPolicy(native=True)
    for p in (one, many):
        for r in range(requests):                   # some pages remembered, a request clock
            p.on_request(keys[r * 50:(r + 1) * 50], float(r))
    for k, parent in zip(keys, parents):
        one.insert(k, parent)
    many.insert_many(b"".join(keys), b"".join(p or bytes(16) for p in parents),
                     bytes(p is not None for p in parents))
    assert len(one) == len(many) == 300 and one._now == many._now
    assert [one._class(k) for k in keys] == [many._class(k) for k in keys]
    assert one.victims(300, lambda k: True) == many.victims(300, lambda k: True)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("requests", [0, 3])
def test_touch_many_is_touch_one_by_one(native: bool, requests: int) -> None:
    rng = random.Random(10 + requests)
    keys = [PageKey(rng.randbytes(16)) for _ in range(200)]
    one, many = GittinsPolicy(native=native), GittinsPolicy(native=native)
    for p in (one, many):
        for r in range(requests):                   # some pages remembered, a request clock
            p.on_request(keys[r * 40:(r + 1) * 40], float(r))
        for i, k in enumerate(keys):
            p.insert(k, keys[i - 1] if i % 5 else None)
    picked = [keys[i] for i in rng.sample(range(200), 120)] + [PageKey(rng.randbytes(16))]  # one not resident
    for k in picked:
        one.touch(k)
    many.touch_many(b"".join(picked))
    assert one._now == many._now
    assert one.victims(200, lambda k: True) == many.victims(200, lambda k: True)
    with pytest.raises(InputError, match="16-byte keys"):
        many.touch_many(b"x" * 17)


@pytest.mark.parametrize("room", [0, 1000, 150])
def test_admit_many_is_admit_one_by_one(room: int) -> None:
    rng = random.Random(room)
    old = [PageKey(rng.randbytes(16)) for _ in range(100)]
    new = [PageKey(rng.randbytes(16)) for _ in range(80)]
    one, many = GittinsPolicy(native=True), GittinsPolicy(native=True)
    for p in (one, many):
        for r in range(4):
            p.on_request(old[r * 25:(r + 1) * 25], float(r))
        for k in old:
            p.insert(k, None)
        if room:                                    # a tier that asked for victims when this full
            p.victims(0, lambda k: True)
            p._room = room
        p.on_request(old[:10] + new, 5.0)
    pages = [(k, None) for k in new] + [(old[50], None)]    # the last: a demotion, not of the request
    assert many.admit_many(pages) == [one.admit(k, parent) for k, parent in pages]
    assert (one._admitted, one._refused, one._bar) == (many._admitted, many._refused, many._bar)


@pytest.mark.parametrize("by_class", [False, True])
@pytest.mark.parametrize("native", [True, False])
def test_admit_many_weighs_as_admit_does_in_random_states(native: bool, by_class: bool) -> None:
    """Random histories, rooms and batches (pages of the request and demoted ones, some
    refused already): the batch's answers and the policy's state after it are those of
    admit() one page at a time. ``by_class``: a page beats the victim where its class is
    even (these small models put every class on one side of the bar, so this is what
    tells apart which page a class is weighed by)."""
    rng = random.Random(11 + native + 2 * by_class)
    for trial in range(100):
        keys = [PageKey(rng.randbytes(16)) for _ in range(120)]
        one, many = GittinsPolicy(native=native), GittinsPolicy(native=native)
        resident = rng.sample(keys, rng.randint(10, 60))
        request = rng.sample(keys, rng.randint(1, 80))
        batch = rng.sample(keys, rng.randint(1, 40))
        # A history that gives the pages every class: the first keys come back often.
        history = [keys[:30]] + [rng.sample(keys[:rng.randint(30, 120)], 30) for _ in range(rng.randint(0, 24))]
        room = rng.choice((0, len(resident), len(resident) + rng.randint(1, 20)))
        for p in (one, many):
            for r, seen in enumerate(history):
                p.on_request(seen, float(r))
            for k in resident:
                p.insert(k, None)
            if room:
                p.victims(0, lambda k: True)
                p._room = room
            p.on_request(request, 20.0)
        if rng.random() < 0.2:                                # refused earlier in this request
            one._refused = many._refused = True
        if by_class:
            for p in (one, many):
                def even(key: PageKey, p: GittinsPolicy = p) -> bool:
                    return p._class(key) % 2 == 0
                p._beats_victim = even   # type: ignore[method-assign]
        pages = [(k, None) for k in batch]
        state = (many._admitted, many._refused, many._bar)
        keyed = many.admit_keys(batch)   # the keys alone: the same answers and state (no cost model)
        after = (many._admitted, many._refused, many._bar)
        many._admitted, many._refused, many._bar = state
        assert many.admit_many(pages) == [one.admit(k, parent) for k, parent in pages] == keyed, trial
        assert (one._admitted, one._refused, one._bar) == (many._admitted, many._refused, many._bar) == after, trial


def test_classes_of_is_class_of_for_each_key() -> None:
    rng = random.Random(5)
    keys = [PageKey(rng.randbytes(16)) for _ in range(60)]
    p = GittinsPolicy(native=True)
    assert p._native is not None and p._native.classes_of(b"".join(keys)) == bytes(60)
    for r in range(6):
        p.on_request(keys[: 10 * (r + 1)] + keys[:5], float(r))
    blob = b"".join(keys + [PageKey(rng.randbytes(16))])
    assert list(p._native.classes_of(blob)) == [p._native.class_of(k) for k in split_keys(blob)]
    assert len(set(p._native.classes_of(blob))) > 1
    with pytest.raises(InputError, match="16-byte keys"):
        p._native.classes_of(b"x" * 15)


@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_victims_loop_excludes_the_request_as_the_python_loop_does(seed: int) -> None:
    """The compiled loop is handed the request's pages (``exclude``) and the manager's
    predicate as they are, where the Python loop wraps both in one callable: on the same
    compiled heaps, the same victims, in order, and the predicate never asked about a
    request page."""
    rng = random.Random(seed)
    keys = [PageKey(rng.randbytes(16)) for _ in range(300)]
    compiled, looped = GittinsPolicy(native=True), GittinsPolicy(native=True)
    looped._native_victims = False
    asked: list[PageKey] = []
    pinned = set(rng.sample(keys, 20))
    history = [rng.sample(keys, 40) for _ in range(12)]
    last = rng.sample(keys, 60)
    for p in (compiled, looped):
        for r, seen in enumerate(history):
            p.on_request(seen, float(r))
        for k in keys:
            p.insert(k, None)
        p.on_request(last, 20.0)
    request = set(compiled._request)

    def evictable(k: PageKey) -> bool:
        asked.append(k)
        return k not in pinned

    got = compiled.victims(120, evictable)
    assert not request & set(asked) and not request & set(got) and not pinned & set(got)
    assert got == looped.victims(120, lambda k: k not in pinned) and len(got) == 120


def test_the_compiled_victims_loop_takes_a_dict_or_a_set_to_exclude() -> None:
    p = GittinsPolicy(native=True)
    keys = [PageKey(bytes([i]) * 16) for i in range(8)]
    for k in keys:
        p.insert(k, None)
    index, support = p._model.tables()
    args = (3, lambda k: True, index, support, 1.0, gittins.CONFIDENCE_Z, gittins._USE_RANK_BYTES, False,
            hazard._LOG_GROWTH, hazard.BINS)
    leaves = p._leaves
    choose = getattr(leaves, "choose_victims", None)   # the compiled heaps' (not PyLeafHeaps')
    assert choose is not None
    for exclude in ({keys[0]: 0}, {keys[0]}, frozenset({keys[0]})):
        leaves.undo()
        assert keys[0] not in choose(*args, exclude)
    leaves.undo()
    with pytest.raises(TypeError, match="exclude must be a dict or a set, not list"):
        choose(*args, [keys[0]])
