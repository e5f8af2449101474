"""``tierkv status [--socket PATH | --config FILE] [--json]``: a running ``tierkv serve``.

Registered by ``tierkv.cli.main``. Shows the daemon's pid, uptime, connections and
requests, each client's pid, user and requests (for a user that may use every tenant),
and the store's occupancy and hit rates per tier. Exit status 1 when no daemon answers
(``--json`` then prints ``{"running": false, "error": ...}``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tierkv.cli.exits import EXIT_FAILED, EXIT_OK
from tierkv.errors import InputError, TierKVError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add ``status`` to ``tierkv``'s subparsers."""
    st = subparsers.add_parser("status", help="show a running tierkv serve daemon: clients, occupancy, hit rates",
                               description="Connect to a tierkv serve daemon and show its status.")
    where = st.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH", help="the daemon's socket")
    where.add_argument("--config", metavar="FILE", help="the store's config (its [serve] socket, else tierkv.sock "
                       "in its directory)")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.set_defaults(handler=cmd_status)
    return st


def cmd_status(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tierkv.store.api import Store

    if args.socket:
        sock = Path(args.socket)
    elif args.config:
        from tierkv.config import load_config

        cfg = load_config(args.config)
        sock = cfg.socket_path()
    else:
        raise InputError("tierkv status needs --socket PATH or --config FILE")
    try:
        with Store.connect(sock, timeout_s=10) as client:
            st = client.status()
    except TierKVError as exc:
        if args.json:
            print(json.dumps({"socket": str(sock), "running": False, "error": str(exc)}))
            return EXIT_FAILED
        raise
    st["running"] = True
    if args.json:
        print(json.dumps(st))
        return EXIT_OK
    _print_status(st)
    return EXIT_OK


def _print_status(st: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from tierkv.units import format_size

    console = Console()
    stats = st["stats"]
    console.print(f"tierkv serve {st['version']} (pid {st['pid']}) on {st['socket']}: store {st['store']}, "
                  f"model {st['model_id']}; up {st['uptime_s']:.0f} s, {st['connections']} connections, "
                  f"{st['requests']:,} requests; access {st['access']}")
    tiers = Table(title=f"tiers (hit rate {stats['hit_rate']:.3f}: {stats['pages_hit']:,} of "
                        f"{stats['pages_requested']:,} pages asked for)")
    for col in ("tier", "kind", "state", "used / slots", "occupancy", "hits", "read", "written"):
        tiers.add_column(col, justify="left" if col in ("tier", "kind", "state") else "right")
    for name, t in stats["tiers"].items():
        tiers.add_row(name, t["kind"], t["state"], f"{t['used_slots']:,} / {t['capacity_slots']:,}",
                      f"{t['occupancy']:.3f}", f"{t['hits']:,}", format_size(t["bytes_read"]),
                      format_size(t["bytes_written"]))
    console.print(tiers)
    for name, t in stats["tiers"].items():
        codec = t.get("codec")
        if codec and codec.get("mode") != "none":
            console.print(f"{name} codec: {codec['reason']}", markup=False)
    if stats.get("page_table_bytes"):   # absent from older daemons
        measured = {name: t["policy_bytes"] for name, t in stats["tiers"].items() if t.get("policy_bytes") is not None}
        policies = ", ".join(f"{name} {format_size(b)}" for name, b in measured.items()) or "not measured"
        console.print(f"page metadata: page table {format_size(stats['page_table_bytes'])}; policies: {policies}; "
                      f"index file {format_size(stats.get('index_file_bytes', 0))} on disk",
                      markup=False)
    if stats.get("derived_pages") or stats.get("lossy_pages") or stats.get("lossy_converted") \
            or stats.get("lossy_pending") or stats.get("lossy_waiting"):
        console.print(f"approximate pages served: {stats.get('derived_pages', 0):,} derived, "
                      f"{stats.get('lossy_pages', 0):,} lossy; the lossy tier converted "
                      f"{stats.get('lossy_converted', 0):,}, {stats.get('lossy_pending', 0):,} queued, "
                      f"{stats.get('lossy_waiting', 0):,} kept back")
    if "clients" in st:
        clients = Table(title="clients")
        for col in ("pid", "user", "connected s", "requests"):
            clients.add_column(col, justify="left" if col == "user" else "right")
        for c in st["clients"]:
            clients.add_row(str(c["pid"]), c["user"], f"{c['connected_s']:.0f}", f"{c['requests']:,}")
        console.print(clients)
