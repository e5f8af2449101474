"""tools/nixl_side_by_side.py: NIXL and the NVMe tier in one process (where the peer
harness's NIXL venv exists: ``bash ../shared/peers/setup.sh nixl``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NIXL_PYTHON = Path(os.environ.get("PEERS_ROOT", "/tmp/peers")) / "nixl" / "bin" / "python"


@pytest.mark.skipif(not NIXL_PYTHON.exists(), reason=f"no NIXL venv at {NIXL_PYTHON} (../shared/peers/setup.sh nixl)")
def test_nixl_and_the_tier_side_by_side_print_checked_figures_and_ratios(tmp_path: Path) -> None:
    run = subprocess.run([str(NIXL_PYTHON), str(ROOT / "tools" / "nixl_side_by_side.py"), "--dir", str(tmp_path),
                          "--shapes", "262144x8,1048576x4", "--runs", "2", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    shapes = json.loads(run.stdout)   # standard output holds the JSON alone (NIXL's log goes to stderr)
    assert [(s["page_bytes"], s["pages"]) for s in shapes] == [(262144, 8), (1048576, 4)]
    for s in shapes:
        assert s["verified"] is True and s["runs"] == 2
        modes = {k.split(" ", 1)[1] for k in s["gbps"]}
        assert modes == {"nixl-posixaio", "nixl-aio", "nixl-uring", "tier-numpy", "tier-aligned", "tier-shared"}
        for op in ("put", "get"):
            best = max(v for k, v in s["gbps"].items() if k.startswith(f"{op} nixl-"))
            for kind in ("numpy", "aligned", "shared"):
                want = round(s["gbps"][f"{op} tier-{kind}"] / best, 3)
                assert abs(s["tier_vs_nixl_best"][f"{op} tier-{kind}"] - want) <= 0.002
        assert s["pages_4k"] == s["page_bytes"] * s["pages"] // 4096
        runs = s["physical_runs"]
        assert set(runs) == {"nixl_src", "nixl_out", "aligned_src", "aligned_out"}
        for v in runs.values():   # null without root; else between one run and one a page
            assert v is None if os.geteuid() else 1 <= v <= s["pages_4k"]
    assert list(tmp_path.iterdir()) == []   # its files removed


def test_physical_runs_counts_frames_only_where_pagemap_gives_them() -> None:
    import importlib.util

    import numpy as np

    from tierkv.tiers.aligned import aligned_empty

    spec = importlib.util.spec_from_file_location("nixl_side_by_side", ROOT / "tools" / "nixl_side_by_side.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    buf = aligned_empty(64 * 4096)
    assert tool.physical_runs(buf) is None          # never touched: no frames yet
    buf[:] = 1
    runs = tool.physical_runs(buf)
    if os.geteuid():
        assert runs is None                          # frame numbers hidden from non-root
    else:
        assert runs is not None and 1 <= runs <= 64
        frames = []                                  # the same count, page by page
        with open("/proc/self/pagemap", "rb") as f:
            for i in range(64):
                f.seek((buf.ctypes.data // 4096 + i) * 8)
                frames.append(int.from_bytes(f.read(8), "little") & ((1 << 55) - 1))
        assert runs == 1 + sum(b != a + 1 for a, b in zip(frames, frames[1:]))
        assert tool.physical_runs(np.asarray(buf[4096:8192])) == 1   # one page: one run
