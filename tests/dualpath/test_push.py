"""DualPath's second path in real stores over TCP on 127.0.0.1 (the rig runs it over
soft-RoCE): a storage node S holds the pages; a prefill node P loads them, part itself,
part through a helper D that reads them from S and pushes them into P's landing zone.
Every page is checked on arrival and bit-exact; a helper that fails, lacks the pages or
is refused costs time, never pages."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PB, page_data
from tests.store.test_peering import config, prompt, secret_file
from tierkv.config import PeersConfig
from tierkv.cluster.local import free_port
from tierkv.dualpath import push
from tierkv.dualpath.push import Helper, Landing, Loader, PushRequest, decode_answer
from tierkv.errors import ConfigError, TierUnavailableError
from tierkv.keys import PageKey, split_keys
from tierkv.net import Credential, NetConfig, connect
from tierkv.net.auth import CLUSTER, load_secret
from tierkv.net.server import SlotStore
from tierkv.net.wire import Call, ProtocolError, WriteStatus
from tierkv.tiers.dram import DramTier
from tierkv.store.api import Store

PAGES = 24


def addr(store: Store) -> str:
    host, port = store.peer_address or ("", 0)
    return f"{host}:{port}"


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[Store]:
    peers = PeersConfig(serve="127.0.0.1:0", transport="tcp", secret_file=secret_file(tmp_path))
    with Store.open(config(tmp_path / "storage", peers, dram_pages=128, nvme_pages=128)) as s:
        yield s


def helper(tmp_path: Path, storage: Store | None, name: str = "decode", **kw: object) -> Store:
    peers = PeersConfig(serve="127.0.0.1:0", fetch=(addr(storage),) if storage is not None else (), helper=True,
                        transport="tcp", timeout_s=2.0, secret_file=secret_file(tmp_path), **kw)  # type: ignore[arg-type]
    return Store.open(config(tmp_path / name, peers, dram_pages=8, nvme_pages=8))


def prefill(tmp_path: Path, storage: Store, helpers: list[str], policy: str = "split", landing_pages: int = 64,
            timeout_s: float = 2.0) -> Store:
    peers = PeersConfig(fetch=(addr(storage),), helpers=tuple(helpers), landing="127.0.0.1:0",
                        landing_pages=landing_pages, dualpath=policy, transport="tcp", timeout_s=timeout_s,
                        secret_file=secret_file(tmp_path))
    return Store.open(config(tmp_path / "prefill", peers, dram_pages=64, nvme_pages=64))


def load(store: Store, seed: int, pages: int = PAGES) -> tuple[int, np.ndarray, np.ndarray]:
    out = np.zeros((pages, PB), dtype=np.uint8)
    got = store.get(prompt(seed, pages), out)
    return got.pages, out, page_data(seed, pages)


def test_split_loads_part_here_and_part_through_the_helper_bit_exact(tmp_path: Path, storage: Store) -> None:
    for seed in range(3):
        storage.put(prompt(seed, PAGES), page_data(seed, PAGES))
    with helper(tmp_path, storage) as d, prefill(tmp_path, storage, [addr(d)]) as p:
        for seed in range(3):
            n, out, want = load(p, seed)
            assert n == PAGES and np.array_equal(out, want)
        loads = p.stats().dualpath["loads"]
        assert loads["fetches"] == 3 and loads["pages_self"] + loads["pages_helpers"] == 3 * PAGES
        assert loads["pages_self"] > 0 and loads["pages_helpers"] > 0, loads      # both sides read
        assert loads["pages_fallback"] == 0 and loads["helper_errors"] == 0
        pushed = d.stats().dualpath["helper"]
        assert pushed["pages_pushed"] == loads["pages_helpers"] and pushed["failed"] == 0
        # The helper forwards, it does not keep: it holds no prefix of these pages.
        assert d.stats().pages_stored == 0 and d.stats().pages_requested == 0
        assert p.stats().peer_pages == 3 * PAGES and p.lookup(prompt(0, PAGES)).cached_pages == PAGES


def test_pe_only_never_asks_the_helper(tmp_path: Path, storage: Store) -> None:
    storage.put(prompt(1, PAGES), page_data(1, PAGES))
    with helper(tmp_path, storage) as d, prefill(tmp_path, storage, [addr(d)], policy="pe-only") as p:
        n, out, want = load(p, 1)
        assert n == PAGES and np.array_equal(out, want)
        assert p.stats().dualpath["loads"]["pages_helpers"] == 0
        assert d.stats().dualpath["helper"]["pushes"] == 0


def test_a_helper_that_is_gone_costs_no_pages(tmp_path: Path, storage: Store) -> None:
    storage.put(prompt(2, PAGES), page_data(2, PAGES))
    d = helper(tmp_path, storage)
    gone = addr(d)
    d.close()
    with prefill(tmp_path, storage, [gone], timeout_s=0.5) as p:
        began = time.monotonic()
        n, out, want = load(p, 2)
        assert n == PAGES and np.array_equal(out, want)
        assert time.monotonic() - began < 5
        loads = p.stats().dualpath["loads"]
        assert loads["pages_helpers"] == 0 and loads["pages_self"] == PAGES


def test_a_helper_that_lacks_the_pages_leaves_them_to_this_node(tmp_path: Path, storage: Store) -> None:
    storage.put(prompt(3, PAGES), page_data(3, PAGES))
    with helper(tmp_path, None) as d, prefill(tmp_path, storage, [addr(d)]) as p:   # d reaches no storage
        n, out, want = load(p, 3)
        assert n == PAGES and np.array_equal(out, want)
        loads = p.stats().dualpath["loads"]
        assert loads["pages_helpers"] == 0 and loads["pages_fallback"] > 0
        assert loads["pages_self"] == PAGES
        # A helper that delivered nothing is left alone for a while: the next fetch does not wait on it.
        storage.put(prompt(13, PAGES), page_data(13, PAGES))
        n, out, want = load(p, 13)
        assert n == PAGES and np.array_equal(out, want)
        assert d.stats().dualpath["helper"]["pushes"] == 1


def test_a_small_landing_zone_leaves_the_rest_to_this_node(tmp_path: Path, storage: Store) -> None:
    storage.put(prompt(4, PAGES), page_data(4, PAGES))
    with helper(tmp_path, storage) as d, prefill(tmp_path, storage, [addr(d)], landing_pages=3) as p:
        n, out, want = load(p, 4)
        assert n == PAGES and np.array_equal(out, want)
        loads = p.stats().dualpath["loads"]
        assert 0 < loads["pages_helpers"] <= 3 and loads["pages_self"] == PAGES - loads["pages_helpers"]


def test_only_the_clusters_principal_may_ask_for_a_push(tmp_path: Path, storage: Store) -> None:
    tenant = secret_file(tmp_path, b"acme-secret-of-this-test-run-0123")
    with helper(tmp_path, storage, tenant_secrets={"acme": tenant}) as d:
        host, port = d.peer_address or ("", 0)
        net = NetConfig(timeout_s=2.0, credential=Credential("tenant:acme", load_secret(tenant, "test")))
        keys = split_keys(b"\x01" * 16 * 2)
        body = PushRequest(("127.0.0.1", 1), tuple(keys), 0, (0, 1), (5, 6), b"acme", 1000).encode()
        with connect(host, port, "tcp", net) as t:
            res = t.call("push", body).result(timeout=5)
        assert not res.ok and b"principal" in res.body
        cluster = NetConfig(timeout_s=2.0, credential=Credential(CLUSTER, load_secret(secret_file(tmp_path), "test")))
        with connect(host, port, "tcp", cluster) as t:
            res = t.call("push", b"\x00" * 5).result(timeout=5)   # the cluster's principal, a malformed body
        assert not res.ok and b"push" in res.body
        with connect(host, port, "tcp", cluster) as t:   # well formed, to a landing zone nobody serves: 0 stored
            res = t.call("push", body).result(timeout=10)
        assert res.ok and decode_answer(res.body)[0] == 0


def test_the_landing_zone_takes_only_the_generation_it_reserved(tmp_path: Path) -> None:
    secret = load_secret(secret_file(tmp_path), "test")
    net = NetConfig(timeout_s=2.0, credential=Credential(CLUSTER, secret))
    zone = Landing("127.0.0.1", 0, 4, PB, net, secret, rdma=False)
    try:
        slots, gens = zone.take(2)
        assert len(slots) == 2 and zone.take(9)[0] != slots
        data = page_data(9, 2)
        rows = np.zeros((2, PB), np.uint8)
        with connect(*zone.address, "tcp", net) as t:
            # A late write of an earlier push (an older generation) is never taken for this one.
            assert t.write(slots, [g - 1 for g in gens], data).result(timeout=5).all_stored
            assert zone.collect(slots, gens, rows) == 0
            res = t.write(slots, gens, data).result(timeout=5)
            assert res.statuses == (WriteStatus.STORED,) * 2
            assert zone.collect(slots, gens, rows) == 2 and np.array_equal(rows, data)
            assert t.write(slots, [g - 1 for g in gens], data[::-1].copy()).result(timeout=5).statuses == \
                (WriteStatus.STALE,) * 2
        assert zone.collect(slots, gens, rows) == 2 and np.array_equal(rows, data)
    finally:
        zone.close()


def test_an_unauthenticated_writer_cannot_reach_the_landing_zone(tmp_path: Path) -> None:
    secret = load_secret(secret_file(tmp_path), "test")
    net = NetConfig(timeout_s=1.0, connect_timeout_s=1.0, credential=Credential(CLUSTER, secret))
    zone = Landing("127.0.0.1", 0, 2, PB, net, secret, rdma=False)
    try:
        wrong = NetConfig(timeout_s=1.0, connect_timeout_s=1.0, credential=Credential(CLUSTER, b"x" * 32))
        with pytest.raises(TierUnavailableError, match="secret"):
            with connect(*zone.address, "tcp", wrong) as t:
                t.write([0], [zone.take(1)[1][0]], page_data(1, 1)).result(timeout=5)
    finally:
        zone.close()


@pytest.mark.parametrize("kw, match", [
    ({"helpers": ("127.0.0.1:1",)}, "landing"),
    ({"helpers": ("127.0.0.1:1",), "landing": "127.0.0.1:0", "dualpath": "both"}, "pe-only, shorter-queue or split"),
    ({"helper": True}, "serve"),
    ({"helpers": ("nope",), "landing": "127.0.0.1:0"}, "helpers"),
    ({"landing_pages": 0}, "landing_pages"),
])
def test_dualpath_settings_are_checked(tmp_path: Path, kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PeersConfig(transport="tcp", secret_file=secret_file(tmp_path), **kw)  # type: ignore[arg-type]


def test_a_wildcard_landing_address_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="wildcard"):
        PeersConfig(helpers=("127.0.0.1:1",), landing="0.0.0.0:0", transport="tcp", secret_file=secret_file(tmp_path))


def test_a_landing_that_cannot_listen_is_a_config_error_and_leaks_no_server(tmp_path: Path, storage: Store) -> None:
    taken, serve = socket.socket(), free_port()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        peers = PeersConfig(serve=f"127.0.0.1:{serve}", fetch=(addr(storage),), helpers=("127.0.0.1:1",),
                            landing=f"127.0.0.1:{taken.getsockname()[1]}", transport="tcp",
                            secret_file=secret_file(tmp_path))
        with pytest.raises(ConfigError, match="cannot listen"):
            Store.open(config(tmp_path / "p", peers))
        with socket.socket() as again:   # the serve endpoint was closed with the failed store
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            again.bind(("127.0.0.1", serve))
    finally:
        taken.close()


def test_a_node_cannot_be_its_own_helper(tmp_path: Path, storage: Store) -> None:
    port = free_port()
    peers = PeersConfig(serve=f"127.0.0.1:{port}", fetch=(addr(storage),), helpers=(f"127.0.0.1:{port}",),
                        landing="127.0.0.1:0", helper=True, transport="tcp", secret_file=secret_file(tmp_path))
    with pytest.raises(ConfigError, match="own serve address"):
        Store.open(config(tmp_path / "p", peers))
    # Under another of its addresses it cannot be told by the config: it answers its own push at once.
    storage.put(prompt(30, PAGES), page_data(30, PAGES))
    peers = PeersConfig(serve=f"0.0.0.0:{port}", fetch=(addr(storage),), helpers=(f"127.0.0.1:{port}",),
                        landing="127.0.0.1:0", helper=True, transport="tcp", secret_file=secret_file(tmp_path))
    with Store.open(config(tmp_path / "q", peers, dram_pages=64, nvme_pages=64)) as p:
        began = time.monotonic()
        n, out, want = load(p, 30)
        assert n == PAGES and np.array_equal(out, want)
        assert time.monotonic() - began < 1.0   # no wait for its own lock
        assert p.stats().dualpath["helper"]["own"] == 1


def test_two_nodes_that_are_each_others_helper_do_not_stall_each_other(tmp_path: Path, storage: Store) -> None:
    """Each holds its lock while it waits on the other's push; a push waits for the
    other's lock only briefly, finds nothing, and each node reads its pages itself."""
    for seed in (20, 21):
        storage.put(prompt(seed, PAGES), page_data(seed, PAGES))
    ports = free_port(), free_port()
    nodes = []
    for i in range(2):
        peers = PeersConfig(serve=f"127.0.0.1:{ports[i]}", fetch=(addr(storage),), helper=True,
                            helpers=(f"127.0.0.1:{ports[1 - i]}",), landing="127.0.0.1:0", transport="tcp",
                            timeout_s=5.0, secret_file=secret_file(tmp_path))
        nodes.append(Store.open(config(tmp_path / f"n{i}", peers, dram_pages=64, nvme_pages=64)))
    try:
        results: list[tuple[int, bool, float]] = []

        def one(i: int) -> None:
            began = time.monotonic()
            n, out, want = load(nodes[i], 20 + i)
            results.append((n, bool(np.array_equal(out, want)), time.monotonic() - began))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(r[:2] for r in results) == [(PAGES, True)] * 2
        assert max(r[2] for r in results) < 4.0, results   # not the push's whole budget (3.75 s) or more
    finally:
        for s in nodes:
            s.close()


def _fill(chain: Sequence[PageKey], start: int, rows: np.ndarray, salt: bytes, deadline: float) -> int:
    for i in range(rows.shape[0]):
        rows[i] = (start + i) % 251
    return rows.shape[0]


def _helper_and_zone(tmp_path: Path, loader: Loader, pages: int = 8) -> tuple[Helper, Landing, NetConfig]:
    secret = load_secret(secret_file(tmp_path), "test")
    net = NetConfig(timeout_s=2.0, credential=Credential(CLUSTER, secret))
    return Helper(loader, PB, net, "tcp"), Landing("127.0.0.1", 0, pages, PB, net, secret, rdma=False), net


def test_a_helper_whose_loader_fails_answers_nothing_stored(tmp_path: Path) -> None:
    def broken(chain: Sequence[PageKey], start: int, rows: np.ndarray, salt: bytes, deadline: float) -> int:
        raise ValueError("a tier fell over")

    helper, zone, _ = _helper_and_zone(tmp_path, broken)
    try:
        slots, gens = zone.take(4)
        body = PushRequest(zone.address, tuple(split_keys(b"\x02" * 16 * 4)), 0, tuple(slots), tuple(gens), b"",
                           1000).encode()
        assert decode_answer(helper.handle(body, None)) == (0, 0.0)
        assert helper.stats()["failed"] == 1
        # A working loader: every page lands, as the generation reserved.
        helper._loader = _fill
        assert decode_answer(helper.handle(body, None))[0] == 4
        rows = np.zeros((4, PB), np.uint8)
        assert zone.collect(slots, gens, rows) == 4 and all((rows[i] == i % 251).all() for i in range(4))
    finally:
        helper.close()
        zone.close()


def test_a_push_stops_at_its_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(push, "CHUNK_BYTES", 2 * PB)   # 2 pages a chunk
    calls = []

    def slow(chain: Sequence[PageKey], start: int, rows: np.ndarray, salt: bytes, deadline: float) -> int:
        calls.append(start)
        time.sleep(0.3)
        return _fill(chain, start, rows, salt, deadline)

    helper, zone, _ = _helper_and_zone(tmp_path, slow)
    try:
        slots, gens = zone.take(8)
        body = PushRequest(zone.address, tuple(split_keys(b"\x03" * 16 * 8)), 0, tuple(slots), tuple(gens), b"",
                           100).encode()
        stored, _ = decode_answer(helper.handle(body, None))
        assert calls == [0] and stored <= 2     # one chunk begun before the deadline, none after
    finally:
        helper.close()
        zone.close()


def test_a_helper_keeps_a_bounded_number_of_landing_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Helper, "MAX_LINKS", 2)
    helper, first, net = _helper_and_zone(tmp_path, _fill)
    zones = [first] + [Landing("127.0.0.1", 0, 8, PB, net, load_secret(secret_file(tmp_path), "t"), rdma=False)
                       for _ in range(3)]
    try:
        for zone in zones:
            slots, gens = zone.take(2)
            body = PushRequest(zone.address, tuple(split_keys(b"\x04" * 32)), 0, tuple(slots), tuple(gens), b"",
                               1000).encode()
            assert decode_answer(helper.handle(body, None))[0] == 2
        assert helper.stats()["links"] == 2
    finally:
        helper.close()
        for zone in zones:
            zone.close()


@pytest.mark.parametrize("landing, why", [(("127.0.0.1", 0), "port"), (("", 7), "host"),
                                          (("h\u00e9te", 7), "ASCII")])
def test_push_requests_with_bad_landings_do_not_decode(landing: tuple[str, int], why: str) -> None:
    body = PushRequest(landing, tuple(split_keys(b"\x05" * 16)), 0, (0,), (1,), b"", 1000).encode()
    with pytest.raises(ProtocolError, match=why):
        PushRequest.decode(body)


def test_push_is_never_served_on_an_rdma_progress_thread(tmp_path: Path) -> None:
    store = SlotStore(DramTier(2, PB))
    store.methods["push"] = lambda body, scope: b"served"
    assert store.call(Call("push", b"")).ok
    refused = store.call(Call("push", b""), inline=True)
    assert not refused.ok and b"TCP only" in refused.body
