"""``tierkv cluster up`` as a user runs it: three nodes on loopback, pages put through one node
loaded through another, Ctrl-C stops everything."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tierkv.cluster.local import TRY_LAYOUT, etcd_binary
from tierkv.cli.main import main
from tierkv.layout import KVLayout
from tierkv.store.api import Store
from tierkv.tiers.base import TierKind
from tests.cli.test_serve_cli import gone
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_up_runs_three_nodes_that_share_pages_and_stops_them_all(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if etcd_binary() is None or importlib.util.find_spec("etcd3gw") is None:
        pytest.skip("needs the etcd server and etcd3gw (tools/install.sh installs both)")
    work = tmp_path / "cluster"
    proc = subprocess.Popen([sys.executable, "-m", "tierkv", "cluster", "up", "--nodes", "3", "--dir", str(work),
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        info = json.loads(line)
        assert [n["node"] for n in info["nodes"]] == ["node1", "node2", "node3"]
        assert main(["cluster", "nodes", "--etcd", info["etcd"], "--name", "local", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)["nodes"]
        assert sorted(n["node"] for n in listed) == ["node1", "node2", "node3"]
        layout = KVLayout(**TRY_LAYOUT)   # type: ignore[arg-type]
        tokens = np.random.default_rng(5).integers(0, 50_000, 3 * layout.tokens_per_page)
        data = np.random.default_rng(6).integers(0, 256, (3, layout.page_bytes), dtype=np.uint8)
        with Store.connect(info["nodes"][0]["socket"]) as one:
            one.put(tokens, data)
        out = np.zeros_like(data)
        with Store.connect(info["nodes"][2]["socket"]) as three:
            assert wait_for(lambda: three.lookup(tokens).cached_pages == 3, 10)   # node3 connected to node1
            got = three.get(tokens, out)
        assert got.pages == 3 and set(got.tiers) == {TierKind.PEER} and np.array_equal(out, data)
        pids = [n["pid"] for n in info["nodes"]]
        proc.send_signal(signal.SIGINT)                      # Ctrl-C
        assert proc.wait(60) == 0
        assert all(gone(p) for p in pids)
        assert not (Path(info["nodes"][0]["socket"])).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert main(["cluster", "up", "--dir", str(work), "--json"]) == 2   # not empty now: refused
    assert "is not empty" in capsys.readouterr().err
