"""``tierkv serve``: run the node service (``tierkv status`` asks a running one).

Registered by ``tierkv.cli.main``. ``tierkv serve --config FILE`` opens the store the
config describes and serves it on a Unix socket (:mod:`tierkv.serve.daemon`) until
SIGTERM or SIGINT, then closes it as an in-process close does (volatile pages written
back, the index left clean) and removes the socket.

- ``--foreground``: stay attached, log to stderr (what a service manager runs: the
  example unit ``configs/tierkv.service``). Under systemd's ``Type=notify`` it sends
  ``READY=1`` once it listens.
- otherwise it detaches (a new session, working directory ``/`` so that it holds no
  file system busy, stdio on /dev/null, logs appended to ``serve.log`` in the store's
  directory) and returns once the daemon listens, or with the daemon's error if it
  could not start. The config's relative paths, and ``--socket``'s, are resolved
  against the directory it was started from, before it leaves it.

Either way it prints one line once the socket is up (``--json``: one JSON object with
the socket, pid and store) so a script can wait for it. ``--metrics HOST:PORT`` serves
Prometheus metrics from the daemon.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

from tierkv.cli.exits import EXIT_FAILED, EXIT_OK
from tierkv.errors import InputError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add ``serve`` to ``tierkv``'s subparsers."""
    p = subparsers.add_parser(
        "serve", help="share one store among many processes on this node (Store.connect(socket))",
        description="Open the store the config describes and serve it on a Unix socket until SIGTERM. Clients "
                    "call Store.connect(SOCKET) and use it as an open store; pages move through shared memory.")
    p.add_argument("--config", required=True, metavar="FILE", help="the store's TOML config")
    p.add_argument("--socket", metavar="PATH", help="the Unix socket to listen on (default: [serve] socket, else "
                   "tierkv.sock in the store's directory)")
    p.add_argument("--mode", metavar="OCTAL", help="the socket's permissions: 0600 lets only this user connect, 0660 "
                   "its group too (default: [serve] mode, else 0600)")
    p.add_argument("--max-clients", type=int, metavar="N", help="connections served at once (default: [serve] "
                   "max_clients, else 64)")
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics at http://HOST:PORT/metrics")
    p.add_argument("--foreground", action="store_true", help="stay attached and log to stderr (for systemd and "
                   "containers); default: detach once listening, logging to serve.log in the store's directory")
    p.add_argument("--json", action="store_true", help="announce the listening socket as one JSON object")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(handler=cmd_serve)

    return p


def _mode(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise InputError(f"--mode must be octal permission bits such as 0600 or 0660, got {text!r}")
    return mode


def _endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InputError(f"--metrics must be HOST:PORT with a port in 0..65535, got {text!r}")
    return host.strip("[]"), int(port)


def cmd_serve(args: argparse.Namespace) -> int:
    from tierkv.config import load_config

    mode = _mode(args.mode)
    if args.max_clients is not None and args.max_clients < 1:
        raise InputError(f"--max-clients must be at least 1, got {args.max_clients}")
    metrics = _endpoint(args.metrics) if args.metrics else None
    cfg = load_config(args.config)      # errors in the config show here, before anything detaches
    if args.foreground:
        logging.basicConfig(level=args.log_level, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return _run(cfg, args, mode, metrics, announce=lambda line: print(line, flush=True))
    if args.socket:
        args.socket = os.path.abspath(args.socket)
    return _detach(_absolute(cfg), args, mode, metrics)


def _absolute(cfg: Any) -> Any:
    """``cfg`` with every path it names made absolute against the working directory (a
    detached daemon works from ``/``)."""
    from dataclasses import replace

    def fix(path: str | None) -> str | None:
        return None if path is None else os.path.abspath(os.path.expanduser(path))

    cfg = replace(cfg, path=fix(cfg.path))
    if cfg.nvmeof is not None:
        cfg = replace(cfg, nvmeof=replace(cfg.nvmeof, device=fix(cfg.nvmeof.device),
                                          dhchap_secret_file=fix(cfg.nvmeof.dhchap_secret_file),
                                          dhchap_ctrl_secret_file=fix(cfg.nvmeof.dhchap_ctrl_secret_file)))
    if cfg.peers is not None:
        cfg = replace(cfg, peers=replace(cfg.peers, secret_file=fix(cfg.peers.secret_file),
                                         tenant_secrets={k: fix(v) for k, v in cfg.peers.tenant_secrets.items()}))
    if cfg.serve is not None and cfg.serve.socket is not None:
        cfg = replace(cfg, serve=replace(cfg.serve, socket=fix(cfg.serve.socket)))
    return cfg


def _run(cfg: Any, args: argparse.Namespace, mode: int | None, metrics: tuple[str, int] | None,
         announce: Any) -> int:
    """Serve until SIGTERM/SIGINT; ``announce(line)`` once listening."""
    from pathlib import Path

    from tierkv.serve.daemon import NodeService
    from tierkv.tiers.hugepages import SHMEM_ENABLED, shmem_huge_pages

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    service = NodeService(cfg, Path(args.socket) if args.socket else None, mode=mode,
                          max_clients=args.max_clients).start()
    logging.getLogger("tierkv.serve").info("huge pages for shared memory (/sys/%s): %s (docs/serve.md, Huge pages)",
                                           SHMEM_ENABLED, shmem_huge_pages())
    try:
        ready: dict[str, object] = {"socket": str(service.path), "pid": os.getpid(), "store": str(cfg.path)}
        if metrics is not None:
            ready["metrics"] = f"http://{metrics[0]}:{service.start_metrics(*metrics)}/metrics"
        announce(json.dumps(ready) if args.json else
                 f"tierkv serve: store {cfg.path} on {service.path} (pid {os.getpid()})"
                 + (f", metrics at {ready['metrics']}" if metrics else ""))
        _notify_systemd()
        while not stop.wait(1.0):
            pass
        logging.getLogger("tierkv.serve").info("stopping: closing %d connections and the store", service.clients)
    finally:
        service.close()
    return EXIT_OK


def _notify_systemd() -> None:
    """``READY=1`` to systemd's notify socket, where there is one (``Type=notify``)."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    addr = "\0" + path[1:] if path.startswith("@") else path
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(b"READY=1", addr)
        except OSError as exc:
            logging.getLogger("tierkv.serve").warning("could not tell systemd the daemon is ready: %s", exc)


def _detach(cfg: Any, args: argparse.Namespace, mode: int | None, metrics: tuple[str, int] | None) -> int:
    """Fork a daemon in a new session; return once it listens (its line printed here) or
    with its error."""
    from pathlib import Path

    log_path = Path(cfg.path) / "serve.log"
    Path(cfg.path).mkdir(parents=True, exist_ok=True, mode=0o700)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the daemon
        os.close(r)
        os.setsid()
        os.chdir("/")   # holds no file system busy; every path it uses was made absolute before
        code = EXIT_FAILED
        told: list[str] = []
        try:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            logging.basicConfig(level=args.log_level, filename=str(log_path),
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")

            def announce(line: str) -> None:
                told.append(line)
                os.write(w, ("ok " + line + "\n").encode())
                os.close(w)
            code = _run(cfg, args, mode, metrics, announce)
        except BaseException as exc:  # noqa: BLE001 - told to the waiting parent, if it still waits
            logging.getLogger("tierkv.serve").exception("the daemon failed")
            if not told:
                try:
                    os.write(w, f"error {type(exc).__name__}: {exc}\n".encode())
                except OSError:
                    pass
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        line = f.readline()
    if line.startswith("ok "):
        print(line[3:], end="", flush=True)
        return EXIT_OK
    os.waitpid(pid, 0)
    message = line[6:].strip() if line.startswith("error ") else f"the daemon exited; see {log_path}"
    print(f"tierkv: {message}", file=sys.stderr)
    return EXIT_FAILED
