"""Members of a cluster (a real etcd in the guest) fetching each other's pages over soft-RoCE:
two node daemons with ``[peers] transport = "rdma"`` find each other in etcd, the page
directory names the member that holds a prefix, and a get loads it by one-sided READs,
bit-exact, and keeps it."""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from tests.net.peers import free_port
from tests.rig.conftest import RIG_ADDR

pytest.importorskip("pyverbs")
if importlib.util.find_spec("etcd3gw") is None or shutil.which("etcd") is None:
    pytest.skip("needs etcd and etcd3gw in the guest (tools/rig/setup.sh)", allow_module_level=True)

from tierkv.cluster.local import LocalEtcd  # noqa: E402
from tierkv.config import ClusterConfig, DramConfig, PeersConfig, StoreConfig  # noqa: E402
from tierkv.layout import KVLayout  # noqa: E402
from tierkv.net import rdma_available  # noqa: E402
from tierkv.serve.daemon import NodeService  # noqa: E402
from tierkv.tiers.base import TierKind  # noqa: E402

pytestmark = [pytest.mark.rdma, pytest.mark.skipif(not rdma_available(), reason="no RDMA device")]
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_page=16)
PB = LAYOUT.page_bytes


def node(tmp_path: Path, etcd: LocalEtcd, name: str) -> NodeService:
    secret = tmp_path / "peers.secret"
    if not secret.exists():
        secret.write_bytes(b"rig-cluster-secret-0123456789abcdef")
        secret.chmod(0o600)
    cfg = StoreConfig(path=str(tmp_path / name), model_id="rig", layout=LAYOUT, dram=DramConfig(64 * PB),
                      peers=PeersConfig(serve=f"{RIG_ADDR}:{free_port()}", transport="rdma", timeout_s=5.0,
                                        secret_file=str(secret)),
                      cluster=ClusterConfig((etcd.endpoint,), "rig", name, lease_ttl_s=10))
    return NodeService(cfg, tmp_path / f"{name}.sock").start()


def test_cluster_members_fetch_over_rdma(tmp_path: Path) -> None:
    etcd = LocalEtcd(tmp_path / "etcd").start()
    services: list[NodeService] = []
    try:
        a = node(tmp_path, etcd, "a")
        services.append(a)
        b = node(tmp_path, etcd, "b")
        services.append(b)
        tokens = np.random.default_rng(1).integers(0, 50000, 40 * LAYOUT.tokens_per_page, dtype=np.int64)
        data = np.random.default_rng(2).integers(0, 256, (40, PB), dtype=np.uint8)
        a.store.put(tokens, data)
        deadline = time.monotonic() + 120
        while b.store.lookup(tokens).cached_pages < 40:   # a's record, its anchors, b's RDMA connection
            assert time.monotonic() < deadline, "b never saw a's pages"
            time.sleep(0.2)
        assert b.status()["cluster"]["directory"]["anchors"] >= 6
        from tierkv.keys import as_token_array, chain_keys, namespace_digest, split_keys, tenant_salt

        keys = split_keys(chain_keys(as_token_array(tokens), LAYOUT.tokens_per_page,
                                     namespace_digest("rig", LAYOUT, tenant_salt(""))))
        assert b._cluster._route(keys) == [a.store.peer_address]   # the directory named a (not every member)
        out = np.zeros((40, PB), np.uint8)
        got = b.store.get(tokens, out)
        assert got.pages == 40 and got.tiers == (TierKind.PEER,) * 40
        np.testing.assert_array_equal(out, data)
        out = np.zeros((40, PB), np.uint8)
        got = b.store.get(tokens, out)            # kept in b's own DRAM
        assert got.pages == 40 and TierKind.PEER not in got.tiers
        np.testing.assert_array_equal(out, data)
    finally:
        for svc in services:
            svc.close()
        etcd.stop()
