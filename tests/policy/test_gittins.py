"""The default policy: leaf-first LRU until it has learned, then the lowest hit density, guarded."""

from __future__ import annotations

from collections import defaultdict

import pytest

from tierkv.keys import PageKey
from tierkv.policy import DEFAULT_POLICY, make_policy
from tierkv.policy.gittins import ABANDONED, GittinsPolicy
from tierkv.policy.hazard import age_bin
from tierkv.sim.mirror import SimManager
from tierkv.sim.run import Workload, simulate
from tierkv.workload import parse_mix, synthetic
from tests.policy.helpers import everything, k, next_request, store


def test_is_the_default() -> None:
    assert DEFAULT_POLICY == "gittins"
    assert isinstance(make_policy(DEFAULT_POLICY), GittinsPolicy)


def test_without_request_hints_it_is_leaf_first_lru() -> None:
    p = GittinsPolicy()
    for key, parent in ((k("a"), None), (k("b"), k("a")), (k("c"), k("b")), (k("d"), None), (k("e"), k("d"))):
        p.insert(key, parent)
    assert p.victims(3, everything) == [k("c"), k("b"), k("a")]
    assert p.victims(3, lambda key: key != k("a")) == [k("c"), k("b"), k("e")]


def _train(p: GittinsPolicy, second_access_returns: bool, n: int = 3000) -> None:
    """One-page requests: each step a fresh page that never comes back; every 4th step a
    page that comes back 6 steps later and, if ``second_access_returns``, 6 steps after that."""
    due: dict[int, list[tuple[PageKey, int]]] = defaultdict(list)
    for i in range(n):
        p.on_request([k(f"x{i}")], 0.0)
        if i % 4 == 0:
            p.on_request([k(f"z{i}")], 0.0)
            due[i + 6].append((k(f"z{i}"), 1))
        for z, nth in due.pop(i, []):
            p.on_request([z], 0.0)
            if nth == 1 and second_access_returns:
                due[i + 6].append((z, 2))


def _state(p: GittinsPolicy) -> None:
    """A (seen twice, so class 1) is older than B (fresh, class 0); then an unrelated request."""
    store(p, ["A"])
    p.on_request([k("A")], 0.0)
    p.touch(k("A"))
    store(p, ["B"])
    p.on_request([k("C")], 0.0)


def test_learned_index_evicts_a_younger_page_that_will_not_come_back() -> None:
    p = GittinsPolicy()
    _train(p, second_access_returns=True)
    _state(p)
    assert p.victims(1, everything) == [k("B")]        # LRU would take A, which comes back soon


def test_a_page_both_younger_and_more_used_than_lrus_victim_stays() -> None:
    p = GittinsPolicy()
    _train(p, second_access_returns=False)
    store(p, ["B"])                                     # fresh: class 0, comes back soon
    store(p, ["A"])
    p.on_request([k("A")], 0.0)
    p.touch(k("A"))                                     # class 1, never comes back, but younger
    p.on_request([k("C")], 0.0)
    m = p._model
    assert m.index[1][age_bin(1)] < m.index[0][age_bin(2)]     # the index alone would take A
    assert p.victims(1, everything) == [k("B")]


def test_pages_of_the_current_request_are_not_victims() -> None:
    p = GittinsPolicy()
    names = store(p, ["a", "b"])
    assert p.victims(2, everything) == []
    p.on_request([k("z")], 0.0)
    assert p.victims(2, everything) == names[::-1]


def test_ghost_is_bounded() -> None:
    p = GittinsPolicy(ghost_pages=100)
    for i in range(1000):
        p.on_request([k(i)], 0.0)
    assert len(p._ghost) <= 100


def test_beats_lru_on_the_synthetic_mix_when_the_cache_is_small() -> None:
    w = Workload.from_requests(synthetic(0, 4000))
    cap = [max(1, w.distinct_blocks // 100)]
    assert simulate(w, "gittins", cap).blocks_hit > simulate(w, "lru", cap).blocks_hit


@pytest.mark.parametrize("mix", [
    "conversation_share=0,rag_share=1,agent_share=0",       # shared documents, one request each
    "conversation_share=0,rag_share=0,agent_share=1",       # long growing agent contexts
    "think_time_s_mean=300",                                # turns that come back late
])
def test_beats_lru_on_other_mixes_when_the_cache_is_small(mix: str) -> None:
    w = Workload.from_requests(synthetic(0, 3000, parse_mix(mix)))
    cap = [max(1, w.distinct_blocks // 100)]
    assert simulate(w, "gittins", cap).blocks_hit > 1.2 * simulate(w, "lru", cap).blocks_hit


def test_runs_under_the_sim_manager_with_two_tiers() -> None:
    w = Workload.from_requests(synthetic(1, 1500))
    m = SimManager([40, 200], GittinsPolicy)
    for keys, t in zip(w.keys, w.arrivals):
        m.request(keys, t)
    assert m.used[0] <= 40 and m.used[1] <= 200


def _train_edits(p: GittinsPolicy, n: int = 3000) -> None:
    """Fresh one-page prompts that come back 6 steps later; every 4th step a prompt [a, b] is
    edited into [a, c], abandoning b, which never comes back."""
    due: dict[int, list[PageKey]] = defaultdict(list)
    for i in range(n):
        p.on_request([k(f"f{i}")], 0.0)
        due[i + 6].append(k(f"f{i}"))
        if i % 4 == 0:
            p.on_request([k(f"a{i}"), k(f"b{i}")], 0.0)
            p.on_request([k(f"a{i}"), k(f"c{i}")], 0.0)
        for page in due.pop(i, []):
            p.on_request([page], 0.0)


def test_an_abandoned_branch_leaves_before_an_older_page() -> None:
    p = GittinsPolicy()
    _train_edits(p)
    store(p, ["Y"])                                     # fresh: class 0, comes back
    store(p, ["P", "R"])
    p.on_request([k("P"), k("S")], 0.0)                 # the prompt was edited after P: R is abandoned
    p.touch(k("P"))
    p.insert(k("S"), k("P"))
    assert p._class(k("R")) == ABANDONED
    next_request(p)
    assert p.victims(1, everything) == [k("R")]         # LRU would take Y, the oldest leaf
    # S, a new page of an edited prompt, has not been seen to come back either; Y has.
    assert p.victims(3, everything) == [k("R"), k("S"), k("Y")]


def test_a_continued_prompt_is_not_abandoned() -> None:
    p = GittinsPolicy()
    _train_edits(p)
    store(p, ["P", "R"])
    p.on_request([k("P"), k("R"), k("S")], 0.0)         # the next turn extends the whole prompt
    assert p._class(k("R")) != ABANDONED and p._class(k("P")) != ABANDONED


def test_a_new_page_that_would_be_the_next_victim_is_not_admitted() -> None:
    p = GittinsPolicy()
    _train(p, second_access_returns=True)               # fresh pages never come back
    assert p.admit(k("early"), None)                    # never full yet: everything is admitted
    store(p, ["A"])
    p.on_request([k("A")], 0.0)
    p.touch(k("A"))                                     # seen twice: class 1, comes back
    assert p.victims(1, lambda key: False) == []        # the tier is full at one page
    p.on_request([k("N"), k("M")], 0.0)
    assert not p.admit(k("N"), None)                    # fresh: worth less than A, which it would evict
    assert not p.admit(k("M"), k("N"))                  # and nothing after it: a prefix is kept
    assert p.admit(k("A"), None)                        # not this request's page: a demotion, kept


def test_with_admission_it_still_beats_lru_on_the_synthetic_mix() -> None:
    w = Workload.from_requests(synthetic(2, 4000))
    for cap in ([max(1, w.distinct_blocks // 200)], [max(1, w.distinct_blocks // 20)]):
        assert simulate(w, "gittins", cap).blocks_hit >= simulate(w, "lru", cap).blocks_hit
