"""Routing hints against a real etcd and three daemons: members ordered by the leading pages
of a prompt they hold; a member that cannot be reached is left out, never waited for."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tierkv.cluster.directory import anchor_key, pages_prefix
from tierkv.cluster.etcd import Etcd
from tierkv.cluster.local import LocalEtcd, free_port
from tierkv.cluster.members import NodeRecord, layout_digest, nodes_prefix
from tierkv.cluster import best_nodes
from tierkv.cluster.routing import Holding, Router, close_routers
from tierkv.config import ClusterConfig, DramConfig, PeersConfig, StoreConfig
from tierkv.errors import ConfigError
from tierkv.keys import PageKey, as_token_array, chain_keys, namespace_digest, split_keys, tenant_salt
from tierkv.serve.daemon import NodeService
from tests.conftest import LAYOUT, PB, page_data
from tests.polling import wait_for
from tests.store.test_peering import secret_file


def config(tmp_path: Path, etcd: LocalEtcd, name: str, serve: str | None = "127.0.0.1:0") -> StoreConfig:
    return StoreConfig(path=str(tmp_path / name), model_id="m", layout=LAYOUT, dram=DramConfig(16 * PB),
                       peers=PeersConfig(serve=serve, transport="tcp", timeout_s=2.0, secret_file=secret_file(tmp_path)),
                       cluster=ClusterConfig((etcd.endpoint,), "c", name, lease_ttl_s=6))


def router_keys(tokens: np.ndarray, tenant: str = "") -> list[PageKey]:
    return split_keys(chain_keys(as_token_array(tokens), LAYOUT.tokens_per_page,
                                 namespace_digest("m", LAYOUT, tenant_salt(tenant))))


def test_best_nodes_orders_members_by_the_prompts_leading_pages_they_hold(
        etcd: LocalEtcd, tmp_path: Path, sock_dir: Path) -> None:
    services = [NodeService(config(tmp_path, etcd, n), sock_dir / f"{n}.sock").start() for n in ("a", "b", "c")]
    router = Router(config(tmp_path, etcd, "router", serve=None), timeout_s=5.0)
    try:
        a, b, _c = services
        tokens = np.random.default_rng(9).integers(0, 50_000, 4 * LAYOUT.tokens_per_page)
        data = page_data(9, 4)
        a.store.put(tokens, data)
        b.store.put(tokens[: 2 * LAYOUT.tokens_per_page], data[:2])
        assert wait_for(lambda: len(router.members()) == 3, 10)
        # Published within a batch's delay (50 ms) of the put, once the nodes hold their leases.
        assert router.directory.wait(lambda d: d.holders(router_keys(tokens)) == {"a": 4, "b": 2}, 10)
        assert router.best_nodes(tokens) == [Holding("a", 4, "dram", f"127.0.0.1:{a.store.peer_address[1]}"),  # type: ignore[index]
                                             Holding("b", 2, "dram", f"127.0.0.1:{b.store.peer_address[1]}"),  # type: ignore[index]
                                             Holding("c", 0, "dram", router._view.nodes()["c"].peer or "")]
        assert [h.pages for h in router.best_nodes(tokens, tenant="other")] == [0, 0, 0]   # salted apart
        # The directory names a and b: c is listed unasked (0 pages).
        # A member whose published address answers nothing is left out, quickly, when it is
        # asked: by the directory's anchors, or while the directory is stale (all are asked).
        ghost = NodeRecord("ghost", 1, "m", layout_digest(LAYOUT), peer=f"127.0.0.1:{free_port()}")
        client = Etcd([etcd.endpoint])
        client.put(nodes_prefix("c") + b"ghost", ghost.encode())
        assert wait_for(lambda: len(router.members()) == 4, 10)
        assert [(h.node, h.pages) for h in router.best_nodes(tokens)] == [("a", 4), ("b", 2), ("c", 0), ("ghost", 0)]
        client.put(anchor_key(pages_prefix("c"), router_keys(tokens)[0], "ghost"), b"dram")   # under no lease: epoch 0
        client.put(nodes_prefix("c") + b"ghost", NodeRecord("ghost", 0, "m", layout_digest(LAYOUT),
                                                            peer=ghost.peer).encode())
        assert router.directory.wait(lambda d: "ghost" in d.holders(router_keys(tokens)), 5)
        assert wait_for(lambda: any(r.node == "ghost" and r.epoch == 0 for r in router.members()), 5)
        started = time.monotonic()
        assert [h.node for h in router.best_nodes(tokens)] == ["a", "b", "c"]
        assert time.monotonic() - started < 4.0
        # The module's function, by config: one router kept per config.
        cfg = config(tmp_path, etcd, "router2", serve=None)
        assert wait_for(lambda: [(h.node, h.pages) for h in best_nodes(tokens, config=cfg, timeout_s=5.0)][:2]
                        == [("a", 4), ("b", 2)], 10)
    finally:
        close_routers()
        router.close()
        for svc in services:
            svc.close()


def test_a_router_needs_the_cluster_and_the_peers_secret(etcd: LocalEtcd, tmp_path: Path) -> None:
    cfg = config(tmp_path, etcd, "r", serve=None)
    with pytest.raises(ConfigError, match="needs a \\[cluster\\] table"):
        Router(StoreConfig(path=cfg.path, model_id="m", layout=LAYOUT, dram=DramConfig(PB), peers=cfg.peers))
    with pytest.raises(ConfigError, match="needs \\[peers\\] secret_file"):
        Router(StoreConfig(path=cfg.path, model_id="m", layout=LAYOUT, dram=DramConfig(PB), cluster=cfg.cluster))
