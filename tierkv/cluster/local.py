"""A local etcd, and a local cluster, for trying the cluster and for tests, on loopback.

``LocalEtcd(workdir).start()`` runs the ``etcd`` binary (Debian: ``apt-get install
etcd-server``) with its data in ``workdir``, on free loopback ports, waits until it
answers, and ``stop()`` ends it by its PID (``kill()``: SIGKILL, as a crash).
``LocalCluster`` adds node daemons around it (``tierkv cluster up``). Nothing here is used
by a node in production, which names its etcd endpoints in ``[cluster]``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierkv.errors import ClusterUnavailableError, ConfigError
from tierkv.serve.child import Daemon


def etcd_binary() -> str | None:
    """The ``etcd`` server binary, or None."""
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.access(p, os.X_OK)),
                                        None)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalEtcd:
    """One etcd member on ``host`` (default 127.0.0.1), its data under ``workdir``."""

    def __init__(self, workdir: Path | str, client_port: int = 0, name: str = "tierkv-local",
                 host: str = "127.0.0.1") -> None:
        self.workdir = Path(workdir)
        self.host = host
        self.client_port = client_port or free_port()
        self.peer_port = free_port()
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "etcd.log"

    def start(self, timeout_s: float = 20.0) -> LocalEtcd:
        binary = etcd_binary()
        if binary is None:
            raise ConfigError("no etcd server here: apt-get install etcd-server (etcd 3.4+)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [binary, "--name", self.name, "--data-dir", str(self.workdir / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{self.name}={peer}", "--log-level", "warn"]
        with open(self.log_path, "ab") as log:
            # A session of its own: a terminal's Ctrl-C reaches whoever runs it, which stops
            # the nodes first (they leave the cluster) and etcd last.
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ClusterUnavailableError(f"etcd exited with status {self.proc.returncode}; its log: {self.log_path}")
            try:
                with socket.create_connection((self.host, self.client_port), timeout=0.2):
                    pass
                if self._healthy():
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise ClusterUnavailableError(f"etcd did not answer within {timeout_s:.0f} s; its log: {self.log_path}")

    def _healthy(self) -> bool:
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.client_port}/health", timeout=1) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL etcd (a crash); its data stays for a restart."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        self._end(signal.SIGTERM)

    def pause(self) -> None:
        """SIGSTOP etcd: it holds its connections open and answers nothing (as when frozen,
        or partitioned away without a reset); :meth:`resume` goes on."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def _end(self, sig: int) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)   # a paused etcd cannot act on SIGTERM
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> LocalEtcd:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: The layout of ``tierkv cluster up``'s nodes (any model's will do for trying the cluster):
#: 8 layers of 8 KV heads of 128 dims in bf16, 16 tokens a page (256 KiB pages).
TRY_LAYOUT = {"num_layers": 8, "num_kv_heads": 8, "head_dim": 128, "dtype": "bf16", "tokens_per_page": 16}


class LocalCluster:
    """``tierkv cluster up``: a local etcd and ``nodes`` node daemons (``tierkv serve``, each
    a process of its own with a store under ``workdir/nodeK``), on loopback, members of
    cluster ``name`` and fetching from each other (a shared ``[peers]`` secret)."""

    def __init__(self, workdir: Path | str, nodes: int = 3, name: str = "local", model_id: str = "tierkv-local",
                 dram: str = "256MiB", nvme: str | None = "1GiB", layout: dict[str, Any] | None = None,
                 lease_ttl_s: int = 10) -> None:
        """``layout``: the nodes' (default :data:`TRY_LAYOUT`); ``nvme``: None for none."""
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= 16:
            raise ConfigError(f"a local cluster has 1 to 16 nodes, got {nodes!r}")
        self.workdir = Path(workdir)
        self.nodes, self.name, self.model_id, self.dram, self.nvme = nodes, name, model_id, dram, nvme
        self.layout, self.lease_ttl_s = layout or TRY_LAYOUT, lease_ttl_s
        self.etcd = LocalEtcd(self.workdir / "etcd")
        self.daemons: list[tuple[str, Path, Daemon]] = []
        self.records: dict[str, Any] = {}   # node -> NodeRecord, once all joined

    def _config(self, node: str, secret: Path) -> Path:
        import json

        q = json.dumps
        store = self.workdir / node
        layout = "\n".join(f"{k} = {q(v)}" for k, v in self.layout.items())
        nvme = f"[tiers.nvme]\ncapacity_bytes = {q(self.nvme)}\n\n" if self.nvme else ""
        text = (f"[store]\npath = {q(str(store))}\nmodel_id = {q(self.model_id)}\n\n[layout]\n{layout}\n\n"
                f"[tiers.dram]\ncapacity_bytes = {q(self.dram)}\n\n{nvme}"
                f"[serve]\nsocket = {q(str(store / 'tierkv.sock'))}\n\n"
                f"[peers]\nserve = \"127.0.0.1:0\"\ntransport = \"tcp\"\nsecret_file = {q(str(secret))}\n\n"
                f"[cluster]\netcd = [{q(self.etcd.endpoint)}]\nname = {q(self.name)}\nnode = {q(node)}\n"
                f"lease_ttl_s = {self.lease_ttl_s}\ntimeout_s = {min(2000, self.lease_ttl_s * 1000 // 3) / 1000}\n")
        path = self.workdir / f"{node}.toml"
        path.write_text(text)
        return path

    def start(self, step: Callable[[str], None] | None = None, timeout_s: float = 60.0) -> LocalCluster:
        """Start etcd, then the nodes, and wait until every node is a member; ``step`` is
        told of each part as it is up. On a failure, what started is stopped."""
        from tierkv.cluster.etcd import Etcd
        from tierkv.cluster.members import NodeView

        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.etcd.start()
            if step:
                step(f"etcd on {self.etcd.endpoint}")
            secret = self.workdir / "peers.secret"
            fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32).hex().encode())
            for k in range(1, self.nodes + 1):
                node = f"node{k}"
                config = self._config(node, secret)
                daemon = Daemon(config, self.workdir / f"{node}.log", new_session=True).start(timeout_s)
                self.daemons.append((node, config, daemon))
                if step:
                    step(f"{node} on {daemon.socket}")
            etcd = Etcd([self.etcd.endpoint])
            view = NodeView(etcd, self.name).start()
            try:
                want = {n for n, _, _ in self.daemons}
                if not view.wait(lambda nodes: want <= set(nodes), timeout_s):
                    raise ClusterUnavailableError(f"the nodes did not all join cluster {self.name!r} within "
                                                  f"{timeout_s:.0f} s; their logs are in {self.workdir}")
                self.records = view.nodes()
            finally:
                view.close()
                etcd.close()
        except BaseException:
            self.stop()
            raise
        return self

    def describe(self) -> dict[str, object]:
        """What ``tierkv cluster up`` prints: etcd, and per node its socket, config, peer address, pid."""
        nodes = []
        for node, config, daemon in self.daemons:
            rec = self.records.get(node)
            nodes.append({"node": node, "socket": daemon.socket, "config": str(config),
                          "peer": rec.peer if rec is not None else None,
                          "pid": daemon.proc.pid if daemon.proc is not None else None})
        return {"cluster": self.name, "etcd": self.etcd.endpoint, "model_id": self.model_id,
                "workdir": str(self.workdir), "nodes": nodes}

    def stop(self) -> None:
        """Stop the nodes (each writes its DRAM pages down and leaves the cluster), then etcd."""
        for _node, _config, daemon in reversed(self.daemons):
            daemon.stop()
        self.daemons = []
        self.etcd.stop()
