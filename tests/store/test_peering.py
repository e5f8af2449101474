"""Two stores handing pages to each other over the network (TCP on 127.0.0.1; the rig runs
the transport over soft-RoCE): a node loads from a peer's DRAM what it does not hold,
every page checked, keeps it, and a lost peer is a miss within the timeout."""

from __future__ import annotations

import socket
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
from tierkv.serve.daemon import NodeService
from tierkv.store import peering
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


def config(path: Path, peers: PeersConfig | None, dram_pages: int = 16, nvme_pages: int = 32) -> StoreConfig:
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
        found = decode.lookup(tokens)                      # kept here: as many as its 2 + 4 slots hold
        assert found.cached_pages == 10 and found.tiers[6:] == (TierKind.PEER,) * 4   # the rest: the peer's
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


@pytest.fixture
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peer lookups wait up to 5 s here, so a loaded test machine cannot turn a slow
    answer into a miss; the tests of slow and lost peers keep the short default."""
    monkeypatch.setattr(peering, "LOOKUP_TIMEOUT_S", 5.0)


@pytest.mark.usefixtures("patient")
def test_lookup_counts_the_pages_a_peer_would_serve(tmp_path: Path, prefill: Store) -> None:
    """A decode node's lookup must see what its get would fetch from the prefill node,
    or an engine deciding from the lookup never asks for those pages."""
    tokens, data = prompt(11, 5), page_data(11, 5)
    prefill.put(tokens, data)
    with decode_node(tmp_path, prefill) as decode:
        decode.put(tokens[:TPP], data[:1])                # the first page is here already
        found = decode.lookup(tokens)
        assert found.cached_pages == 5 and found.cached_tokens == 5 * TPP and found.total_pages == 5
        assert found.tiers == (TierKind.DRAM,) + (TierKind.PEER,) * 4
        assert found.pages_per_tier == {TierKind.DRAM: 1, TierKind.PEER: 4}
        assert decode.stats().peer_pages == 0             # a lookup moves no page
        n, tiers, out = load(decode, tokens, 5)
        assert n == 5 and tiers == found.tiers and np.array_equal(out, data)
        assert decode.lookup(prompt(12, 3)).cached_pages == 0                    # nobody holds it
        assert decode.lookup(tokens, tenant="other").cached_pages == 0           # another tenant's keys
        longer = np.concatenate([tokens, prompt(13, 2)])
        assert decode.lookup(longer).cached_pages == 5    # the run ends where the peer's does


@pytest.mark.usefixtures("patient")
def test_lookup_follows_peers_in_the_order_a_get_asks_them(tmp_path: Path, prefill: Store) -> None:
    """Two peers: the first holds pages 0-1, the second 0-3: a get takes 0-1 from the
    first and 2-3 from the second, and the lookup says 4."""
    tokens, data = prompt(14, 4), page_data(14, 4)
    prefill.put(tokens[:2 * TPP], data[:2])
    peers = PeersConfig(serve="127.0.0.1:0", transport="tcp", secret_file=secret_file(tmp_path))
    with Store.open(config(tmp_path / "second", peers)) as second:
        second.put(tokens, data)
        eps = tuple(f"{h}:{p}" for h, p in (prefill.peer_address or ("", 0), second.peer_address or ("", 0)))
        cfg = config(tmp_path / "decode", PeersConfig(fetch=eps, transport="tcp", timeout_s=2.0,
                                                      secret_file=secret_file(tmp_path)))
        with Store.open(cfg) as decode:
            assert decode.lookup(tokens).tiers == (TierKind.PEER,) * 4
            n, _, out = load(decode, tokens, 4)
            assert n == 4 and np.array_equal(out, data)


def test_lookup_treats_a_lost_peer_as_a_miss(tmp_path: Path) -> None:
    serving = Store.open(config(tmp_path / "p", PeersConfig(serve="127.0.0.1:0", transport="tcp",
                                                            secret_file=secret_file(tmp_path))))
    tokens, data = prompt(15, 2), page_data(15, 2)
    serving.put(tokens, data)
    decode = decode_node(tmp_path, serving)
    try:
        assert load(decode, tokens[:TPP], 1)[0] == 1      # connected, and one page kept here
        serving.close()
        start = time.monotonic()
        found = decode.lookup(tokens)
        assert found.cached_pages == 1 and found.tiers == (TierKind.DRAM,)
        assert time.monotonic() - start < 1.0
    finally:
        decode.close()


def test_lookup_does_not_wait_for_a_peer_that_never_answers(tmp_path: Path) -> None:
    """A listener that accepts and says nothing: connecting to it would take the whole
    connect timeout; a lookup takes its own short deadline and says miss, every time."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        host, port = mute.getsockname()
        peers = PeersConfig(fetch=(f"{host}:{port}",), transport="tcp", timeout_s=2.0,
                            secret_file=secret_file(tmp_path))
        with Store.open(config(tmp_path / "d", peers)) as decode:
            tokens = prompt(16, 2)
            for _ in range(3):
                start = time.monotonic()
                assert decode.lookup(tokens).cached_pages == 0
                assert time.monotonic() - start < 1.0


def test_lookup_does_not_wait_for_a_slow_peer(tmp_path: Path, prefill: Store) -> None:
    """A connected peer whose lookup answers late (its handler stalls): the lookup is a
    miss within its deadline, and the get, with its longer timeout, still loads the pages."""
    tokens, data = prompt(17, 2), page_data(17, 2)
    prefill.put(tokens, data)
    assert prefill._peering is not None and prefill._peering.server is not None
    methods = prefill._peering.server.store.methods
    answer = methods["lookup"]

    def late(body: bytes, scope: int | None) -> bytes:
        time.sleep(0.8)
        return answer(body, scope)

    host, port = prefill.peer_address or ("", 0)
    peers = PeersConfig(fetch=(f"{host}:{port}",), transport="tcp", timeout_s=5.0, secret_file=secret_file(tmp_path))
    with Store.open(config(tmp_path / "decode", peers)) as decode:
        assert load(decode, prompt(18, 1), 1)[0] == 0     # connected
        methods["lookup"] = late
        start = time.monotonic()
        assert decode.lookup(tokens).cached_pages == 0
        assert time.monotonic() - start < 0.6
        n, _, out = load(decode, tokens, 2)
        assert n == 2 and np.array_equal(out, data)


@pytest.mark.usefixtures("patient")
def test_the_node_service_looks_up_peers_as_in_process(tmp_path: Path, prefill: Store, sock_dir: Path) -> None:
    tokens, data = prompt(19, 3), page_data(19, 3)
    prefill.put(tokens, data)
    host, port = prefill.peer_address or ("", 0)
    peers = PeersConfig(fetch=(f"{host}:{port}",), transport="tcp", timeout_s=2.0, secret_file=secret_file(tmp_path))
    with NodeService(config(tmp_path / "decode", peers), sock_dir / "d.sock").start() as svc:
        with Store.connect(svc.path) as client:
            found = client.lookup(tokens)
            assert found == svc.store.lookup(tokens)
            assert found.tiers == (TierKind.PEER,) * 3


def test_a_store_without_peers_never_asks_any(tmp_path: Path) -> None:
    with Store.open(config(tmp_path / "alone", None)) as alone:
        alone.put(prompt(20, 2), page_data(20, 2))
        assert alone._peering is None and alone.lookup(prompt(20, 3)).cached_pages == 2


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
