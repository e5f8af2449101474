"""Belady's OPT: the farthest next use goes first; never-used pages are not admitted."""

from __future__ import annotations

import pytest

from tierkv.errors import InputError
from tierkv.policy.belady import NEVER, BeladyPolicy, Future
from tests.policy.helpers import everything, k


def test_future_positions_count_pages_in_order() -> None:
    reqs = [[k("a"), k("b")], [k("c")], [k("a"), k("b")]]
    f = Future(reqs)
    assert f.next_uses(0, reqs[0]) == (3.0, 4.0)
    assert f.next_uses(1, reqs[1]) == (NEVER,)
    with pytest.raises(InputError):
        f.next_uses(1, reqs[0])


def test_evicts_farthest_next_use_first() -> None:
    reqs = [[k("a")], [k("b")], [k("c")], [k("b")], [k("a")], [k("c")]]
    p = BeladyPolicy(Future(reqs))
    for r in reqs[:3]:
        p.on_request(r, 0.0)
        p.insert(r[0], None)
    assert p.victims(3, everything) == [k("c"), k("a"), k("b")]
    assert p.victims(1, lambda key: key != k("c")) == [k("a")]


def test_bypasses_pages_never_needed_or_needed_last() -> None:
    reqs = [[k("a")], [k("b")], [k("c")], [k("a")], [k("b")]]
    p = BeladyPolicy(Future(reqs), capacity=2)
    for r in reqs[:2]:
        p.on_request(r, 0.0)
        assert p.admit(r[0], None)
        p.insert(r[0], None)
    p.on_request(reqs[2], 0.0)
    assert not p.admit(k("c"), None)       # never needed again
    p.on_request(reqs[3], 0.0)             # a: needed never again after this; b next
    assert p.victims(1, everything) == [k("a")]
