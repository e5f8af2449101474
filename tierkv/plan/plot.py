"""``tierkv plan --plot out.png``: the LRU hit-rate curve with the tiers on it, and load vs recompute.

Left: prefix hit rate against cache capacity (bytes, log scale), each tier's span of the
cumulative capacity shaded. Right: time to load a prefix from each tier and time to
recompute it, against prompt length, with the crossovers marked. Needs matplotlib (the
``plot`` extra); without it, :class:`tierkv.errors.InputError` says how to get it.
Called by :mod:`tierkv.cli.plan`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from tierkv.errors import InputError
from tierkv.plan.planner import BLOCK_TOKENS, Plan

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_COLORS = {"hbm": "tab:green", "dram": "tab:blue", "nvme": "tab:orange", "nvmeof": "tab:purple"}


def write_plot(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write the two panels to ``path`` (PNG). InputError if matplotlib is missing or the file can't be written."""
    try:
        import matplotlib
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install matplotlib (or tierkv[plot])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    _curve(plan, left)
    _load_vs_recompute(plan, right)
    fig.suptitle(f"tierkv plan: {plan.request.model.name} ({plan.layout.dtype.value}) on "
                 f"{plan.request.profile.name}, {plan.request.workload}")
    fig.tight_layout()
    try:
        fig.savefig(os.fspath(path), dpi=110, format="png")
    except OSError as exc:
        raise InputError(f"cannot write plot {os.fspath(path)!r}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def _curve(plan: Plan, ax: Axes) -> None:
    token_bytes = plan.layout.token_bytes
    x = plan.curve_blocks * BLOCK_TOKENS * token_bytes
    ax.plot(x, plan.curve_hit_rate, color="black", label="LRU prefix hit rate")
    start = 0.0
    for r in plan.tiers:
        # Capacities in raw (uncompressed) bytes, so the NVMe tiers stretch by 1 / codec ratio.
        end = start + r.capacity_blocks * BLOCK_TOKENS * token_bytes
        if end > start:
            ax.axvspan(max(start, x[0]), end, alpha=0.15, color=_COLORS.get(r.tier.kind.value),
                       label=f"{r.tier.kind.value}: {r.flow.hit_rate:.1%} of blocks")
        start = end
    ax.axhline(plan.unbounded_hit_rate, ls=":", color="gray", label="unbounded cache")
    ax.set(xscale="log", xlabel="cache capacity (raw KV bytes)", ylabel="prefix hit rate",
           title="hit rate against capacity, tiers stacked fastest first", ylim=(0, 1))
    ax.legend(loc="upper left", fontsize=8)


def _load_vs_recompute(plan: Plan, ax: Axes) -> None:
    top = max(plan.request.model.max_context_tokens, 2)
    n = np.unique(np.geomspace(1, top, 200).astype(np.int64))
    ax.plot(n, plan.prefill.recompute_s(n), color="black", lw=2, label="recompute (prefill)")
    for r in plan.tiers:
        color = _COLORS.get(r.tier.kind.value)
        ax.plot(n, r.tier.load.load_s(n), color=color, label=f"load from {r.tier.kind.value}")
        if r.crossover_tokens is not None:
            ax.axvline(r.crossover_tokens, color=color, ls="--", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="prompt prefix length (tokens)", ylabel="seconds",
           title="load vs recompute (dashed: crossover; below it recompute wins)")
    ax.legend(loc="upper left", fontsize=8)
