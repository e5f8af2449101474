"""``tierkv bench cluster --quick --json`` runs a real etcd and three node daemons, and reports
every figure the issue asks for, with no wrong answer (figures are not judged here: timing
belongs to docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.cluster.conftest import needs_etcd


@needs_etcd
def test_bench_cluster_quick_json(sock_dir: Path) -> None:   # a short folder: the daemons' sockets are in it
    proc = subprocess.run([sys.executable, "-m", "tierkv", "bench", "cluster", "--quick", "--json", "--lease", "2",
                           "--dir", str(sock_dir)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    for key in ("nodes", "publish_pages_per_s", "lookup_p50_ms", "lookup_p99_ms", "failover_s", "etcd_bytes_per_page"):
        assert isinstance(r[key], (int, float)) and r[key] > 0, (key, r)
    assert r["nodes"] == 3 and r["pages"] == 2048 and r["lease_ttl_s"] == 2
    assert r["mismatches"] == 0 and r["failover_wrong"] == 0
    assert 0.1 < r["etcd_keys_per_page"] < 0.11          # 6 shallow anchors + ~0.5 deep ones per 64 pages
    assert r["failover_s"] < 2 * 2 + 5                   # the lease, then etcd's expiry check and the watch
    assert list(sock_dir.iterdir()) == []                # its files are gone
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(sock_dir).encode() in _cmdline(p)]
    assert left == [], "etcd or a node daemon outlived the benchmark"


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_bench_cluster_refuses_bad_arguments() -> None:
    for args, msg in ((["--nodes", "1"], "--nodes must be 2 to 16"), (["--lease", "1"], "--lease must be 2"),
                      (["--runs", "2"], "--runs is not for the cluster suite")):
        proc = subprocess.run([sys.executable, "-m", "tierkv", "bench", "cluster", *args], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode != 0 and msg in proc.stderr, (args, proc.stderr)
    proc = subprocess.run([sys.executable, "-m", "tierkv", "bench", "store", "--nodes", "2"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "--nodes and --lease are for the cluster suite" in proc.stderr
