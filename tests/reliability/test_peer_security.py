"""A store's peer port (issue 28 item 4): before, any client that could connect read every
DRAM slot by number, with no credential, key or tenant. Now a client must answer the
challenge with the cluster's (or a tenant's) secret, a read must name the key of each
page, and a tenant's principal reads only pages that tenant's requests placed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import LAYOUT, PB, page_data
from tierkv.config import DramConfig, HbmConfig, PeersConfig, StoreConfig
from tierkv.errors import ConfigError, TierUnavailableError
from tierkv.keys import split_keys
from tierkv.net import Credential, NetConfig, TcpTransport
from tierkv.net.wire import decode_metas, encode_keys
from tierkv.store import peering
from tierkv.store.api import Store
from tierkv.tiers.base import TierKind

TPP = LAYOUT.tokens_per_page
CLUSTER = b"cluster-secret-0123456789abcdef"
SECRET_A = b"tenant-a-secret-0123456789abcdef"


def secret(where: Path, name: str, content: bytes) -> str:
    path = where / f"{name}.secret"
    path.write_bytes(content)
    path.chmod(0o600)
    return str(path)


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed + 900).integers(0, 50000, pages * TPP, dtype=np.int64)


def config(path: Path, peers: PeersConfig) -> StoreConfig:
    return StoreConfig(path=str(path), model_id="m", layout=LAYOUT, dram=DramConfig(16 * PB), peers=peers)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Store]:
    """A store serving its DRAM with the cluster secret and tenant a's own secret; it
    holds 3 pages of tenant a and 3 of tenant b."""
    peers = PeersConfig(serve="127.0.0.1:0", transport="tcp", secret_file=secret(tmp_path, "cluster", CLUSTER),
                        tenant_secrets={"a": secret(tmp_path, "a", SECRET_A)})
    with Store.open(config(tmp_path / "served", peers)) as store:
        store.put(prompt(1, 3), page_data(1, 3), tenant="a")
        store.put(prompt(2, 3), page_data(2, 3), tenant="b")
        yield store


def net(principal: str | None, key: bytes = b"") -> NetConfig:
    return NetConfig(timeout_s=2.0, connect_timeout_s=2.0, links=1,
                     credential=None if principal is None else Credential(principal, key))


def test_a_client_without_the_secret_reads_nothing(served: Store) -> None:
    host, port = served.peer_address or ("", 0)
    for cfg in (net(None), net("", b"wrong-secret-0123456789"), net("tenant:a", CLUSTER)):
        with pytest.raises(TierUnavailableError):
            TcpTransport(host, port, cfg)


def test_slot_numbers_alone_return_no_bytes(served: Store) -> None:
    host, port = served.peer_address or ("", 0)
    with TcpTransport(host, port, net("", CLUSTER)) as tr:        # even with the cluster's secret
        dst = np.zeros((16, PB), np.uint8)
        r = tr.read(list(range(16)), dst).result(5)
        assert not any(r.ok) and not dst.any()


def test_a_tenant_principal_reads_only_its_tenant_pages(served: Store) -> None:
    host, port = served.peer_address or ("", 0)
    keys_a = split_keys(served._keys(prompt(1, 3), "a"))
    keys_b = split_keys(served._keys(prompt(2, 3), "b"))
    with TcpTransport(host, port, net("tenant:a", SECRET_A)) as tr:
        metas = decode_metas(tr.call("lookup", encode_keys(keys_a + keys_b)).result(5).body)
        assert [m.generation > 0 for m in metas] == [True] * 3 + [False] * 3
        dst = np.zeros((3, PB), np.uint8)
        assert tr.read([m.slot for m in metas[:3]], dst, metas[:3], keys=keys_a).result(5).all_ok
        assert np.array_equal(dst, page_data(1, 3))
    with TcpTransport(host, port, net("", CLUSTER)) as tr:          # b's slots, found by the cluster
        slots_b = [m.slot for m in decode_metas(tr.call("lookup", encode_keys(keys_b)).result(5).body)]
    with TcpTransport(host, port, net("tenant:a", SECRET_A)) as tr:  # named with b's keys: nothing
        dst = np.zeros((3, PB), np.uint8)
        assert not any(tr.read(slots_b, dst, keys=keys_b).result(5).ok) and not dst.any()


def test_nodes_fetch_with_their_principal(tmp_path: Path, served: Store) -> None:
    host, port = served.peer_address or ("", 0)
    as_a = PeersConfig(fetch=(f"{host}:{port}",), transport="tcp", timeout_s=2.0,
                       secret_file=secret(tmp_path, "mine-a", SECRET_A), tenant="a")
    with Store.open(config(tmp_path / "node-a", as_a)) as node:
        out = np.zeros((3, PB), np.uint8)
        got = node.get(prompt(1, 3), out, tenant="a")
        assert got.pages == 3 and got.tiers == (TierKind.PEER,) * 3 and np.array_equal(out, page_data(1, 3))
        assert node.get(prompt(2, 3), out, tenant="b").pages == 0   # not this principal's tenant
    cluster = PeersConfig(fetch=(f"{host}:{port}",), transport="tcp", timeout_s=2.0,
                          secret_file=secret(tmp_path, "mine-c", CLUSTER))
    with Store.open(config(tmp_path / "node-c", cluster)) as node:
        out = np.zeros((3, PB), np.uint8)
        assert node.get(prompt(2, 3), out, tenant="b").pages == 3 and np.array_equal(out, page_data(2, 3))


def test_a_tenant_nodes_lookup_sees_only_its_tenants_pages_on_peers(tmp_path: Path, served: Store,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup asks peers as a get fetches: with the node's principal, so a node whose
    principal is tenant a learns nothing of tenant b's pages, even by b's own keys."""
    monkeypatch.setattr(peering, "LOOKUP_TIMEOUT_S", 5.0)   # a loaded machine's slow answer is no miss here
    host, port = served.peer_address or ("", 0)
    as_a = PeersConfig(fetch=(f"{host}:{port}",), transport="tcp", timeout_s=2.0,
                       secret_file=secret(tmp_path, "mine-a", SECRET_A), tenant="a")
    with Store.open(config(tmp_path / "node-a", as_a)) as node:
        assert node.lookup(prompt(1, 3), tenant="a").tiers == (TierKind.PEER,) * 3
        assert node.lookup(prompt(2, 3), tenant="b").cached_pages == 0
        keys_b = served._keys(prompt(2, 3), "b")
        assert node.lookup_keys(keys_b).cached_pages == 0            # the peer answers a's principal: none
    cluster = PeersConfig(fetch=(f"{host}:{port}",), transport="tcp", timeout_s=2.0,
                          secret_file=secret(tmp_path, "mine-c", CLUSTER))
    with Store.open(config(tmp_path / "node-c", cluster)) as node:
        assert node.lookup_keys(keys_b).cached_pages == 3
        assert node.lookup(prompt(2, 3), tenant="b").cached_pages == 3
        assert node.lookup(prompt(2, 3), tenant="a").cached_pages == 0   # the same tokens, a's keys


def test_a_page_demoted_during_another_tenants_request_is_not_that_tenants(tmp_path: Path) -> None:
    """Tenant b's pages demoted from HBM into the served DRAM by tenant a's put are placed
    in a's request but are not a's: they are tagged unknown, readable by the cluster only."""
    peers = PeersConfig(serve="127.0.0.1:0", transport="tcp", secret_file=secret(tmp_path, "cluster", CLUSTER),
                        tenant_secrets={"a": secret(tmp_path, "a", SECRET_A)})
    cfg = StoreConfig(path=str(tmp_path / "s"), model_id="m", layout=LAYOUT, hbm=HbmConfig(2 * PB, "cpu"),
                      dram=DramConfig(16 * PB), peers=peers)
    with Store.open(cfg) as store:
        store.put(prompt(3, 2), page_data(3, 2), tenant="b")     # into HBM
        store.put(prompt(4, 2), page_data(4, 2), tenant="a")     # b's pages go down to DRAM now
        assert store.lookup(prompt(3, 2), "b").tiers == (TierKind.DRAM,) * 2
        keys_b = split_keys(store._keys(prompt(3, 2), "b"))
        host, port = store.peer_address or ("", 0)
        with TcpTransport(host, port, net("tenant:a", SECRET_A)) as tr:
            metas = decode_metas(tr.call("lookup", encode_keys(keys_b)).result(5).body)
            assert all(m.generation == 0 for m in metas)
        with TcpTransport(host, port, net("", CLUSTER)) as tr:
            metas = decode_metas(tr.call("lookup", encode_keys(keys_b)).result(5).body)
            assert all(m.generation > 0 for m in metas)


def test_bad_secret_files_fail_the_open_with_one_line(tmp_path: Path) -> None:
    loose = tmp_path / "loose.secret"
    loose.write_bytes(CLUSTER)
    loose.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        Store.open(config(tmp_path / "x", PeersConfig(serve="127.0.0.1:0", secret_file=str(loose))))
    with pytest.raises(ConfigError, match="tenant_secrets.a"):
        Store.open(config(tmp_path / "y", PeersConfig(serve="127.0.0.1:0", secret_file=secret(tmp_path, "c", CLUSTER),
                                                      tenant_secrets={"a": str(tmp_path / "missing")})))
