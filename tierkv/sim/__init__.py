"""The trace simulator behind ``tierkv sim``: policies over a workload, hit rates, no bytes.

:mod:`tierkv.sim.mirror` runs the store's own block manager over the byte-less tiers of
:mod:`tierkv.sim.tiers`, making the calls a store makes per request; :mod:`tierkv.sim.run`
runs one policy at one tier configuration; :mod:`tierkv.sim.stack` gives plain LRU at
every capacity from one pass; :mod:`tierkv.sim.plot` draws the curves. The command is
:mod:`tierkv.cli.sim`. Importing the package is cheap; the rest loads on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierkv.sim.mirror import SimManager
    from tierkv.sim.run import SimResult, Workload, parse_capacities, simulate
    from tierkv.sim.stack import lru_curve

_LAZY = {"SimManager": "mirror", "SimResult": "run", "Workload": "run", "parse_capacities": "run",
         "simulate": "run", "lru_curve": "stack"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(f"tierkv.sim.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'tierkv.sim' has no attribute {name!r}")


__all__ = ["SimManager", "SimResult", "Workload", "lru_curve", "parse_capacities", "simulate"]
