"""``tierkv serve`` detached leaves the directory it was started from (issue 21 review): a
daemon that keeps its start directory as its working directory holds that directory's
file system busy (it cannot be unmounted) for as long as it runs. It works from ``/``,
so every relative path of its config is resolved first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np

from tests.conftest import LAYOUT, PB
from tests.polling import wait_for
from tests.serve.pagegen import pages_of, prompt
from tierkv.config import load_config
from tierkv.store.api import Store
from tierkv.store.opening import SERVED_FILE


def test_a_detached_daemon_works_from_the_root_with_relative_paths(sock_dir: Path) -> None:
    """Everything relative, from the directory the command runs in: the config file, the
    store, the socket and the peers' secret file."""
    secret = sock_dir / "peers.secret"
    secret.write_bytes(b"cluster-secret-of-this-test-run")
    secret.chmod(0o600)
    (sock_dir / "store.toml").write_text(textwrap.dedent(f"""
        [store]
        path = "store"
        model_id = "test-model"
        [layout]
        num_layers = {LAYOUT.num_layers}
        num_kv_heads = {LAYOUT.num_kv_heads}
        head_dim = {LAYOUT.head_dim}
        dtype = "bf16"
        [tiers.dram]
        capacity_bytes = {16 * PB}
        [tiers.nvme]
        capacity_bytes = {64 * PB}
        [serve]
        socket = "d.sock"
        [peers]
        serve = "127.0.0.1:0"
        transport = "tcp"
        secret_file = "peers.secret"
    """))
    started = subprocess.run([sys.executable, "-m", "tierkv", "serve", "--config", "store.toml", "--json"],
                             capture_output=True, text=True, timeout=120, cwd=sock_dir)
    assert started.returncode == 0, started.stderr
    ready = json.loads(started.stdout)
    pid = ready["pid"]
    try:
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
        assert ready["socket"] == str(sock_dir / "d.sock") and ready["store"] == str(sock_dir / "store")
        with Store.connect(sock_dir / "d.sock") as client:
            t = prompt(1, 3)
            client.put(t, pages_of(t))
            out = np.zeros((3, PB), np.uint8)
            assert client.get(t, out).pages == 3 and np.array_equal(out, pages_of(t))
        status = subprocess.run([sys.executable, "-m", "tierkv", "status", "--config", "store.toml", "--json"],
                                capture_output=True, text=True, timeout=120, cwd=sock_dir)
        assert status.returncode == 0 and json.loads(status.stdout)["pid"] == pid
    finally:
        os.kill(pid, signal.SIGTERM)
    assert wait_for(lambda: not Path(f"/proc/{pid}").exists(), 60)
    assert not (sock_dir / "d.sock").exists()                    # removed where it was made
    assert not (sock_dir / "store" / SERVED_FILE).exists()
    assert "stopping: closing" in (sock_dir / "store" / "serve.log").read_text()
    cfg = replace(load_config(sock_dir / "store.toml"), path=str(sock_dir / "store"), peers=None)
    with Store.open(cfg) as s:                                   # the close wrote its pages down, there
        assert s.lookup(prompt(1, 3)).cached_pages == 3
