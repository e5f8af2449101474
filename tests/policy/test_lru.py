"""LRU and prefix-aware (leaf-first) LRU: exact victims."""

from __future__ import annotations

from tierkv.policy.lru import LeafLRUPolicy, LRUPolicy
from tests.policy.helpers import everything, k, next_request, store


def test_lru_evicts_least_recently_used_first() -> None:
    p = LRUPolicy()
    store(p, ["a"])
    store(p, ["b"])
    store(p, ["c"])
    p.touch(k("a"))
    assert p.victims(2, everything) == [k("b"), k("c")]
    assert p.victims(2, lambda key: key != k("b")) == [k("c"), k("a")]


def test_lru_may_evict_a_parent_before_its_child() -> None:
    p = LRUPolicy()
    store(p, ["a", "b", "c"])
    assert p.victims(1, everything) == [k("a")]


def test_leaf_lru_evicts_descendants_first() -> None:
    p = LeafLRUPolicy()
    store(p, ["a", "b", "c"])
    store(p, ["d", "e"])
    next_request(p)
    assert p.victims(3, everything) == [k("c"), k("b"), k("a")]
    p.touch(k("a"))                     # a has a child: it waits, but it is now the youngest
    assert p.victims(3, everything) == [k("c"), k("b"), k("e")]
    assert p.victims(3, lambda key: key != k("e")) == [k("c"), k("b"), k("a")]


def test_leaf_lru_victims_not_removed_stay_resident() -> None:
    p = LeafLRUPolicy()
    store(p, ["a", "b"])
    store(p, ["c"])
    next_request(p)
    assert p.victims(2, everything) == [k("b"), k("a")]
    assert p.victims(1, everything) == [k("b")]      # the first answer was never acted on
    p.remove(k("b"))
    assert p.victims(2, everything) == [k("a"), k("c")]
    assert len(p) == 2


def test_leaf_lru_touch_of_a_leaf_makes_it_youngest() -> None:
    p = LeafLRUPolicy()
    store(p, ["a"])
    store(p, ["b"])
    p.touch(k("a"))
    next_request(p)
    assert p.victims(1, everything) == [k("b")]


def test_leaf_lru_spares_the_pages_of_the_request_being_served() -> None:
    p = LeafLRUPolicy()
    store(p, ["a"])
    p.on_request([k("a"), k("b")], 0.0)    # a is read, b is about to be stored under it
    p.touch(k("a"))
    assert p.victims(1, everything) == []
