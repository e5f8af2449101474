"""Running policies over a workload: capacities, one simulation, its result.

A :class:`Workload` turns requests into the page keys the store would see (one key
per full block; block ids are prefix-chained, so equal ids are equal pages), and
remembers how many blocks each request asked for in all, partial last block
included: the hit rate's denominator. :func:`simulate` runs one policy over one
tier configuration through :class:`~tierkv.sim.mirror.SimManager` (the store's own
block manager over byte-less tiers); ``"opt"`` is Belady's OPT
(:mod:`tierkv.policy.belady`) fed the workload's future.

Called by :mod:`tierkv.cli.sim` and the tests; single-threaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tierkv.errors import InputError
from tierkv.keys import PageKey
from tierkv.policy import POLICY_NAMES, make_policy
from tierkv.policy.base import Policy
from tierkv.policy.belady import BeladyPolicy, Future
from tierkv.sim.mirror import SimManager, as_page_keys
from tierkv.sim.tiers import TIER_NAMES
from tierkv.workload.trace import MOONCAKE_BLOCK_TOKENS, Request

#: Policy names the simulator knows beyond the store's: Belady's OPT and the one-pass LRU curve.
OPT = "opt"
LRU_STACK = "lru-stack"
SIM_POLICIES = (*POLICY_NAMES, OPT, LRU_STACK)


@dataclass
class Workload:
    """Page keys per request, the blocks each request asked for, and the distinct block count.

    ``cache_partial`` also gives a key to the partial last block of a request (the store
    never caches it; some simulators do, which is how to compare with them). A key is 16
    bytes, as the store's: the tenant's number (in order of first appearance) and the
    block id, 8 bytes each, little-endian; equal keys are equal pages, tenants never share one.
    """

    keys: list[tuple[PageKey, ...]]
    blocks: list[int]
    arrivals: list[float]
    distinct_blocks: int
    source: dict[str, object] = field(default_factory=dict)
    _future: Future | None = None

    @classmethod
    def from_requests(cls, requests: Sequence[Request], *, cache_partial: bool = False,
                      block_tokens: int = MOONCAKE_BLOCK_TOKENS, source: dict[str, object] | None = None) -> Workload:
        keys: list[tuple[PageKey, ...]] = []
        distinct: set[tuple[str, int]] = set()
        tenants: dict[str, bytes] = {}
        for r in requests:
            n = len(r.blocks) if cache_partial else r.full_blocks(block_tokens)
            salt = tenants.get(r.tenant)
            if salt is None:
                salt = tenants[r.tenant] = len(tenants).to_bytes(8, "little")
            keys.append(tuple(PageKey(salt + b.to_bytes(8, "little")) for b in r.blocks[:n]))
            distinct.update((r.tenant, b) for b in r.blocks)
        return cls(keys, [len(r.blocks) for r in requests], [r.arrival_s for r in requests], len(distinct),
                   dict(source or {}))

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks)

    def future(self) -> Future:
        """Every request's next uses, over the keys the simulator's manager sees (:func:`as_page_keys`).
        Requests without a full page never reach the manager (:meth:`SimManager.request`),
        so they have no place in the future either."""
        if self._future is None:
            self._future = Future([as_page_keys(keys) for keys in self.keys if len(keys)])
        return self._future


@dataclass(frozen=True)
class SimResult:
    """One policy at one tier configuration. Rates are shares of the blocks requested.

    ``prefix_hit_rate``: blocks served from cache over blocks requested, a block counting
    only if every earlier block of its request was cached when the request arrived;
    ``tier_hit_rate`` splits it by the tier that served each block.
    """

    policy: str
    capacity_blocks: int
    capacity_frac: float
    tiers: tuple[int, ...]
    prefix_hit_rate: float
    blocks_requested: int
    blocks_hit: int
    tier_hit_rate: dict[str, float]
    requests: int
    puts_rejected: int
    wall_s: float

    def to_dict(self) -> dict[str, object]:
        """The result as a JSON-ready dict (``tierkv sim --json``'s ``results``)."""
        return {"policy": self.policy, "capacity_blocks": self.capacity_blocks,
                "capacity_frac": self.capacity_frac, "tiers": list(self.tiers),
                "prefix_hit_rate": self.prefix_hit_rate, "blocks_requested": self.blocks_requested,
                "blocks_hit": self.blocks_hit, "tier_hit_rate": dict(self.tier_hit_rate),
                "requests": self.requests, "puts_rejected": self.puts_rejected, "wall_s": self.wall_s}


def parse_capacities(spec: str, distinct_blocks: int, what: str = "--capacity") -> list[int]:
    """``"1%,5%"`` (shares of the distinct blocks) or ``"1000,2000"`` (blocks) to block counts."""
    out: list[int] = []
    for item in spec.split(","):
        item = item.strip()
        try:
            if item.endswith("%"):
                frac = float(item[:-1]) / 100.0
                if not 0.0 < frac <= 1e6:
                    raise ValueError
                blocks = max(1, int(frac * distinct_blocks))
            else:
                blocks = int(item)
        except ValueError:
            raise InputError(f"{what}: {item!r} is neither a block count nor a positive percentage "
                             f"(e.g. 1000 or 5%)") from None
        if blocks < 1:
            raise InputError(f"{what}: a capacity must be at least 1 block, got {item!r}")
        out.append(blocks)
    return out


def policy_factory(name: str, workload: Workload, tiers: Sequence[int]) -> Callable[[], Policy]:
    """What builds each tier's policy for ``name`` (a store policy or ``"opt"``), fastest tier first."""
    if name == OPT:
        future = workload.future()
        caps = iter(tiers)
        return lambda: BeladyPolicy(future, next(caps))
    if name not in POLICY_NAMES:
        raise InputError(f"unknown policy {name!r}; expected one of {', '.join(SIM_POLICIES)}")
    return lambda: make_policy(name)


def simulate(workload: Workload, policy: str, tiers: Sequence[int], *, promote: bool = True) -> SimResult:
    """Run ``policy`` over ``workload`` with tiers of ``tiers`` blocks (fastest first)."""
    if len(tiers) > len(TIER_NAMES):
        raise InputError(f"at most {len(TIER_NAMES)} tiers can be simulated, got {len(tiers)}")
    start = time.perf_counter()
    manager = SimManager(tiers, policy_factory(policy, workload, tiers), promote=promote)
    hit = 0
    step = manager.request
    for keys, now in zip(workload.keys, workload.arrivals):
        hit += step(keys, now)
    total = workload.total_blocks
    names = TIER_NAMES[:len(tiers)]
    cap = sum(tiers)
    return SimResult(policy, cap, cap / max(workload.distinct_blocks, 1), tuple(tiers), hit / max(total, 1),
                     total, hit, {n: h / max(total, 1) for n, h in zip(names, manager.tier_hits)},
                     len(workload.keys), manager.rejected, time.perf_counter() - start)
