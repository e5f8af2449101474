"""``tierkv sim --plot``: prefix hit rate against capacity, one line per policy (matplotlib).

matplotlib is imported here only, so the simulator runs without it.
"""

from __future__ import annotations

from collections import defaultdict

from tierkv.errors import InputError
from tierkv.sim.run import LRU_STACK, SimResult, Workload
from tierkv.sim.stack import lru_curve_results

#: Capacities (shares of the distinct blocks) at which the one-pass LRU curve is drawn.
_CURVE_POINTS = 48


def plot_curves(results: list[SimResult], workload: Workload, path: str) -> None:
    """Write a PNG to ``path``; single-tier results are drawn against their capacity share.

    When ``lru-stack`` is among the results, the plain LRU curve is drawn densely
    (it costs one pass for any number of capacities).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise InputError("--plot needs matplotlib (pip install matplotlib, or the 'plot' extra)") from None
    lines: dict[str, list[SimResult]] = defaultdict(list)
    for r in results:
        lines[r.policy if len(r.tiers) == 1 else f"{r.policy} ({len(r.tiers)} tiers)"].append(r)
    if LRU_STACK in lines:
        fracs = sorted(r.capacity_frac for r in lines[LRU_STACK])
        lo, hi = fracs[0], fracs[-1]
        caps = sorted({max(1, int(workload.distinct_blocks * lo * (hi / lo) ** (i / (_CURVE_POINTS - 1))))
                       for i in range(_CURVE_POINTS)} if hi > lo else {lines[LRU_STACK][0].capacity_blocks})
        lines[LRU_STACK] = lru_curve_results(workload, caps)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rs in lines.items():
        rs = sorted(rs, key=lambda r: r.capacity_frac)
        style = "-" if name == LRU_STACK else "-o"
        ax.plot([100 * r.capacity_frac for r in rs], [r.prefix_hit_rate for r in rs], style, label=name, markersize=4)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}%"))
    ax.set_xlabel("capacity (% of distinct blocks)")
    ax.set_ylabel("prefix hit rate")
    src = workload.source.get("trace") or f"synthetic (seed {workload.source.get('seed')})"
    ax.set_title(f"{src}: {len(workload.keys)} requests", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise InputError(f"--plot: cannot write {path!r}: {exc.strerror}") from None
    finally:
        plt.close(fig)
