"""``tierkv serve`` (detached and --foreground, --metrics, systemd's notify socket) and
``tierkv status``, as a user runs them: real processes, real sockets, SIGTERM."""

from __future__ import annotations

import configparser
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np

from tests.conftest import LAYOUT, PB
from tests.polling import wait_for
from tests.serve.pagegen import pages_of, prompt
from tierkv.cli.main import build_parser
from tierkv.store.api import Store
from tierkv.store.lossy_pages import from_float

ROOT = Path(__file__).resolve().parents[2]


def tierkv(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tierkv", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, **kw)  # type: ignore[call-overload, no-any-return]


def config(tmp_path: Path, sock: Path) -> Path:
    cfg = tmp_path / "store.toml"
    cfg.write_text(textwrap.dedent(f"""
        [store]
        path = "{tmp_path / 'store'}"
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
        socket = "{sock}"
    """))
    return cfg


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_detached_daemon_status_and_sigterm(tmp_path: Path, sock_dir: Path) -> None:
    sock = sock_dir / "d.sock"
    cfg = config(tmp_path, sock)
    started = tierkv("serve", "--config", str(cfg), "--json")
    assert started.returncode == 0, started.stderr
    ready = json.loads(started.stdout)
    assert ready["socket"] == str(sock)
    pid = ready["pid"]
    try:
        with Store.connect(sock) as client:
            t = prompt(1, 3)
            client.put(t, pages_of(t))
            client.get(t, np.zeros((3, PB), np.uint8))
            st = json.loads(tierkv("status", "--config", str(cfg), "--json").stdout)
            assert st["running"] and st["pid"] == pid and st["connections"] == 2   # the client and status
            assert [c["pid"] for c in st["clients"]] == [os.getpid(), st["clients"][1]["pid"]]
            assert st["stats"]["pages_hit"] == 3 and st["stats"]["tiers"]["dram"]["used_slots"] == 3
            assert st["stats"]["tiers"]["dram"]["codec"] is None   # the codec choice travels with the stats
            assert st["stats"]["tiers"]["nvme"]["codec"]["reason"] == "codec = none: pages are stored raw"
            assert client.stats().tiers["nvme"].codec == st["stats"]["tiers"]["nvme"]["codec"]
            memory = st["stats"]
            assert memory["page_table_bytes"] > 0 and memory["index_file_bytes"] > 0
            assert memory["tiers"]["nvme"]["policy_bytes"] is None or memory["tiers"]["nvme"]["policy_bytes"] > 0
            shown = tierkv("status", "--socket", str(sock))
            assert shown.returncode == 0 and "hit rate 1.000" in shown.stdout and "clients" in shown.stdout
            assert "page metadata: page table" in " ".join(shown.stdout.split()), shown.stdout
            assert "approximate pages" not in shown.stdout
            lossy = prompt(2, 2)                            # pages put lossy, got by a get that accepts them
            x = np.random.default_rng(5).standard_normal((2, *LAYOUT.page_shape)).astype(np.float32)
            client.put_lossy(lossy, np.stack([from_float(page, "bf16") for page in x]), 8.0)   # finite values
            assert client.get(lossy, np.zeros((2, PB), np.uint8), accept_lossy=8.0).lossy == 2
            shown = tierkv("status", "--socket", str(sock))
            assert "approximate pages served: 0 derived, 2 lossy" in " ".join(shown.stdout.split()), shown.stdout
        again = tierkv("serve", "--config", str(cfg))   # the store is held: the second daemon says why
        assert again.returncode == 1 and f"use it through Store.connect('{sock}')" in again.stderr
    finally:
        os.kill(pid, signal.SIGTERM)
    assert wait_for(lambda: gone(pid), 60)
    assert not sock.exists()
    assert "stopping: closing" in (tmp_path / "store" / "serve.log").read_text()
    down = tierkv("status", "--socket", str(sock), "--json")
    assert down.returncode == 1 and json.loads(down.stdout)["running"] is False
    with Store.open(str(cfg)) as s:                     # the close wrote the DRAM pages down
        assert s.lookup(prompt(1, 3)).cached_pages == 3


def test_foreground_with_metrics_and_systemd_notify(tmp_path: Path, sock_dir: Path) -> None:
    sock = sock_dir / "d.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(sock_dir / "notify"))
    notify.settimeout(60)
    proc = subprocess.Popen([sys.executable, "-m", "tierkv", "serve", "--config", str(config(tmp_path, sock)),
                             "--foreground", "--json", "--metrics", "127.0.0.1:0"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "NOTIFY_SOCKET": str(sock_dir / "notify")})
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert notify.recv(64) == b"READY=1"
        with Store.connect(sock) as client:
            client.lookup(prompt(1, 1))
            text = urllib.request.urlopen(ready["metrics"], timeout=30).read().decode()
        assert "tierkv_serve_connections 1.0" in text
        assert 'tierkv_tier_capacity_slots{tier="dram"} 16.0' in text and "tierkv_lookups_total 1.0" in text
        assert "tierkv_page_table_bytes " in text and "tierkv_index_file_bytes " in text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        notify.close()
    assert proc.returncode == 0
    assert "connections and the store" in err   # logged to stderr in the foreground


def test_bad_flags_are_usage_errors(tmp_path: Path, sock_dir: Path) -> None:
    cfg = config(tmp_path, sock_dir / "d.sock")
    for flags, match in ((["--mode", "999"], "--mode must be octal"), (["--metrics", "nohost"], "HOST:PORT"),
                         (["--max-clients", "0"], "at least 1")):
        done = tierkv("serve", "--config", str(cfg), *flags)
        assert done.returncode == 2 and match in done.stderr, done.stderr
    assert tierkv("status").returncode == 2


def test_the_example_systemd_unit_runs_this_command() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(ROOT / "configs" / "tierkv.service")
    assert unit["Service"]["Type"] == "notify"
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert Path(argv[0]).name == "tierkv" and argv[1] == "serve" and "--foreground" in argv
    args = build_parser().parse_args(argv[1:])
    assert args.foreground and args.config == "/etc/tierkv/store.toml"
    assert unit["Service"]["KillSignal"] == "SIGTERM"


def test_status_of_a_socket_nobody_listens_on(sock_dir: Path) -> None:
    start = time.monotonic()
    done = tierkv("status", "--socket", str(sock_dir / "none.sock"))
    assert done.returncode == 1 and "no tierkv daemon answers" in done.stderr
    assert time.monotonic() - start < 60
