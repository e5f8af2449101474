"""The leaf heaps: only leaves are candidates, victims are pending until removed."""

from __future__ import annotations

import pytest

from tierkv.policy.leaves import LeafHeaps, PyLeafHeaps
from tests.policy.helpers import everything, k


def _keys(cands: list[tuple[bytes, int, float, bool]]) -> set[bytes]:
    return {c[0] for c in cands}


def test_only_leaves_are_candidates_and_parents_follow_children() -> None:
    h = LeafHeaps(2)
    h.add(k("a"), None, 0, 1.0)
    h.add(k("b"), k("a"), 1, 2.0)
    assert _keys(h.candidates(everything)) == {k("b")}
    h.take(k("b"))
    assert _keys(h.candidates(everything)) == {k("a")}
    h.settle()
    h.discard(k("b"))
    assert len(h) == 1 and k("b") not in h


def test_pending_victims_come_back_if_not_removed() -> None:
    h = LeafHeaps(1)
    h.add(k("a"), None, 0, 1.0)
    h.add(k("b"), k("a"), 0, 2.0)
    h.take(k("b"))
    h.take(k("a"))
    h.settle()
    h.undo()
    assert _keys(h.candidates(everything)) == {k("b")}


def test_a_child_resident_before_its_parent_keeps_the_parent_off_the_leaves() -> None:
    h = LeafHeaps(1)
    h.add(k("b"), k("a"), 0, 1.0)          # the parent left earlier, or lives in another tier
    h.add(k("a"), None, 0, 2.0)
    assert _keys(h.candidates(everything)) == {k("b")}
    h.discard(k("b"))
    assert _keys(h.candidates(everything)) == {k("a")}


def test_ends_of_each_class_and_unevictable_heads_are_skipped() -> None:
    h = LeafHeaps(1)
    for i, t in enumerate((1.0, 2.0, 3.0)):
        h.add(k(i), None, 0, t)
    cands = h.candidates(lambda key: key != k(0))
    assert [(c[0], c[3]) for c in cands] == [(k(1), False), (k(2), True)]
    h.settle()
    assert [c[0] for c in h.candidates(everything)] == [k(0), k(2)]


@pytest.mark.parametrize("young", [True, False])   # gittins, and lru-leaf (oldest end only)
def test_touching_many_times_does_not_grow_the_heaps_without_bound(young: bool) -> None:
    h = PyLeafHeaps(1, young=young)    # the Python heaps' compaction (the native heaps keep no stale entries)
    h.add(k("a"), None, 0, 0.0)
    for t in range(1, 5000):
        h.touch(k("a"), 0, float(t))   # a tier that never fills: no victims call pops the stale entries
    assert len(h._new[0]) < 200 and len(h._old[0]) < 200
