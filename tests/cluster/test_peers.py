"""Nodes of a cluster fetch each other's DRAM pages with no [peers] fetch list: the members
of one model and layout are the peers (a real etcd, two daemons in this process)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tierkv.cluster.etcd import Etcd
from tierkv.cluster.local import LocalEtcd
from tierkv.cluster.members import NodeView
from tierkv.config import ClusterConfig, DramConfig, NvmeConfig, PeersConfig, StoreConfig
from tierkv.serve.daemon import NodeService
from tierkv.store import peering
from tierkv.tiers.base import TierKind
from tests.conftest import LAYOUT, PB, page_data
from tests.polling import wait_for
from tests.store.test_peering import secret_file


def node(tmp_path: Path, sock_dir: Path, etcd: LocalEtcd, name: str, model: str = "m") -> NodeService:
    cfg = StoreConfig(path=str(tmp_path / name), model_id=model, layout=LAYOUT, dram=DramConfig(16 * PB),
                      nvme=NvmeConfig(32 * PB), policy="lru",
                      peers=PeersConfig(serve="127.0.0.1:0", transport="tcp", timeout_s=1.0,
                                        secret_file=secret_file(tmp_path)),
                      cluster=ClusterConfig((etcd.endpoint,), "c", name, lease_ttl_s=6))
    return NodeService(cfg, sock_dir / f"{name}.sock").start()


def test_a_node_fetches_what_another_member_holds_and_forgets_a_member_that_left(
        etcd: LocalEtcd, tmp_path: Path, sock_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peering, "LOOKUP_TIMEOUT_S", 5.0)   # three daemons on two busy cores: no late answer
    services: list[NodeService] = []
    try:
        run(etcd, tmp_path, sock_dir, services)
    finally:
        for svc in services:
            svc.close()


def run(etcd: LocalEtcd, tmp_path: Path, sock_dir: Path, services: list[NodeService]) -> None:
    a = node(tmp_path, sock_dir, etcd, "a")
    services.append(a)
    b = node(tmp_path, sock_dir, etcd, "b")
    services.append(b)
    services.append(node(tmp_path, sock_dir, etcd, "x", model="another-model"))   # never a peer of a or b
    a_ep = a.store.peer_address
    assert a_ep is not None
    assert wait_for(lambda: b.store.fetch_peers() == [a_ep], 10)
    assert b.status()["cluster"]["fetch_peers"] == [f"{a_ep[0]}:{a_ep[1]}"]
    tokens = np.random.default_rng(3).integers(0, 50_000, 4 * LAYOUT.tokens_per_page)
    data = page_data(3, 4)
    a.store.put(tokens, data)
    assert wait_for(lambda: b.store.lookup(tokens).cached_pages == 4, 5)  # seen on a (once connected)
    out = np.zeros((4, PB), np.uint8)
    got = b.store.get(tokens, out)
    assert got.pages == 4 and got.tiers == (TierKind.PEER,) * 4 and np.array_equal(out, data)
    view = NodeView(Etcd([etcd.endpoint]), "c").start()
    assert view.wait(lambda n: {"a", "b", "x"} <= set(n), 5)
    a.close()
    assert wait_for(lambda: b.store.fetch_peers() == [], 10)               # a left: not asked any more
    assert view.wait(lambda n: "a" not in n, 5)
    view.close()
