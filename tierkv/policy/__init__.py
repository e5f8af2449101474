"""Eviction and admission policies, by config name."""

from __future__ import annotations

from tierkv.errors import ConfigError
from tierkv.policy.base import Policy
from tierkv.policy.lru import LRUPolicy

_POLICIES = {"lru": LRUPolicy}


def make_policy(name: str) -> Policy:
    """A fresh policy instance for one tier."""
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; expected one of {', '.join(_POLICIES)}") from None


__all__ = ["LRUPolicy", "Policy", "make_policy"]
