"""A cluster under failure, against a real etcd and real daemons: a node partitioned away in
a network namespace, a node SIGKILLed, etcd killed. Lookups never hang (each within its
deadline), gets never return bytes other than those put, every node keeps serving its own
tiers, and the cluster forgets a node within its lease and takes it back when it returns.
(docs/reliability.md records these.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tierkv.cluster.local import LocalEtcd, free_port
from tierkv.config import ClusterConfig, DramConfig, PeersConfig, StoreConfig
from tierkv.keys import PageKey, as_token_array, chain_keys, namespace_digest, split_keys, tenant_salt
from tierkv.serve.child import Daemon
from tierkv.serve.client import RemoteStore, connect
from tierkv.serve.daemon import NodeService
from tierkv.tiers.base import TierKind
from tests.cluster.conftest import needs_etcd
from tests.cluster.netns import NetNs
from tests.conftest import LAYOUT, PB, page_data
from tests.polling import wait_for
from tests.store.test_peering import secret_file

TPP = LAYOUT.tokens_per_page
TTL = 3
PAGES = 8


def keys_of(tokens: np.ndarray) -> list[PageKey]:
    return split_keys(chain_keys(as_token_array(tokens), TPP, namespace_digest("m", LAYOUT, tenant_salt(""))))


def prompt(i: int) -> np.ndarray:
    return np.arange(PAGES * TPP) + 1_000_000 * (i + 1)


def in_process(tmp_path: Path, sock_dir: Path, etcd: str, name: str, host: str = "127.0.0.1") -> NodeService:
    cfg = StoreConfig(path=str(tmp_path / name), model_id="m", layout=LAYOUT, dram=DramConfig(64 * PB),
                      policy="lru", peers=PeersConfig(serve=f"{host}:0", transport="tcp", timeout_s=1.0,
                                                      secret_file=secret_file(tmp_path)),
                      cluster=ClusterConfig((etcd,), "c", name, lease_ttl_s=TTL, timeout_s=1.0))
    return NodeService(cfg, sock_dir / f"{name}.sock").start()


def child(tmp_path: Path, sock_dir: Path, etcd: str, name: str, host: str, prefix: list[str] | None = None) -> Daemon:
    """A node daemon in a process of its own (in a network namespace with ``prefix``)."""
    q = json.dumps
    text = (f"[store]\npath = {q(str(tmp_path / name))}\nmodel_id = \"m\"\n\n[layout]\nnum_layers = {LAYOUT.num_layers}\n"
            f"num_kv_heads = {LAYOUT.num_kv_heads}\nhead_dim = {LAYOUT.head_dim}\ndtype = \"bf16\"\n"
            f"tokens_per_page = {TPP}\n\n[tiers.dram]\ncapacity_bytes = {64 * PB}\n\n"
            f"[serve]\nsocket = {q(str(sock_dir / (name + '.sock')))}\n\n"
            f"[peers]\nserve = \"{host}:0\"\ntransport = \"tcp\"\ntimeout_s = 1.0\n"
            f"secret_file = {q(secret_file(tmp_path))}\n\n"
            f"[cluster]\netcd = [{q(etcd)}]\nname = \"c\"\nnode = {q(name)}\nlease_ttl_s = {TTL}\ntimeout_s = 1.0\n")
    config = tmp_path / f"{name}.toml"
    config.write_text(text)
    return Daemon(config, tmp_path / f"{name}.log", prefix=prefix or ()).start(60)


@contextlib.contextmanager
def a_and_b(tmp_path: Path, sock_dir: Path, host: str = "127.0.0.1", b_host: str = "127.0.0.1",
            prefix: list[str] | None = None) -> Iterator[tuple[NodeService, Daemon]]:
    """A real etcd on ``host``, node a in this process, node b a daemon of its own (in a
    network namespace with ``prefix``); stopped in reverse order whatever happens."""
    with contextlib.ExitStack() as stack:
        etcd = LocalEtcd(tmp_path / "etcd", host=host).start()
        stack.callback(etcd.stop)
        a = in_process(tmp_path, sock_dir, etcd.endpoint, "a", host=host)
        stack.callback(a.close)
        b = child(tmp_path, sock_dir, etcd.endpoint, "b", b_host, prefix=prefix)
        stack.callback(b.stop)
        yield a, b


def bounded_lookup(store: NodeService, tokens: np.ndarray) -> int:
    """A lookup through the node's store, which must answer within a second whatever the cluster does."""
    t0 = time.monotonic()
    n = store.store.lookup(tokens).cached_pages
    assert time.monotonic() - t0 < 1.0, f"a lookup took {time.monotonic() - t0:.2f} s"
    return n


def checked_get(store: NodeService, tokens: np.ndarray, data: np.ndarray, limit_s: float) -> int:
    """A get that returns within ``limit_s`` and only the bytes that were put."""
    out = np.zeros((PAGES, PB), np.uint8)
    t0 = time.monotonic()
    got = store.store.get(tokens, out)
    assert time.monotonic() - t0 < limit_s, f"a get took {time.monotonic() - t0:.2f} s"
    assert np.array_equal(out[:got.pages], data[:got.pages])
    return got.pages


def member(remote: RemoteStore) -> bool:
    return bool(remote.status()["cluster"]["member"])


@needs_etcd
def test_a_node_partitioned_away_is_forgotten_within_its_lease_and_taken_back(
        netns: NetNs, tmp_path: Path, sock_dir: Path) -> None:
    with a_and_b(tmp_path, sock_dir, netns.host_ip, netns.ns_ip, netns.exec) as (a, b), connect(b.socket) as remote:
        x, y, z = prompt(1), prompt(2), prompt(3)
        data = page_data(5, PAGES)
        remote.put(x, data)
        remote.put(y, data)
        route = a._cluster._route
        assert wait_for(lambda: [h for h, _ in route(keys_of(y))] == [netns.ns_ip], 15)
        assert wait_for(lambda: bounded_lookup(a, y) == PAGES, 10)
        got = a.store.get(x, np.zeros((PAGES, PB), np.uint8))
        assert got.pages == PAGES and got.tiers == (TierKind.PEER,) * PAGES
        epoch = remote.status()["cluster"]["lease"]

        netns.cut()
        cut = time.monotonic()
        gone = None
        while time.monotonic() - cut < TTL + 8:
            assert bounded_lookup(a, y) in (0, PAGES)
            if gone is None and route(keys_of(y)) == [] and all(h != netns.ns_ip for h, _ in a.store.fetch_peers()):
                gone = time.monotonic() - cut
                assert bounded_lookup(a, y) == 0
                assert checked_get(a, y, data, 3.0) == 0
                break
            time.sleep(0.1)
        assert gone is not None and gone < TTL + 6, "the partitioned node stayed in a's view"
        # The partitioned node serves its own tiers all along, and knows etcd is away.
        out = np.zeros((PAGES, PB), np.uint8)
        assert remote.get(x, out).pages == PAGES and np.array_equal(out, data)
        remote.put(z, data)
        assert wait_for(lambda: remote.status()["cluster"]["etcd_away"], 5)

        netns.heal()
        assert wait_for(lambda: member(remote), 15)
        assert remote.status()["cluster"]["lease"] != epoch          # a new epoch: its old lease ran out
        assert wait_for(lambda: [h for h, _ in route(keys_of(z))] == [netns.ns_ip], 15)   # put while away
        assert wait_for(lambda: bounded_lookup(a, y) == PAGES, 15)
        assert checked_get(a, y, data, 3.0) == PAGES


@needs_etcd
def test_a_killed_node_is_skipped_at_once_and_forgotten_within_its_lease(tmp_path: Path, sock_dir: Path) -> None:
    with a_and_b(tmp_path, sock_dir) as (a, b):
        y = prompt(2)
        data = page_data(6, PAGES)
        with connect(b.socket) as remote:
            remote.put(y, data)
        assert wait_for(lambda: bounded_lookup(a, y) == PAGES, 15)
        assert b.proc is not None
        os.kill(b.proc.pid, signal.SIGKILL)
        b.proc.wait()
        killed = time.monotonic()
        rounds = 0
        while a._cluster._route(keys_of(y)):   # named until its lease ends: asked, refused, a miss
            assert bounded_lookup(a, y) == 0
            assert checked_get(a, y, data, 3.0) == 0
            assert time.monotonic() - killed < TTL + 5
            rounds += 1
            time.sleep(0.1)
        assert rounds > 0 and a._cluster._route(keys_of(y)) == []
        assert wait_for(lambda: a.store.fetch_peers() == [], 2)   # told by the members' watch, a stream of its own


@needs_etcd
def test_with_etcd_killed_nodes_serve_their_own_and_ask_every_member(tmp_path: Path, sock_dir: Path) -> None:
    etcd = LocalEtcd(tmp_path / "etcd", client_port=free_port()).start()
    services: list[NodeService] = []
    try:
        a = in_process(tmp_path, sock_dir, etcd.endpoint, "a")
        services.append(a)
        b = in_process(tmp_path, sock_dir, etcd.endpoint, "b")
        services.append(b)
        x, y = prompt(1), prompt(2)
        data = page_data(7, PAGES)
        b.store.put(x, data)
        b.store.put(y, data)
        assert wait_for(lambda: a._cluster._route(keys_of(y)) == [b.store.peer_address], 15)
        etcd.kill()
        assert wait_for(lambda: a._cluster.directory.stale, 5)
        assert a._cluster._route(keys_of(y)) is None          # the directory cannot say: every member is asked
        assert bounded_lookup(a, y) == PAGES
        assert checked_get(a, y, data, 3.0) == PAGES            # fetched from b without etcd
        assert checked_get(b, x, data, 3.0) == PAGES            # b's own tier
        etcd.start()
        assert wait_for(lambda: not a._cluster.directory.stale and a.status()["cluster"]["member"]
                        and b.status()["cluster"]["member"], 20)
        # b's anchors are named again once etcd is back (kept under its lease, or put again
        # under a new one if it ran out meanwhile).
        assert wait_for(lambda: set(a._cluster._route(keys_of(x)) or []) == {b.store.peer_address}, 15)
    finally:
        for svc in services:
            svc.close()
        etcd.stop()
