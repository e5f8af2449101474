"""Two stores handing pages to each other over the network (TCP on 127.0.0.1; the rig runs
the transport over soft-RoCE): a node loads from a peer's DRAM what it does not hold,
every page checked, keeps it, and a lost peer is a miss within the timeout."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import LAYOUT, PB, page_data
from tierkv.store.api import Store
from tierkv.config import DramConfig, NvmeConfig, PeersConfig, StoreConfig
from tierkv.errors import ConfigError
from tierkv.net import Credential, NetConfig, connect
from tierkv.tiers.base import TierKind
from tierkv.tiers.peer import PeerDramTier

TPP = LAYOUT.tokens_per_page


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed + 500).integers(0, 50000, pages * TPP, dtype=np.int64)


def secret_file(where: Path, content: bytes = b"cluster-secret-of-this-test-run") -> str:
    """A peers secret file (mode 0600) in ``where``."""
    path = where / f"peers-{len(content)}.secret"
    path.write_bytes(content)
    path.chmod(0o600)
    return str(path)


def config(path: Path, peers: PeersConfig, dram_pages: int = 16, nvme_pages: int = 32) -> StoreConfig:
    return StoreConfig(path=str(path), model_id="m", layout=LAYOUT, dram=DramConfig(dram_pages * PB),
                       nvme=NvmeConfig(nvme_pages * PB), peers=peers, policy="lru")


@pytest.fixture
def prefill(tmp_path: Path) -> Iterator[Store]:
    peers = PeersConfig(serve="127.0.0.1:0", transport="tcp", secret_file=secret_file(tmp_path))
    with Store.open(config(tmp_path / "prefill", peers)) as s:
        yield s


def decode_node(tmp_path: Path, prefill: Store, **kw: object) -> Store:
    host, port = prefill.peer_address or ("", 0)
    peers = PeersConfig(fetch=(f"{host}:{port}",), transport="tcp", timeout_s=1.0, secret_file=secret_file(tmp_path))
    return Store.open(config(tmp_path / "decode", peers, **kw))  # type: ignore[arg-type]


def load(store: Store, tokens: np.ndarray, n: int) -> tuple[int, tuple[TierKind, ...], np.ndarray]:
    out = np.zeros((n, PB), dtype=np.uint8)
    got = store.get(tokens, out)
    return got.pages, got.tiers, out


def test_decode_node_loads_what_prefill_holds_and_keeps_it(tmp_path: Path, prefill: Store) -> None:
    tokens, data = prompt(1, 4), page_data(1, 4)
    prefill.put(tokens, data)
    with decode_node(tmp_path, prefill) as decode:
        decode.put(tokens[:TPP], data[:1])                # the first page is here already
        n, tiers, out = load(decode, tokens, 4)
        assert n == 4 and np.array_equal(out, data)
        assert tiers == (TierKind.DRAM,) + (TierKind.PEER,) * 3
        assert decode.lookup(tokens).cached_pages == 4    # kept here now
        assert decode.stats().peer_pages == 3
        n, tiers, out = load(decode, tokens, 4)
        assert n == 4 and TierKind.PEER not in tiers and np.array_equal(out, data)


def test_a_fetch_larger_than_this_store_returns_every_page_and_keeps_what_fits(tmp_path: Path,
                                                                              prefill: Store) -> None:
    tokens, data = prompt(7, 10), page_data(7, 10)
    prefill.put(tokens, data)
    with decode_node(tmp_path, prefill, dram_pages=2, nvme_pages=4) as decode:
        n, tiers, out = load(decode, tokens, 10)
        assert n == 10 and np.array_equal(out, data) and tiers == (TierKind.PEER,) * 10
        assert decode.lookup(tokens).cached_pages == 6    # as many as its 2 + 4 slots hold
        assert decode.stats().peer_pages == 10


def test_tenants_do_not_share_pages_across_nodes(tmp_path: Path, prefill: Store) -> None:
    tokens, data = prompt(2, 3), page_data(2, 3)
    prefill.put(tokens, data, tenant="a")
    with decode_node(tmp_path, prefill) as decode:
        assert load(decode, tokens, 3)[0] == 0             # another tenant's keys: nothing
        out = np.zeros((3, PB), np.uint8)
        assert decode.get(tokens, out, tenant="b").pages == 0
        assert decode.get(tokens, out, tenant="a").pages == 3
        assert np.array_equal(out, data)


def test_pages_evicted_on_the_peer_are_misses_never_stale(tmp_path: Path, prefill: Store) -> None:
    first, first_data = prompt(3, 2), page_data(3, 2)
    prefill.put(first, first_data)
    for i in range(20):                                   # DRAM holds 16: the first prompt leaves DRAM
        prefill.put(prompt(100 + i, 2), page_data(100 + i, 2))
    assert prefill.lookup(first).tiers[:1] != (TierKind.DRAM,)
    with decode_node(tmp_path, prefill) as decode:
        n, _, out = load(decode, first, 2)
        assert n == 0 and not out.any()                   # the peer serves DRAM pages only
        recent, recent_data = prompt(119, 2), page_data(119, 2)
        n, _, out = load(decode, recent, 2)
        assert n == 2 and np.array_equal(out, recent_data)


def test_a_lost_peer_is_a_miss_within_the_timeout(tmp_path: Path) -> None:
    serving = Store.open(config(tmp_path / "p", PeersConfig(serve="127.0.0.1:0", transport="tcp",
                                                            secret_file=secret_file(tmp_path))))
    tokens, data = prompt(4, 2), page_data(4, 2)
    serving.put(tokens, data)
    decode = decode_node(tmp_path, serving)
    try:
        assert load(decode, prompt(5, 1), 1)[0] == 0      # connects
        serving.close()
        start = time.monotonic()
        n, _, out = load(decode, tokens, 2)
        assert n == 0 and not out.any()
        assert time.monotonic() - start < 3.0
    finally:
        decode.close()


def test_remote_nodes_cannot_write_into_a_served_store(tmp_path: Path, prefill: Store) -> None:
    tokens, data = prompt(6, 1), page_data(6, 1)
    prefill.put(tokens, data)
    host, port = prefill.peer_address or ("", 0)
    net = NetConfig(credential=Credential("", Path(secret_file(tmp_path)).read_bytes()))
    peer = PeerDramTier(connect(host, port, "tcp", net))
    try:
        res = peer.transport.write([0], [time.time_ns()], np.full((1, PB), 0xEE, np.uint8)).result(5)
        assert not any(s.name == "STORED" for s in res.statuses)
    finally:
        peer.close()
    n, _, out = load(prefill, tokens, 1)
    assert n == 1 and np.array_equal(out, data)


@pytest.mark.parametrize("peers,match", [
    ({"serve": "nohost", "secret_file": "/s"}, "host:port"),
    ({"fetch": "10.0.0.1:7400", "secret_file": "/s"}, "list"),
    ({"fetch": ["10.0.0.1:99999"], "secret_file": "/s"}, "port"),
    ({"serve": "127.0.0.1:7400"}, "secret_file"),
    ({"fetch": ["10.0.0.1:7400"]}, "secret_file"),
    ({"serve": "127.0.0.1:7400", "secret_file": 42}, "secret_file"),
    ({"serve": "127.0.0.1:7400", "secret_file": "/s", "tenant_secrets": {"a": 1}}, "tenant_secrets"),
    ({"serve": "127.0.0.1:7400", "secret_file": "/s", "tenant": 7}, "tenant"),
    ({"transport": "ib"}, "transport"),
    ({"timeout_s": 0}, "timeout_s"),
])
def test_bad_peer_configs_name_the_problem(peers: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PeersConfig(**peers)  # type: ignore[arg-type]
