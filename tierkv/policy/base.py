"""The policy interface: the manager tells a policy what happened, it answers with victims.

A policy governs one tier. It does no I/O, no logging and no metrics; it only keeps
the order in which its pages should leave. Called by :mod:`tierkv.store.manager` under the
store lock, so implementations need not be thread-safe, and by the simulator
(:mod:`tierkv.sim.mirror`) through the same calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from tierkv.keys import PageKey


class Policy(Protocol):
    """What the manager asks of a per-tier eviction and admission policy.

    A policy may also offer batch forms, which the manager calls instead where present,
    with the same effect as the calls one by one in order: ``insert_many(keys, parents,
    has_parent)`` (16-byte keys back to back; a parent used where its ``has_parent`` byte
    is nonzero), ``touch_many(keys)`` (a get's hits), ``remove_many(keys)`` (evicted pages,
    keys back to back) and ``admit_many(pages)`` (a list of (key, parent); returns a list
    of answers), or before it ``admit_keys(keys)``, the same from the keys alone (None,
    nothing changed, where it needs the parents); and ``admit_all(keys)``, asked first:
    True where it admits every key without weighing any (and has), False with nothing
    changed. :class:`~tierkv.policy.gittins.GittinsPolicy` has all six. ``memory_bytes()`` (optional)
    says how many bytes its per-page state holds (None where it cannot tell), for ``stats()``.
    """

    def __len__(self) -> int:
        """How many pages the policy tracks."""
        ...

    def on_request(self, keys: Sequence[PageKey], now: float) -> None:
        """A request for the prompt whose full pages are ``keys`` arrived at ``now``.

        Called once per request, on every tier's policy, before the request's touches and
        inserts; ``keys`` are all its full pages in prompt order, cached or not, and
        ``now`` is monotonic seconds (policies may keep their own clock). A hint: a
        policy that needs none implements it as a no-op, and every policy must still
        work, if less well, when it is never called.
        """

    def insert(self, key: PageKey, parent: PageKey | None) -> None:
        """``key`` now resides in this tier."""

    def touch(self, key: PageKey) -> None:
        """``key`` was read from (or looked up in) this tier."""

    def remove(self, key: PageKey) -> None:
        """``key`` left this tier (evicted, dropped, quarantined)."""

    def victims(self, n: int, evictable: Callable[[PageKey], bool]) -> list[PageKey]:
        """Up to ``n`` resident keys to evict, best victim first, all with ``evictable(key)``.

        The manager then calls ``remove`` for each, in order; victims it does not remove
        stay resident. A victim whose last copy leaves the store takes its cached
        descendants along (the manager drops them once the plan is done, and calls
        ``remove`` for them too): a policy that offers leaves first (gittins, lru-leaf)
        never loses more than it chose.
        """

    def admit(self, key: PageKey, parent: PageKey | None) -> bool:
        """Whether a page being demoted or stored into this tier should be kept."""
