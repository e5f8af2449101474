"""A local etcd for trying the cluster and for tests: one ``etcd`` process on loopback.

``LocalEtcd(workdir).start()`` runs the ``etcd`` binary (Debian: ``apt-get install
etcd-server``) with its data in ``workdir``, on free loopback ports, waits until it
answers, and ``stop()`` ends it by its PID (``kill()``: SIGKILL, as a crash). Nothing
here is used by a node in production, which names its etcd endpoints in ``[cluster]``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tierkv.errors import ClusterUnavailableError, ConfigError


def etcd_binary() -> str | None:
    """The ``etcd`` server binary, or None."""
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.access(p, os.X_OK)),
                                        None)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalEtcd:
    """One etcd member on 127.0.0.1, its data under ``workdir``."""

    def __init__(self, workdir: Path | str, client_port: int = 0, name: str = "tierkv-local") -> None:
        self.workdir = Path(workdir)
        self.client_port = client_port or free_port()
        self.peer_port = free_port()
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "etcd.log"

    def start(self, timeout_s: float = 20.0) -> LocalEtcd:
        binary = etcd_binary()
        if binary is None:
            raise ConfigError("no etcd server here: apt-get install etcd-server (etcd 3.4+)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [binary, "--name", self.name, "--data-dir", str(self.workdir / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{self.name}={peer}", "--log-level", "warn"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ClusterUnavailableError(f"etcd exited with status {self.proc.returncode}; its log: {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
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
            with urllib.request.urlopen(f"http://127.0.0.1:{self.client_port}/health", timeout=1) as r:
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
