"""``tierkv cluster nodes|up``: a tierkv cluster kept in etcd (docs/cluster.md).

Registered by ``tierkv.cli.main``.

- ``nodes [--config FILE | --etcd HOST:PORT ... --name NAME] [--json]``: the nodes
  registered in a cluster's etcd: each node's name, lease (its epoch), model, peer address,
  tiers and age. Exit status 1 when etcd does not answer (``--json`` then prints
  ``{"cluster": ..., "error": ...}``).
- ``up [--nodes N] [--dir DIR] [--name NAME] [--json]``: a local cluster to try: an etcd
  and N node daemons on loopback, fetching from each other; prints where each listens
  (``--json``: one line once all are up) and runs until interrupted (Ctrl-C, SIGTERM),
  then stops them all (a temporary ``--dir`` is removed).
"""

from __future__ import annotations

import argparse
import json
import time

from tierkv.cli.exits import EXIT_FAILED, EXIT_OK
from tierkv.errors import ClusterUnavailableError, InputError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add ``cluster`` to ``tierkv``'s subparsers."""
    cl = subparsers.add_parser("cluster", help="the nodes of a tierkv cluster kept in etcd",
                               description="Show a tierkv cluster kept in etcd (docs/cluster.md).")
    sub = cl.add_subparsers(dest="cluster_command", required=True)
    nodes = sub.add_parser("nodes", help="list the cluster's live nodes",
                           description="List the nodes registered in the cluster, from etcd.")
    where = nodes.add_mutually_exclusive_group()
    where.add_argument("--config", metavar="FILE", help="a node's config: its [cluster] etcd and name")
    where.add_argument("--etcd", metavar="HOST:PORT", action="append", help="an etcd endpoint (repeatable)")
    nodes.add_argument("--name", metavar="NAME", default=None, help="the cluster's name (with --etcd; default "
                       "\"default\")")
    nodes.add_argument("--timeout", metavar="S", type=float, default=2.0, help="etcd's deadline (default 2 s)")
    nodes.add_argument("--json", action="store_true", help="print one JSON object")
    nodes.set_defaults(handler=cmd_nodes)
    up = sub.add_parser("up", help="run a local cluster to try: etcd and N node daemons on loopback",
                        description="Start a local etcd and N tierkv serve daemons on loopback, members of one "
                        "cluster that fetch each other's pages; run until interrupted, then stop them all.")
    up.add_argument("--nodes", metavar="N", type=int, default=3, help="node daemons (1-16; default 3)")
    up.add_argument("--dir", metavar="DIR", help="where the stores, configs and logs go (kept); default a "
                    "temporary folder, removed at the end")
    up.add_argument("--name", metavar="NAME", default="local", help="the cluster's name (default \"local\")")
    up.add_argument("--json", action="store_true", help="print one JSON line once every node is up")
    up.set_defaults(handler=cmd_up)
    return cl


def cmd_up(args: argparse.Namespace) -> int:
    import shutil
    import signal
    import sys
    import tempfile
    import threading
    from pathlib import Path

    from tierkv.cluster.local import LocalCluster
    from tierkv.cluster.members import check_name

    check_name(args.name, "--name")
    if not 1 <= args.nodes <= 16:
        raise InputError(f"--nodes must be 1 to 16, got {args.nodes}")
    if args.dir and Path(args.dir).exists() and any(Path(args.dir).iterdir()):
        raise InputError(f"--dir {args.dir} is not empty: give tierkv cluster up an empty or new folder")
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tierkv-cluster-"))
    stop = threading.Event()

    def interrupted(*_: object) -> None:   # while starting: stop starting (what started is stopped)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupted)
    cluster = LocalCluster(workdir, nodes=args.nodes, name=args.name)
    try:
        cluster.start(step=None if args.json else lambda what: print(f"up: {what}", file=sys.stderr, flush=True))
        for sig in (signal.SIGINT, signal.SIGTERM):   # up: an interrupt now ends the run normally
            signal.signal(sig, lambda *_: stop.set())
        info = cluster.describe()
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            print(f"cluster {info['cluster']}: etcd {info['etcd']}, {len(cluster.daemons)} nodes of model "
                  f"{info['model_id']} (stores, configs and logs in {workdir})")
            for n in info["nodes"]:   # type: ignore[attr-defined]
                print(f"  {n['node']}: socket {n['socket']}, peer {n['peer']}, config {n['config']}")
            print("Ctrl-C stops them all.", flush=True)
        while not stop.wait(0.5):
            if any(d.proc is None or d.proc.poll() is not None for _, _, d in cluster.daemons):
                print("tierkv cluster up: a node daemon exited; stopping the cluster", file=sys.stderr)
                return EXIT_FAILED
        return EXIT_OK
    finally:
        cluster.stop()
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)


def cmd_nodes(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from tierkv.cluster.etcd import Etcd
    from tierkv.cluster.members import NodeRecord, check_name, nodes_prefix

    if args.config:
        from tierkv.config import load_config

        cfg = load_config(args.config)
        if cfg.cluster is None:
            raise InputError(f"{args.config} has no [cluster] table: it names no etcd and cluster")
        endpoints, name, timeout = list(cfg.cluster.etcd), cfg.cluster.name, cfg.cluster.timeout_s
        if args.name is not None:
            raise InputError("--name goes with --etcd; with --config the cluster is the config's [cluster] name")
    elif args.etcd:
        endpoints, name, timeout = args.etcd, check_name(args.name or "default", "--name"), args.timeout
    else:
        raise InputError("tierkv cluster nodes needs --config FILE or --etcd HOST:PORT")
    if not timeout > 0:
        raise InputError(f"--timeout must be a positive number of seconds, got {timeout!r}")
    etcd = Etcd(endpoints, timeout)
    try:
        revision, kvs = etcd.get_prefix(nodes_prefix(name))
    except ClusterUnavailableError as exc:
        if args.json:
            print(json.dumps({"cluster": name, "etcd": endpoints, "error": str(exc)}))
            return EXIT_FAILED
        raise
    finally:
        etcd.close()
    records = []
    for kv in kvs:
        try:
            records.append(NodeRecord.decode(kv.value))
        except InputError:
            continue
    if args.json:
        print(json.dumps({"cluster": name, "etcd": endpoints, "revision": revision,
                          "nodes": [asdict(r) for r in records]}))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cluster {name}: {len(records)} node(s) (etcd {', '.join(endpoints)}, revision {revision})")
    for col in ("node", "lease", "model", "peer", "tiers", "up s"):
        table.add_column(col, justify="right" if col == "up s" else "left")
    now = time.time()
    for r in records:
        table.add_row(r.node, f"{r.epoch:x}", r.model_id, r.peer or "-", ",".join(r.tiers) or "-",
                      f"{max(0.0, now - r.started):.0f}")
    Console().print(table)
    return EXIT_OK
