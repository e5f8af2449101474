"""``tierkv bench cluster``: the page directory and cross-node lookups of a local cluster.

A real etcd and ``nodes`` node daemons (``tierkv cluster up``'s :class:`LocalCluster`,
each ``tierkv serve`` a process of its own, 4 KiB pages, a DRAM tier served to the others
over TCP on loopback) with a lease of ``lease_ttl_s``. Measured, in one run:

- ``publish_pages_per_s``: ``pages`` new pages (prompts of 64 pages) put through node1's
  socket, from the first put until this process's own directory (a watch of etcd, as
  every node keeps) holds every anchor of them; beside ``put_pages_per_s``, the puts
  alone (the baseline: what the store takes in without a cluster to tell).
- ``lookup_p50_ms`` / ``lookup_p99_ms``: ``Store.lookup`` through node2's socket of a
  64-page prefix only node1 holds (node2 finds its anchors in its directory and asks
  node1 how far it holds), beside ``local_lookup_p50_ms`` / ``local_lookup_p99_ms``: the
  same lookup of a prefix node2 holds itself, through the same socket (the baseline:
  the client round trip). ``best_nodes_p50_ms`` / ``best_nodes_p99_ms``: the routing
  hint (:class:`~tierkv.cluster.routing.Router`) for the same prefixes, from this process.
- ``etcd_bytes_per_page``: the growth of etcd's store in use (``dbSizeInUse``) over the
  pages published; ``etcd_keys_per_page``: anchors per page; ``etcd_bytes_at_1e8_pages``:
  the first times 10^8 (100 nodes holding a million pages each).
  ``follower_bytes_per_anchor``: the memory a follower's table of the anchors takes
  (tracemalloc; each anchor's holder numbered as a hundredth node's), and
  ``follower_bytes_at_1e8_pages`` what each node would hold at 10^8.
- ``failover_s``: node1 is SIGKILLed; the time until node2 no longer fetches from it
  (``fetch_peers`` in its status: the members its gets and lookups ask) and neither the
  members nor the directory as this process follows them name it.
  Lookups through node2 go on meanwhile: ``failover_lookup_max_ms`` is the slowest, and
  ``failover_wrong`` counts lookups that claimed any page (node1 is dead and node2 never
  held the prompt: none may). A run where node1 is still named 3 leases + 10 s later
  raises TimeoutError.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from tierkv.keys import PageKey, as_token_array, chain_keys, namespace_digest, split_keys, tenant_salt
from tierkv.layout import KVLayout

#: 1 layer of 1 KV head of 64 dims in bf16, 16 tokens a page: 4 KiB pages, so that the
#: directory, not copying, is what is timed.
LAYOUT: dict[str, Any] = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 64, "dtype": "bf16", "tokens_per_page": 16}
PROMPT_PAGES = 64
MODEL = "tierkv-bench-cluster"


def _tokens(i: int, pages: int = PROMPT_PAGES) -> np.ndarray:
    return (np.arange(pages * 16, dtype=np.int64) + (i + 1) * 1_000_003) % 2_000_000_000


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _ms(samples: list[float]) -> tuple[float, float]:
    return round(statistics.median(samples) * 1e3, 3), round(_pct(samples, 0.99) * 1e3, 3)


def run_cluster_bench(nodes: int = 3, pages: int = 32768, lookups: int = 1000, lease_ttl_s: int = 10,
                      where: str | None = None, step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the benchmark (module docstring); ``step`` is told each phase as it starts."""
    from tierkv.cluster.directory import Directory
    from tierkv.cluster.etcd import Etcd
    from tierkv.cluster.local import LocalCluster
    from tierkv.cluster.members import NodeView
    from tierkv.cluster.routing import Router
    from tierkv.config import ClusterConfig, DramConfig, PeersConfig, StoreConfig
    from tierkv.serve.client import connect

    if nodes < 2:
        raise ValueError(f"the cluster benchmark needs at least 2 nodes, got {nodes}")
    prompts = max(1, pages // PROMPT_PAGES)
    pages = prompts * PROMPT_PAGES
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="bf16", tokens_per_page=16)   # LAYOUT
    say = step or (lambda _what: None)
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-cluster-", dir=where) as tmp, ExitStack() as stack:
        dram = f"{max(64, 2 * pages * layout.page_bytes >> 20)}MiB"
        cluster = LocalCluster(Path(tmp), nodes=nodes, name="bench", model_id=MODEL, dram=dram, nvme=None,
                               layout=LAYOUT, lease_ttl_s=lease_ttl_s)
        say(f"starting etcd and {nodes} node daemons")
        stack.callback(cluster.stop)   # last out: whatever fails below, no daemon or etcd outlives the run
        cluster.start()
        etcd = Etcd([cluster.etcd.endpoint])
        stack.callback(etcd.close)
        directory = Directory(etcd, "bench", check_s=0.5).start()
        stack.callback(directory.close)
        view = NodeView(etcd, "bench", check_s=0.5).start()
        stack.callback(view.close)
        timeout = min(2000, lease_ttl_s * 1000 // 3) / 1000
        router_cfg = StoreConfig(path=os.path.join(tmp, "router"), model_id=MODEL, layout=layout,
                                 dram=DramConfig(layout.page_bytes),
                                 peers=PeersConfig(transport="tcp", secret_file=os.path.join(tmp, "peers.secret")),
                                 cluster=ClusterConfig((cluster.etcd.endpoint,), "bench", "router",
                                                       lease_ttl_s=lease_ttl_s, timeout_s=timeout))
        router = stack.enter_context(Router(router_cfg, timeout_s=0.05))
        one = stack.enter_context(connect(cluster.daemons[0][2].socket))
        two = stack.enter_context(connect(cluster.daemons[1][2].socket))
        ns = namespace_digest(MODEL, layout, tenant_salt(""))
        # -- publishing -------------------------------------------------------------------
        say(f"putting {pages:,} pages through node1 until the directory holds their anchors")
        data = np.random.default_rng(1).integers(0, 256, (PROMPT_PAGES, layout.page_bytes), dtype=np.uint8)
        chains = [split_keys(chain_keys(as_token_array(_tokens(i)), 16, ns)) for i in range(prompts)]
        base_size, base_keys = etcd.db_size(), len(directory)
        started = time.perf_counter()
        for i in range(prompts):
            one.put(_tokens(i), data)
        put_s = time.perf_counter() - started
        want = base_keys + sum(1 for c in chains for p in _anchors(c))
        if not directory.wait(lambda d: len(d) >= want, 120):
            raise TimeoutError(f"the directory holds {len(directory)} anchors of {want} after 120 s")
        publish_s = time.perf_counter() - started
        anchors = len(directory) - base_keys
        time.sleep(1.0)   # etcd's size in use settles after its batch commit (100 ms)
        grown = etcd.db_size() - base_size
        follower = _table_bytes(etcd, directory)
        # -- lookups ----------------------------------------------------------------------
        say(f"{lookups} lookups through node2 of 64-page prefixes node1 holds, and of its own")
        own = [prompts + 1 + i for i in range(min(64, prompts))]
        for i in own:
            two.put(_tokens(i), data)
        deadline = time.monotonic() + 30
        while two.lookup(_tokens(0)).cached_pages < PROMPT_PAGES:   # node2 connected to node1, anchors seen
            if time.monotonic() > deadline:
                raise TimeoutError("node2 did not find node1's pages within 30 s")
            time.sleep(0.05)
        remote, local, hints, wrong = [], [], [], 0
        for j in range(lookups):
            t0 = time.perf_counter()
            got = two.lookup(_tokens(j % prompts)).cached_pages
            remote.append(time.perf_counter() - t0)
            wrong += got != PROMPT_PAGES
            t0 = time.perf_counter()
            local_got = two.lookup(_tokens(own[j % len(own)])).cached_pages
            local.append(time.perf_counter() - t0)
            wrong += local_got != PROMPT_PAGES
            t0 = time.perf_counter()
            best = router.best_nodes(_tokens(j % prompts))
            hints.append(time.perf_counter() - t0)
            wrong += not best or best[0].node != "node1" or best[0].pages != PROMPT_PAGES
        # -- failover ---------------------------------------------------------------------
        say(f"SIGKILL node1; waiting for its lease ({lease_ttl_s} s) to end")
        proc = cluster.daemons[0][2].proc
        assert proc is not None
        node1 = _peer_of(view, "node1")
        first = chains[0]
        during: list[float] = []
        failover_wrong = 0
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
        gone_at = None
        while time.monotonic() - killed < 3 * lease_ttl_s + 10:
            # Named while node2 still fetches from it (its members' view, what its lookups
            # ask), or a follower's members or directory still hold it.
            named = (node1 in two.status()["cluster"].get("fetch_peers", []) or "node1" in view.nodes()
                     or "node1" in directory.holders(first))
            if not named:
                gone_at = time.monotonic()
                break
            t0 = time.perf_counter()
            got = two.lookup(_tokens(0)).cached_pages
            during.append(time.perf_counter() - t0)
            failover_wrong += got != 0   # node1 is dead and node2 never held prompt 0
            time.sleep(0.02)
        if gone_at is None:
            raise TimeoutError(f"node1 was still named {3 * lease_ttl_s + 10} s after its SIGKILL")
        failover_wrong += two.lookup(_tokens(0)).cached_pages != 0
    p50, p99 = _ms(remote)
    l50, l99 = _ms(local)
    b50, b99 = _ms(hints)
    per_page = grown / pages
    return {
        "suite": "cluster", "nodes": nodes, "pages": pages, "page_bytes": layout.page_bytes,
        "lease_ttl_s": lease_ttl_s, "lookups": lookups,
        "put_pages_per_s": round(pages / put_s), "publish_pages_per_s": round(pages / publish_s),
        "publish_vs_put": round(put_s / publish_s, 3),
        "lookup_p50_ms": p50, "lookup_p99_ms": p99, "local_lookup_p50_ms": l50, "local_lookup_p99_ms": l99,
        "lookup_p50_vs_local": round(p50 / l50, 3) if l50 else None,
        "best_nodes_p50_ms": b50, "best_nodes_p99_ms": b99,
        "anchors": anchors, "etcd_keys_per_page": round(anchors / pages, 4),
        "etcd_bytes_per_page": round(per_page, 2), "etcd_bytes_at_1e8_pages": round(per_page * 1e8),
        "follower_bytes_per_anchor": round(follower, 1),
        "follower_bytes_at_1e8_pages": round(follower * anchors / pages * 1e8),
        "failover_s": round(gone_at - killed, 3),
        "failover_lookups": len(during), "failover_lookup_max_ms": round(max(during) * 1e3, 3) if during else None,
        "failover_wrong": failover_wrong, "mismatches": wrong,
    }


def _peer_of(view: Any, node: str) -> str:
    rec = view.nodes().get(node)
    if rec is None or rec.peer is None:
        raise RuntimeError(f"{node} is not a member serving pages")
    return str(rec.peer)


def _table_bytes(etcd: Any, directory: Any) -> float:
    """The memory per anchor a follower's table of every anchor in etcd takes
    (tracemalloc), with holders numbered as the hundredth node's would be: a mask of one
    low bit is a small int CPython does not allocate, which would flatter the figure."""
    import tracemalloc

    from tierkv.cluster.directory import AnchorTable

    _rev, kvs = etcd.get_prefix_paged(directory.prefix, keys_only=True)
    table = AnchorTable()
    for i in range(99):   # 99 other nodes' holder numbers, taken first
        table.add(bytes(16), f"other{i}", i + 1)
    tracemalloc.start()
    try:
        n = 0
        for kv in kvs:   # as a follower does: each key parsed (the page key made), then kept
            parsed = directory._parse(kv.key)
            if parsed is not None:
                table.add(parsed[0], parsed[1], kv.lease)
                n += 1
        return tracemalloc.get_traced_memory()[0] / max(1, n)
    finally:
        tracemalloc.stop()


def _anchors(chain: list[PageKey]) -> list[int]:
    from tierkv.cluster.directory import anchor_positions

    return anchor_positions(chain)
