"""Eviction and admission policies, by config name.

``make_policy(name)`` builds one policy instance for one tier. :data:`DEFAULT_POLICY`
is what a store uses unless configured otherwise; ``docs/policies.md`` has the
measurements behind the choice. Belady's OPT (:mod:`tierkv.policy.belady`) needs the
future, so it lives in the simulator only.
"""

from __future__ import annotations

from collections.abc import Callable

from tierkv.errors import ConfigError
from tierkv.policy.base import Policy
from tierkv.policy.belady import BeladyPolicy, Future
from tierkv.policy.cost import CostAwarePolicy, CostModel
from tierkv.policy.gittins import GittinsPolicy
from tierkv.policy.lru import LeafLRUPolicy, LRUPolicy
from tierkv.policy.s3fifo import S3FIFOPolicy

_POLICIES: dict[str, Callable[[], Policy]] = {
    "lru": LRUPolicy,
    "lru-leaf": LeafLRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "gittins": GittinsPolicy,
}

#: Config names of the store's policies.
POLICY_NAMES = tuple(_POLICIES)
#: The policy a store uses unless its config names another.
DEFAULT_POLICY = "gittins"


def make_policy(name: str, cost: CostModel | None = None) -> Policy:
    """A fresh policy instance for one tier.

    With a ``cost`` model of that tier, pages not worth loading from it are not admitted
    (and ``"gittins"`` also weighs each page by the prefill time a hit on it saves).
    """
    if name not in _POLICIES:
        raise ConfigError(f"unknown policy {name!r}; expected one of {', '.join(_POLICIES)}")
    if cost is None:
        return _POLICIES[name]()
    if name == "gittins":
        return GittinsPolicy(cost=cost)
    return CostAwarePolicy(_POLICIES[name](), cost)


__all__ = ["DEFAULT_POLICY", "POLICY_NAMES", "BeladyPolicy", "CostAwarePolicy", "CostModel", "Future",
           "GittinsPolicy", "LRUPolicy", "LeafLRUPolicy", "Policy", "S3FIFOPolicy", "make_policy"]
