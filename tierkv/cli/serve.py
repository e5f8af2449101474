"""``tierkv serve --config FILE [--socket PATH] [--mode 0600] [--json]``: run the node service.

Registered by ``tierkv.cli.main``. Opens the store the config describes and serves it
on a Unix socket (:mod:`tierkv.serve.daemon`) until SIGTERM or SIGINT, then closes it
as an in-process close does (volatile pages written back, the index left clean). It
runs in the foreground and logs to stderr: a service manager (the example systemd unit
in ``configs/``) keeps it running. Once it listens it prints one line (``--json``: one
JSON object with the socket, pid and store) so a script can wait for it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

from tierkv.cli.exits import EXIT_OK
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
    p.add_argument("--json", action="store_true", help="announce the listening socket as one JSON object")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(handler=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tierkv.config import load_config
    from tierkv.serve.daemon import NodeService

    mode = None
    if args.mode is not None:
        try:
            mode = int(args.mode, 8)
        except ValueError:
            mode = -1
        if not 0 <= mode <= 0o777:
            raise InputError(f"--mode must be octal permission bits such as 0600 or 0660, got {args.mode!r}")
    if args.max_clients is not None and args.max_clients < 1:
        raise InputError(f"--max-clients must be at least 1, got {args.max_clients}")
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    service = NodeService(cfg, Path(args.socket) if args.socket else None, mode=mode,
                          max_clients=args.max_clients).start()
    try:
        ready = {"socket": str(service.path), "pid": os.getpid(), "store": str(cfg.path)}
        print(json.dumps(ready) if args.json else f"tierkv serve: store {cfg.path} on {service.path} "
              f"(pid {os.getpid()})", flush=True)
        while not stop.wait(1.0):
            pass
        logging.getLogger("tierkv.serve").info("stopping: closing %d connections and the store", service.clients)
    finally:
        service.close()
    return EXIT_OK
