"""DualPath over soft-RoCE in the guest: a storage store, a prefill store and a decode
store that reads for it (``[peers] transport = "rdma"``). The prefill node reads its part
of each prompt by one-sided READs from the storage node, the decode node reads the rest
the same way and writes it into the prefill node's landing zone through the RDMA write
path (staging, credits and send window as every write); every page bit-exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.net.peers import free_port
from tests.rig.conftest import RIG_ADDR

pytest.importorskip("pyverbs")

from tierkv.config import DramConfig, PeersConfig, StoreConfig  # noqa: E402
from tierkv.layout import KVLayout  # noqa: E402
from tierkv.net import rdma_available  # noqa: E402
from tierkv.store.api import Store  # noqa: E402

pytestmark = [pytest.mark.rdma, pytest.mark.skipif(not rdma_available(), reason="no RDMA device")]
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_page=16)
PB = LAYOUT.page_bytes
PAGES = 48


def store(tmp_path: Path, name: str, **peers: object) -> Store:
    secret = tmp_path / "peers.secret"
    if not secret.exists():
        secret.write_bytes(b"rig-dualpath-secret-0123456789abcdef")
        secret.chmod(0o600)
    cfg = StoreConfig(path=str(tmp_path / name), model_id="rig", layout=LAYOUT, dram=DramConfig(4 * PAGES * PB),
                      peers=PeersConfig(transport="rdma", timeout_s=5.0, secret_file=str(secret), **peers))  # type: ignore[arg-type]
    return Store.open(cfg)


def test_a_decode_node_pushes_its_part_over_rdma(tmp_path: Path) -> None:
    with store(tmp_path, "storage", serve=f"{RIG_ADDR}:{free_port()}") as s:
        host, port = s.peer_address or ("", 0)
        with store(tmp_path, "decode", serve=f"{RIG_ADDR}:{free_port()}", fetch=(f"{host}:{port}",),
                   helper=True) as d:
            dh, dp = d.peer_address or ("", 0)
            with store(tmp_path, "prefill", fetch=(f"{host}:{port}",), helpers=(f"{dh}:{dp}",),
                       landing=f"{RIG_ADDR}:{free_port()}", landing_pages=PAGES, dualpath="split") as p:
                for seed in range(3):
                    tokens = np.random.default_rng(seed).integers(0, 50000, PAGES * 16, dtype=np.int64)
                    data = np.random.default_rng(seed + 100).integers(0, 256, (PAGES, PB), dtype=np.uint8)
                    s.put(tokens, data)
                    out = np.zeros((PAGES, PB), np.uint8)
                    assert p.get(tokens, out).pages == PAGES
                    np.testing.assert_array_equal(out, data)
                loads = p.stats().dualpath["loads"]
                assert loads["pages_helpers"] > 0 and loads["pages_self"] > 0, loads
                assert loads["pages_fallback"] == 0 and loads["helper_errors"] == 0
                assert d.stats().dualpath["helper"]["pages_pushed"] == loads["pages_helpers"]
                assert d.stats().dualpath["helper"]["failed"] == 0
