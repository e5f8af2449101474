"""OPT over two tiers (issue 28 item 10): a page demoted into the tier below keeps its next use.

Each tier runs its own :class:`~tierkv.policy.belady.BeladyPolicy`; a demoted page reaches
the lower tier's policy while no request names it. It used to be ranked there as never
needed again (so evicted first) and admitted whatever its next use, which put two-tier
OPT at 1%+10% of the trace (0.3272) below single-tier OPT at 5% (0.3660).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tierkv.keys import PageKey
from tierkv.policy.belady import BeladyPolicy, Future
from tierkv.sim.run import Workload, parse_capacities, simulate
from tierkv.workload import read_mooncake

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"


def _key(c: str) -> PageKey:
    return PageKey(c.encode() * 16)


def _workload(spec: str) -> Workload:
    """``"a bc"``: a request for page a, then one for b and its child c."""
    reqs = [tuple(_key(c) for c in r) for r in spec.split()]
    return Workload(reqs, [len(r) for r in reqs], [0.0] * len(reqs), 1)


def test_a_demoted_page_is_ranked_by_its_next_use_below() -> None:
    """a (needed at position 5) is demoted to the one-slot NVMe tier by b; c (needed at 7)
    must not take its place there. Ranked as never needed, a was evicted for c: 3 hits."""
    w = _workload("a bc bc a bcde afg")
    assert simulate(w, "opt", [1, 1], promote=False).blocks_hit == 4
    assert simulate(w, "opt", [2]).blocks_hit == 4


@pytest.mark.parametrize("promote", [True, False])
def test_a_page_never_needed_again_is_not_demoted(promote: bool) -> None:
    """a is not needed after the second request; demoted anyway, it filled the NVMe slot
    that c needed: 2 hits instead of 3."""
    w = _workload("a a bc bc")
    assert simulate(w, "opt", [1, 1], promote=promote).blocks_hit == 3
    assert simulate(w, "opt", [2]).blocks_hit == 3


def test_a_page_inserted_outside_its_requests_keeps_its_next_use() -> None:
    reqs = [[_key("a")], [_key("b")], [_key("c")], [_key("a")], [_key("b")]]
    p = BeladyPolicy(Future(reqs))
    for r in reqs[:3]:
        p.on_request(r, 0.0)
    p.insert(_key("a"), None)     # as a demotion: no request names a now
    p.insert(_key("b"), None)
    p.insert(_key("c"), None)
    assert p.victims(3, lambda _: True) == [_key("c"), _key("b"), _key("a")]


def test_of_pages_never_needed_again_the_deepest_go_first() -> None:
    """A chain leaves leaf first, so the manager never has to keep a parent for its child."""
    reqs = [[_key("a"), _key("b"), _key("c")], [_key("d")]]
    p = BeladyPolicy(Future(reqs))
    p.on_request(reqs[0], 0.0)
    for parent, key in ((None, "a"), ("a", "b"), ("b", "c")):
        p.insert(_key(key), None if parent is None else _key(parent))
    assert p.victims(3, lambda _: True) == [_key("c"), _key("b"), _key("a")]


def test_a_parent_of_a_resident_page_is_admitted() -> None:
    """Never needed again, but its child here is reachable only through it."""
    reqs = [[_key("a"), _key("b")], [_key("d")]]
    p = BeladyPolicy(Future(reqs), capacity=4)
    p.on_request(reqs[0], 0.0)
    p.insert(_key("b"), _key("a"))
    p.on_request(reqs[1], 0.0)
    assert p.admit(_key("a"), None)
    p.remove(_key("b"))
    assert not p.admit(_key("a"), None)


@pytest.mark.skipif(not TRACE.exists(), reason="the Mooncake trace is not in ../shared")
def test_two_tiers_reach_the_saturated_single_tier_on_the_trace() -> None:
    """1% DRAM over 10% NVMe holds more than the 5% at which single-tier OPT saturates."""
    w = Workload.from_requests(list(read_mooncake(TRACE)))
    c1, c5, c10 = parse_capacities("1%,5%,10%", w.distinct_blocks)
    single = simulate(w, "opt", [c5]).blocks_hit
    assert single == 105_592
    assert simulate(w, "opt", [c1, c10]).blocks_hit == single
