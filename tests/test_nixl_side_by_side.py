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
        assert modes == {"nixl-posixaio", "nixl-aio", "nixl-uring", "tier-numpy", "tier-aligned"}
        for op in ("put", "get"):
            best = max(v for k, v in s["gbps"].items() if k.startswith(f"{op} nixl-"))
            for kind in ("numpy", "aligned"):
                want = round(s["gbps"][f"{op} tier-{kind}"] / best, 3)
                assert abs(s["tier_vs_nixl_best"][f"{op} tier-{kind}"] - want) <= 0.002
    assert list(tmp_path.iterdir()) == []   # its files removed
