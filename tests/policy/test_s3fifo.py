"""S3-FIFO: probation in the small queue, ghost re-admission to main, CLOCK in main."""

from __future__ import annotations

from tierkv.keys import PageKey
from tierkv.policy.s3fifo import S3FIFOPolicy
from tests.policy.helpers import everything, k, store


def _fill(p: S3FIFOPolicy, names: list[str]) -> None:
    for n in names:
        store(p, [n])


def test_read_pages_move_to_main_unread_ones_leave() -> None:
    p = S3FIFOPolicy()
    _fill(p, list("abcdefghij"))
    p.touch(k("a"))
    assert p.victims(1, everything) == [k("b")]      # a moved to main, b had never been read
    p.remove(k("b"))
    assert p.victims(2, everything) == [k("c"), k("d")]


def test_ghost_hit_is_admitted_to_main_and_main_is_a_clock() -> None:
    p = S3FIFOPolicy()
    _fill(p, list("abcde"))
    first = p.victims(5, everything)
    assert first == [k(c) for c in "abcde"]
    for key in first:
        p.remove(key)
    _fill(p, list("abcde"))                           # all remembered by the ghost: straight to main
    p.touch(k("b"))
    p.touch(k("b"))
    assert p.victims(2, everything) == [k("a"), k("c")]   # b gets a second chance


def test_unevictable_pages_are_skipped() -> None:
    p = S3FIFOPolicy()
    _fill(p, list("abc"))
    assert p.victims(2, lambda key: key != k("a")) == [k("b"), k("c")]


def test_victims_not_removed_are_offered_again() -> None:
    p = S3FIFOPolicy()
    _fill(p, list("abc"))
    assert p.victims(1, everything) == [k("a")]
    assert len(p.victims(1, everything)) == 1
    assert len(p) == 3


def test_pinned_pages_are_walked_past_once_not_per_victim() -> None:
    p = S3FIFOPolicy()
    for i in range(3000):
        p.insert(k(i), None)
    pinned = {k(i) for i in range(2000)}       # the oldest pages, at the head of the queues
    looked: list[PageKey] = []

    def evictable(key: PageKey) -> bool:
        looked.append(key)
        return key not in pinned

    for _ in range(2):
        looked.clear()
        out = p.victims(64, evictable)
        assert len(out) == 64 and not pinned & set(out)
        for key in out:
            p.remove(key)
    assert len(looked) < 500                    # the second call no longer walks the 2,000 pinned pages
