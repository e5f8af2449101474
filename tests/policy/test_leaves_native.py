"""The compiled leaf heaps against the Python ones: same answers, every step; page keys; memory.

Skipped where the extension ``tierkv.policy._leaves`` is not built.
"""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from tierkv.errors import InputError
from tierkv.keys import PageKey
from tierkv.policy import leaves
from tierkv.policy.gittins import GittinsPolicy
from tierkv.policy.leaves import NativeLeafHeaps, PyLeafHeaps
from tierkv.policy.lru import LeafLRUPolicy
from tests.policy.helpers import everything, k

pytestmark = pytest.mark.skipif(NativeLeafHeaps is None, reason="tierkv.policy._leaves is not built")

CLASSES = 3


class Twin:
    """Both implementations, driven with the same calls; every answer must be the same."""

    def __init__(self, classes: int, young: bool) -> None:
        self.py = PyLeafHeaps(classes, young)
        self.c = NativeLeafHeaps(classes, young)
        self.calls = 0

    def same(self, name: str, *args: Any) -> Any:
        self.calls += 1
        got = []
        for impl in (self.py, self.c):
            try:
                got.append(("ok", getattr(impl, name)(*args)))
            except KeyError as e:
                got.append(("KeyError", e.args))
            except InputError:
                got.append(("InputError", ()))
        assert got[0] == got[1], f"{name}{args}: python {got[0]!r}, native {got[1]!r}"
        assert len(self.py) == len(self.c)
        return got[0][1]

    def state(self, keys: list[PageKey]) -> None:
        for key in keys:
            assert (key in self.py) == (key in self.c)
            if key in self.py:
                for name in ("last_of", "class_of", "parent_of"):
                    self.same(name, key)


def _forest(rng: random.Random, n: int) -> tuple[list[PageKey], dict[PageKey, PageKey | None]]:
    """Keys of 1 to 16 bytes (zero bytes and shared prefixes included; a third of them 16,
    the store's), each with a parent."""
    keys: list[PageKey] = []
    seen: set[bytes] = set()
    while len(keys) < n:
        size = 16 if rng.random() < 0.3 else rng.randint(1, 16)
        key = bytes(rng.choice((0, 1, 2, rng.randrange(256))) for _ in range(size))
        if key not in seen:
            seen.add(key)
            keys.append(PageKey(key))
    # A parent among the earlier keys (resident or not when the child arrives), or none.
    parent = {key: (keys[rng.randrange(i)] if i and rng.random() < 0.8 else None) for i, key in enumerate(keys)}
    return keys, parent


def _predicate(rng: random.Random, keys: list[PageKey]) -> Callable[[PageKey], bool]:
    blocked = frozenset(rng.sample(keys, rng.randint(0, len(keys) // 3)))
    return lambda key: key not in blocked


def _victims(tw: Twin, rng: random.Random, keys: list[PageKey], settle: bool) -> list[PageKey]:
    """One victims call as the policies make it, with random choices among the candidates."""
    tw.same("undo")
    evictable = _predicate(rng, keys)
    out: list[PageKey] = []
    for _ in range(rng.randint(1, 6)):
        if rng.random() < 0.1:        # a predicate that changes mid-call: cached heads must agree too
            evictable = _predicate(rng, keys)
        cands = tw.same("candidates", evictable)
        if not cands:
            break
        key = cands[rng.randrange(len(cands))][0]
        tw.same("take", key)
        out.append(key)
        if rng.random() < 0.1:        # any key: absent (KeyError), with children (InputError) or a leaf
            other = rng.choice(keys)
            if tw.same("take", other) is None and other not in out:
                out.append(other)
    if settle:
        tw.same("settle")
    return out


def _drive(seed: int, steps: int, young: bool) -> int:
    rng = random.Random(seed)
    keys, parent = _forest(rng, rng.choice((12, 40, 150)))
    long = [key for key in keys if len(key) == 16]   # what add_many takes
    tw = Twin(CLASSES, young)
    clock = 0.0
    pending: list[PageKey] = []
    for step in range(steps):
        clock += rng.choice((0.0, 0.0, 1.0, 2.5))        # ties in last access: order falls to seq
        key = rng.choice(keys)
        op = rng.random()
        if op < 0.35:
            # Now and then another parent (a page re-added elsewhere), a cycle or itself (refused).
            up = parent[key] if rng.random() < 0.9 else rng.choice(keys)
            tw.same("add", key, up, rng.randrange(CLASSES), clock)
        elif op < 0.45:
            tw.same("touch", key, rng.randrange(CLASSES), clock)
        elif op < 0.5:                                   # a get's hits: 16-byte keys, absent ones skipped
            batch = [k.rjust(16, b"\x07") if rng.random() < 0.2 else k for k in rng.sample(keys, 4) if len(k) == 16]
            batch += [k for k in keys if len(k) == 16][:rng.randint(0, 3)]
            tw.same("touch_many", b"".join(batch), bytes(rng.randrange(CLASSES) for _ in batch), clock,
                    rng.choice((0.0, 1.0)))
        elif op < 0.54:                                  # a put's pages: a chain of 16-byte keys, some resident
            chain = rng.sample(long, rng.randint(1, min(6, len(long)))) if long else []
            first = rng.choice(keys) if rng.random() < 0.5 else None
            ups = [first, *chain[:-1]]
            if rng.random() < 0.2 and len(chain) > 2:    # now and then not a chain at all
                ups[rng.randrange(1, len(chain))] = rng.choice(keys)
            tw.same("add_many", b"".join(chain), b"".join(u if u is not None and len(u) == 16 else bytes(16)
                                                          for u in ups),
                    bytes(u is not None and len(u) == 16 for u in ups), bytes(rng.randrange(CLASSES) for _ in chain),
                    clock, rng.choice((0.0, 1.0)))
        elif op < 0.62:
            tw.same("discard", key)
        elif op < 0.8:
            pending = _victims(tw, rng, keys, settle=rng.random() < 0.95)
            rng.shuffle(pending)
        elif op < 0.9 and pending:                       # the manager removes some victims
            if rng.random() < 0.5:
                tw.same("discard", pending.pop())
            else:                                        # a run of them, with other 16-byte keys between
                run = [pending.pop() for _ in range(min(len(pending), rng.randint(1, 4)))]
                run += [key for key in rng.sample(long, min(2, len(long))) if rng.random() < 0.5]
                rng.shuffle(run)
                tw.same("discard_many", b"".join(key.rjust(16, b"\x07") for key in run))
        elif op < 0.95:
            tw.same("undo")
        else:
            tw.same("candidates", everything)
            tw.same("settle")
        if step % 50 == 0:
            tw.state(keys)
    tw.state(keys)
    return tw.calls


@pytest.mark.parametrize("young", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_native_and_python_answer_the_same_to_random_operations(seed: int, young: bool) -> None:
    calls = _drive(seed, 2500, young)
    assert calls > 2500


def test_policies_choose_the_same_victims_with_either_heaps(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    runs = []
    for impl in (PyLeafHeaps, NativeLeafHeaps):
        monkeypatch.setattr("tierkv.policy.gittins.LeafHeaps", impl)
        monkeypatch.setattr("tierkv.policy.lru.LeafHeaps", impl)
        rng.seed(7)
        out: list[list[PageKey]] = []
        for policy in (GittinsPolicy(), LeafLRUPolicy()):
            for r in range(400):
                base = rng.randrange(30)
                req = [PageKey(b"%d/%d" % (base, i)) for i in range(rng.randint(1, 8))]
                policy.on_request(req, float(r))
                for i, key in enumerate(req):
                    if len(policy) >= 60:
                        victims = policy.victims(1 + rng.randrange(3), everything)
                        out.append(victims)
                        for v in victims[:-1]:      # the last one stays: undone next call
                            policy.remove(v)
                    if policy.admit(key, req[i - 1] if i else None):
                        policy.insert(key, req[i - 1] if i else None)
                    else:
                        break
        runs.append(out)
    assert runs[0] == runs[1] and sum(map(len, runs[0])) > 100


@pytest.mark.parametrize("bad", [b"", b"x" * 17, "text", 7])
def test_page_keys_must_be_bytes_of_1_to_16_bytes(bad: Any) -> None:
    h = NativeLeafHeaps(1)
    with pytest.raises(InputError, match="1 to 16 bytes"):
        h.add(bad, None, 0, 1.0)
    with pytest.raises(InputError, match="parent key must be"):
        h.add(k("a"), bad, 0, 1.0)
    assert len(h) == 0 and bad not in h
    h.touch(bad, 0, 2.0)          # a key that cannot be stored is simply not resident
    h.discard(bad)
    with pytest.raises(KeyError):
        h.take(bad)


@pytest.mark.parametrize("impl", [PyLeafHeaps, NativeLeafHeaps])
def test_discard_many_takes_whole_keys_only(impl: type[PyLeafHeaps]) -> None:
    h = impl(1)
    h.add(PageKey(bytes([1]) * 16), None, 0, 1.0)
    with pytest.raises(InputError, match="17 bytes are not 16-byte keys"):
        h.discard_many(bytes(17))
    assert len(h) == 1
    h.discard_many(bytes([2]) * 16 + bytes([1]) * 16)
    assert len(h) == 0


@pytest.mark.parametrize("impl", [PyLeafHeaps, NativeLeafHeaps])
def test_add_many_refuses_a_bad_batch_before_adding_any(impl: type[PyLeafHeaps]) -> None:
    h = impl(2)
    keys = b"".join(bytes([i]) * 16 for i in range(1, 4))
    chain = bytes(16) + keys[:32]
    for classes, parents in ((b"\0\0\2", chain), (b"\0\0\0", chain[:16] + keys[16:32] + keys[32:])):
        with pytest.raises(InputError, match="add_many"):   # class 2 of 2; page 2 its own parent
            h.add_many(keys, parents, b"\0\1\1", classes, 1.0, 1.0)
        assert len(h) == 0


@pytest.mark.parametrize("impl", [PyLeafHeaps, NativeLeafHeaps])
def test_a_page_cannot_be_its_own_parent(impl: type[PyLeafHeaps]) -> None:
    h = impl(1)
    with pytest.raises(InputError, match="its own parent"):
        h.add(k("a"), k("a"), 0, 1.0)
    assert len(h) == 0


@pytest.mark.parametrize("impl", [PyLeafHeaps, NativeLeafHeaps])
def test_touch_many_refuses_a_batch_that_does_not_add_up(impl: type[PyLeafHeaps]) -> None:
    h = impl(CLASSES)
    with pytest.raises(InputError, match="touch_many"):
        h.touch_many(b"k" * 17, b"\0", 0.0, 1.0)
    with pytest.raises(InputError, match="touch_many"):
        h.touch_many(b"k" * 32, b"\0", 0.0, 1.0)


def test_classes_out_of_range_name_the_range() -> None:
    h = NativeLeafHeaps(7)
    with pytest.raises(InputError, match="0 to 6"):
        h.add(k("a"), None, 7, 1.0)


def test_the_policies_build_the_native_heaps_unless_told_otherwise() -> None:
    assert leaves.native_available() == (leaves.LeafHeaps is NativeLeafHeaps)
    assert isinstance(GittinsPolicy()._leaves, leaves.LeafHeaps)


@pytest.mark.parametrize(("chain", "limit"), [(8, 64), (1, 96)], ids=["chains-of-8", "all-leaves"])
def test_memory_per_resident_page(chain: int, limit: int) -> None:
    """A page of a prefix chain costs a 48-byte record in its key table (key and node) and
    its share of the map; a leaf adds its 20-byte Rec and heap entries (86 and 95 bytes
    a page before nodes lost the leaf-only fields and the table held the keys)."""
    n = 200_000
    keys = [PageKey(i.to_bytes(16, "big")) for i in range(n)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        h = NativeLeafHeaps(7)
        for i, key in enumerate(keys):           # chains: a forest, one leaf per chain
            h.add(key, keys[i - 1] if i % chain else None, i % 7, float(i))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(h) == n
    assert used / n < limit, f"{used / n:.1f} bytes per page"
    assert h.nbytes() <= used


@pytest.mark.parametrize("impl", [PyLeafHeaps, NativeLeafHeaps], ids=["python", "native"])
def test_only_a_leaf_can_be_taken(impl: Any) -> None:
    """A page with resident children is refused as a victim (a prefix would be left with a
    hole), in the middle of a victims call too; taking its children first makes it a leaf,
    and an undo puts the chain back as it was."""
    heaps = impl(1, True)
    heaps.add(k(0), None, 0, 1.0)
    heaps.add(k(1), k(0), 0, 2.0)
    heaps.add(k(2), k(1), 0, 3.0)
    heaps.undo()
    for key in (k(0), k(1)):
        with pytest.raises(InputError, match="resident children"):
            heaps.take(key)
    heaps.take(k(2))
    with pytest.raises(InputError, match="resident children"):
        heaps.take(k(0))
    heaps.take(k(1))
    heaps.take(k(0))
    with pytest.raises(KeyError):
        heaps.take(k(3))
    heaps.undo()
    assert len(heaps) == 3 and [heaps.parent_of(key) for key in (k(1), k(2))] == [k(0), k(1)]
    assert [c[0] for c in heaps.candidates(everything)] == [k(2), k(2)]
    for key in (k(0), k(1)):
        with pytest.raises(InputError, match="resident children"):
            heaps.take(key)
    heaps.settle()


@pytest.mark.parametrize("impl", [PyLeafHeaps, NativeLeafHeaps], ids=["python", "native"])
def test_a_victims_call_asks_evictable_once_a_leaf(impl: Any) -> None:
    """Taking a class's oldest leaf re-reads its heads; the youngest, allowed a moment ago,
    is not asked again before settle (evictable cannot change within a victims call), and
    after settle it is."""
    heaps = impl(1, True)
    for i in range(40):
        heaps.add(k(i), None, 0, float(i))
    asked: list[PageKey] = []

    def evictable(key: PageKey) -> bool:
        asked.append(key)
        return True
    heaps.undo()
    for _ in range(10):
        old = next(c for c in heaps.candidates(evictable) if not c[3])
        heaps.take(old[0])
    assert len(asked) == len(set(asked)) == 11   # the 10 taken and the youngest, each once
    heaps.settle()
    heaps.undo()
    heaps.candidates(evictable)
    assert len(asked) == 13
    heaps.undo()                                 # an undo alone starts a new call too:
    old = next(c for c in heaps.candidates(evictable) if not c[3])   # (the heads are cached)
    heaps.take(old[0])
    heaps.candidates(evictable)                  # the new oldest, and the youngest again
    assert len(asked) == 15


def test_a_discard_between_calls_forgets_what_evictable_allowed() -> None:
    """A call left unsettled, then a discard (which undoes it): the next call asks again,
    in both implementations, and so never offers a leaf its own predicate refuses."""
    answers = []
    for impl in (PyLeafHeaps, NativeLeafHeaps):
        heaps = impl(1, False)
        for i in range(4):
            heaps.add(k(i), None, 0, float(i))
        heaps.undo()
        heaps.candidates(everything)            # k(0) allowed, never settled
        heaps.discard(k(3))
        answers.append([c[0] for c in heaps.candidates(lambda key: key != k(0))])
        heaps.settle()
    assert answers[0] == answers[1] == [k(1)]
