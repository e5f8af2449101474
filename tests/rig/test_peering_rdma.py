"""Two stores as two processes handing pages over soft-RoCE (``[peers]`` with
transport "rdma"), inside the rig guest: the decode store loads what the prefill store
holds, bit-exact, by one-sided READs, keeps it, and a killed prefill node is a miss."""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

import numpy as np
import pytest

from tests.net.peers import free_port
from tests.rig.conftest import RIG_ADDR

pytest.importorskip("pyverbs")

from tierkv.store.api import Store  # noqa: E402
from tierkv.config import DramConfig, PeersConfig, StoreConfig  # noqa: E402
from tierkv.layout import KVLayout  # noqa: E402
from tierkv.net import rdma_available  # noqa: E402
from tierkv.tiers.base import TierKind  # noqa: E402

pytestmark = [pytest.mark.rdma, pytest.mark.skipif(not rdma_available(), reason="no RDMA device")]
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_page=16)
PB = LAYOUT.page_bytes


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50000, n * LAYOUT.tokens_per_page, dtype=np.int64)


def pages(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed + 1).integers(0, 256, (n, PB), dtype=np.uint8)


def config(path: str, peers: PeersConfig) -> StoreConfig:
    return StoreConfig(path=path, model_id="rig", layout=LAYOUT, dram=DramConfig(64 * PB), peers=peers)


def secret_file(where: Path) -> str:
    path = where / "peers.secret"
    if not path.exists():
        path.write_bytes(b"rig-cluster-secret-0123456789abcdef")
        path.chmod(0o600)
    return str(path)


def prefill_node(path: str, port: int, ready: EventType) -> None:
    peers = PeersConfig(serve=f"{RIG_ADDR}:{port}", transport="rdma", timeout_s=5.0,
                        secret_file=secret_file(Path(path).parent))
    store = Store.open(config(path, peers))
    for i in range(4):
        store.put(tokens(i, 8), pages(i, 8))
    ready.set()
    time.sleep(3600)


def test_decode_store_loads_from_prefill_store_over_rdma(tmp_path: Path) -> None:
    port = free_port()
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=prefill_node, args=(str(tmp_path / "prefill"), port, ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(180), "the prefill store did not come up"
        peers = PeersConfig(fetch=(f"{RIG_ADDR}:{port}",), transport="rdma", timeout_s=5.0,
                            secret_file=secret_file(tmp_path))
        with Store.open(config(str(tmp_path / "decode"), peers)) as decode:
            for i in range(4):
                out = np.zeros((8, PB), np.uint8)
                got = decode.get(tokens(i, 8), out)
                assert got.pages == 8 and got.tiers == (TierKind.PEER,) * 8
                np.testing.assert_array_equal(out, pages(i, 8))
            assert decode.stats().peer_pages == 32
            proc.kill()
            proc.join(10)
            start = time.monotonic()
            out = np.zeros((8, PB), np.uint8)
            assert decode.get(tokens(99, 8), out).pages == 0   # the peer is gone: a miss
            assert time.monotonic() - start < 15
            out = np.zeros((8, PB), np.uint8)
            assert decode.get(tokens(0, 8), out).pages == 8    # kept locally
            np.testing.assert_array_equal(out, pages(0, 8))
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
