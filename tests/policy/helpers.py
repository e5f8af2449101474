"""Shared helpers for the policy tests: keys, a tiny manager loop, random prefix workloads."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from tierkv.keys import PageKey
from tierkv.policy.base import Policy


def k(name: str | int) -> PageKey:
    """A readable page key."""
    return PageKey(str(name).encode())


def chain(*names: str | int) -> list[tuple[PageKey, PageKey | None]]:
    """``(key, parent)`` pairs of a prefix chain."""
    keys = [k(n) for n in names]
    return [(key, keys[i - 1] if i else None) for i, key in enumerate(keys)]


def store(policy: Policy, names: Sequence[str | int], now: float = 0.0) -> list[PageKey]:
    """One request whose pages are all new: the hint, then the inserts, as the manager makes them."""
    pairs = chain(*names)
    policy.on_request([key for key, _ in pairs], now)
    for key, parent in pairs:
        policy.insert(key, parent)
    return [key for key, _ in pairs]


def next_request(policy: Policy) -> None:
    """An unrelated request arrives, so the previous one's pages may be victims again."""
    policy.on_request([k("unrelated")], 0.0)


def everything(_: PageKey) -> bool:
    return True


@st.composite
def prefix_workloads(draw: st.DrawFn, max_requests: int = 60) -> list[tuple[PageKey, ...]]:
    """Requests as paths in a growing prefix tree: each extends a prefix of an earlier one."""
    n = draw(st.integers(1, max_requests))
    requests: list[tuple[PageKey, ...]] = []
    next_id = 0
    for _ in range(n):
        base: tuple[PageKey, ...] = ()
        if requests and draw(st.booleans()):
            prev = requests[draw(st.integers(0, len(requests) - 1))]
            base = prev[:draw(st.integers(0, len(prev)))]
        extra = draw(st.integers(0 if base else 1, 6))
        requests.append(base + tuple(PageKey(b"p%d" % (next_id + i)) for i in range(extra)))
        next_id += extra
    return requests
