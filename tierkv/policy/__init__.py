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


def make_policy(name: str) -> Policy:
    """A fresh policy instance for one tier."""
    if name not in _POLICIES:
        raise ConfigError(f"unknown policy {name!r}; expected one of {', '.join(_POLICIES)}")
    return _POLICIES[name]()


__all__ = ["DEFAULT_POLICY", "POLICY_NAMES", "BeladyPolicy", "Future", "GittinsPolicy", "LRUPolicy", "LeafLRUPolicy",
           "Policy", "S3FIFOPolicy", "make_policy"]
