"""The page directory against a real etcd: anchors chosen by position and key, published
under a node's lease in batches, withdrawn on eviction and with the lease, followed by a
watch; the node daemons ask the member the directory names."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from tierkv.cluster import directory as D
from tierkv.cluster.directory import ANCHOR_EVERY, SHALLOW, Directory, anchor_positions, is_anchor
from tierkv.cluster.publisher import Publisher
from tierkv.cluster.etcd import Etcd
from tierkv.cluster.local import LocalEtcd
from tierkv.errors import ClusterUnavailableError
from tierkv.config import ClusterConfig, DramConfig, PeersConfig, StoreConfig
from tierkv.keys import PageKey, as_token_array, chain_keys, namespace_digest, split_keys, tenant_salt
from tierkv.serve.daemon import NodeService
from tierkv.store.api import Store
from tierkv.tiers.base import TierKind
from tests.conftest import LAYOUT, PB, make_config, page_data
from tests.polling import wait_for
from tests.store.test_peering import secret_file

TPP = LAYOUT.tokens_per_page


def keys_of(tokens: np.ndarray, model: str = "m", tenant: str = "") -> list[PageKey]:
    return split_keys(chain_keys(as_token_array(tokens), TPP, namespace_digest(model, LAYOUT, tenant_salt(tenant))))


def test_anchors_are_the_first_powers_of_two_then_one_key_in_sixty_four() -> None:
    keys = [os.urandom(16) for _ in range(20_000)]
    pos = anchor_positions(keys)
    assert pos[:6] == [0, 1, 3, 7, 15, 31]
    assert all(is_anchor(p, keys[p]) for p in pos)
    assert sum(is_anchor(i, k) for i, k in enumerate(keys)) == len(pos)
    deep = len(pos) - 6
    assert abs(deep - (len(keys) - SHALLOW) / ANCHOR_EVERY) < 80   # ~312 of 19,968, by the keys' last byte
    assert anchor_positions(keys[:3]) == [0, 1] and anchor_positions(keys[:4]) == [0, 1, 3]


def test_the_manager_knows_the_positions_of_shallow_pages(tmp_path: Path) -> None:
    with Store.open(make_config(tmp_path / "s", dram_pages=64, nvme_pages=64)) as store:
        tokens = np.arange(40 * TPP)
        store.put(tokens, page_data(1, 40))
        keys = keys_of(tokens, model=store.config.model_id)
        depths = store._manager.shallow_depths(keys, SHALLOW)
        assert depths.tolist() == list(range(SHALLOW)) + [-1] * 8         # deeper than the cap: -1
        assert store._manager.shallow_depths([PageKey(b"\1" * 16)], SHALLOW).tolist() == [-1]  # not held


def test_publisher_and_directory(etcd: LocalEtcd) -> None:
    client = Etcd([etcd.endpoint])
    view = Directory(client, "c", check_s=0.2).start()
    pub = Publisher(client, "c", "n1", flush_s=0.01)
    try:
        chain = [PageKey(os.urandom(15) + bytes([i % 256])) for i in range(300)]   # last byte 0, 64, 128, 192: deep anchors
        anchors = anchor_positions(chain)
        assert [p for p in anchors if p >= SHALLOW] == [64, 128, 192, 256]
        pub.placed(chain, list(range(SHALLOW)) + [-1] * (300 - SHALLOW))
        time.sleep(0.3)
        assert pub.stats()["transactions"] == 0 and len(view) == 0    # no lease yet: nothing is written
        lease = client.grant(30)
        pub.set_lease(lease)
        assert pub.flushed(5)
        assert view.wait(lambda d: d.holders(chain) == {"n1": 257}, 5)
        assert view.holders(chain[:100]) == {"n1": 65}
        assert view.holders(chain, {"n1": lease + 1}) == {}      # another epoch: left out
        assert len(view) == 10 and pub.stats()["anchors"] == 10
        # Evicted pages leave the directory; a page placed and removed before a flush never enters it.
        pub.removed(chain[200:])
        pub.removed([PageKey(b"\0" * 16)])                        # never published: nothing to do
        assert view.wait(lambda d: d.holders(chain) == {"n1": 193}, 5)
        # A new lease (the node registered again): its anchors are put under it.
        lease2 = client.grant(30)
        pub.set_lease(lease2)
        client.revoke(lease)
        assert view.wait(lambda d: d.holders(chain, {"n1": lease2}) == {"n1": 193}, 5)
        assert len(view) == 9
        # The lease ends: the anchors leave with it.
        pub.close()
        client.revoke(lease2)
        assert view.wait(lambda d: len(d) == 0, 5)
    finally:
        pub.close()
        view.close()


def test_the_directory_lists_again_when_etcd_returns(etcd: LocalEtcd) -> None:
    client = Etcd([etcd.endpoint], timeout_s=0.5)
    view = Directory(client, "c", check_s=0.2).start()
    try:
        lease = client.grant(60)
        client.put(D.anchor_key(D.pages_prefix("c"), b"k" * 16, "n2"), b"dram", lease)
        assert view.wait(lambda d: d.holders([b"k" * 16]) == {"n2": 1}, 5)
        relists = view.relists
        etcd.pause()
        assert wait_for(lambda: view.stale, 5)
        etcd.resume()
        assert wait_for(lambda: not view.stale, 10)
        assert view.relists > relists                    # listed again: events may have been missed
        client.put(D.anchor_key(D.pages_prefix("c"), b"j" * 16, "n2"), b"dram", lease)
        assert view.wait(lambda d: d.holders([b"j" * 16]) == {"n2": 1}, 5)
    finally:
        view.close()


def node(tmp_path: Path, sock_dir: Path, etcd: LocalEtcd, name: str, dram_pages: int = 64) -> NodeService:
    cfg = StoreConfig(path=str(tmp_path / name), model_id="m", layout=LAYOUT, dram=DramConfig(dram_pages * PB),
                      policy="lru", peers=PeersConfig(serve="127.0.0.1:0", transport="tcp", timeout_s=2.0,
                                                      secret_file=secret_file(tmp_path)),
                      cluster=ClusterConfig((etcd.endpoint,), "c", name, lease_ttl_s=6))
    return NodeService(cfg, sock_dir / f"{name}.sock").start()


def test_nodes_publish_what_they_serve_and_ask_the_member_that_holds_a_prefix(
        etcd: LocalEtcd, tmp_path: Path, sock_dir: Path) -> None:
    services = [node(tmp_path, sock_dir, etcd, n) for n in ("a", "b", "c")]
    try:
        a, b, c = services
        a_ep = a.store.peer_address
        assert wait_for(lambda: len(b.store.fetch_peers()) == 2, 10)
        tokens = np.random.default_rng(4).integers(0, 50_000, 40 * TPP)
        data = page_data(4, 40)
        a.store.put(tokens, data)
        keys = keys_of(tokens)
        route = b._cluster._route
        assert wait_for(lambda: route(keys) == [a_ep], 10)              # only a is asked
        assert route(keys_of(tokens, tenant="t")) == []                  # another tenant's keys: nobody
        anchors = 6 + sum(k[-1] % ANCHOR_EVERY == 0 for k in keys[SHALLOW:])
        assert wait_for(lambda: a.status()["cluster"]["directory"]["published"]["anchors"] == anchors, 5)
        assert b.store.lookup(tokens).cached_pages == 40
        out = np.zeros((40, PB), np.uint8)
        got = b.store.get(tokens, out)
        assert got.pages == 40 and got.tiers == (TierKind.PEER,) * 40 and np.array_equal(out, data)
        # b now holds them too (kept after the fetch): both are named, a before b for c.
        assert wait_for(lambda: set(c._cluster._route(keys)) == {a_ep, b.store.peer_address}, 10)
        # a closes: its anchors leave with its lease; c asks b.
        a.close()
        assert wait_for(lambda: c._cluster._route(keys) == [b.store.peer_address], 10)
        got = c.store.get(tokens, np.zeros((40, PB), np.uint8))
        assert got.pages == 40
    finally:
        for svc in services:
            svc.close()


def test_pages_evicted_from_the_served_tier_leave_the_directory(
        etcd: LocalEtcd, tmp_path: Path, sock_dir: Path) -> None:
    a = node(tmp_path, sock_dir, etcd, "a", dram_pages=8)
    view = Directory(Etcd([etcd.endpoint]), "c", check_s=0.2).start()
    try:
        first = np.arange(4 * TPP)
        a.store.put(first, page_data(1, 4))
        keys = keys_of(first)
        assert view.wait(lambda d: d.holders(keys) == {"a": 4}, 10)
        for i in range(3):   # other prompts push the first one out of the 8-page DRAM tier (no tier below)
            a.store.put(np.arange(4 * TPP) + 100_000 * (i + 1), page_data(2 + i, 4))
        assert a.store.lookup(first).cached_pages == 0
        assert view.wait(lambda d: d.holders(keys) == {}, 10)
    finally:
        view.close()
        a.close()


@pytest.mark.parametrize("bad", [b"/tierkv/c/pages/zz/n", b"/tierkv/c/pages/" + b"0" * 32, b"/tierkv/c/pages/00/n"])
def test_the_directory_ignores_keys_that_are_not_anchors(etcd: LocalEtcd, bad: bytes) -> None:
    client = Etcd([etcd.endpoint])
    client.put(bad, b"dram")
    client.put(D.anchor_key(D.pages_prefix("c"), b"k" * 16, "n"), b"dram")
    view = Directory(client, "c", check_s=0.1).start()
    try:
        assert len(view) == 1 and view.holders([b"k" * 16]) == {"n": 1}
        time.sleep(0.6)
        assert view.relists == 1 and not view.stale      # the stray key counted: no listing again and again
    finally:
        view.close()


def test_the_anchor_table_keeps_one_entry_per_page_and_node() -> None:
    t = D.AnchorTable()
    t.add(b"k" * 16, "a", 1)
    t.add(b"k" * 16, "b", 2)
    t.add(b"k" * 16, "a", 3)                       # a again under a new lease: replaces its entry
    assert sorted(t.holders(b"k" * 16)) == [("a", 3), ("b", 2)] and t.count == 2
    t.add(b"j" * 16, "a", 3)
    t.remove(b"k" * 16, "a")
    t.remove(b"k" * 16, "c")                       # never there
    assert t.holders(b"k" * 16) == [("b", 2)] and t.holders(b"j" * 16) == [("a", 3)] and t.count == 2
    t.remove(b"k" * 16, "b")
    t.remove(b"j" * 16, "a")
    assert t.masks == {} and t.count == 0
    for i in range(300):                           # holder numbers are reused once unused
        t.add(bytes([i % 256]) * 16, f"n{i}", i)
        t.remove(bytes([i % 256]) * 16, f"n{i}")
    t.add(b"k" * 16, "z", 9)
    assert len(t._holders) == 3 and t.masks[b"k" * 16].bit_length() <= 3   # never more numbers than held at once


class HeldEtcd(Etcd):
    """A real etcd client whose transactions can be held before they go, or fail after
    etcd committed them (an answer lost: the outcome unknown to the caller)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__([endpoint])
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.lose_answers = 0

    def write(self, puts: Sequence[tuple[bytes, bytes]] = (), deletes: Sequence[bytes] = (), lease: int = 0) -> int:
        self.entered.set()
        self.gate.wait(10)
        rev = super().write(puts, deletes, lease)
        if self.lose_answers:
            self.lose_answers -= 1
            raise ClusterUnavailableError("the answer was lost (test)")
        return rev


def anchor_in_etcd(client: Etcd, key: bytes, node: str = "n1") -> bool:
    return client.get(D.anchor_key(D.pages_prefix("c"), key, node)) is not None


def test_a_page_removed_while_its_put_is_in_flight_leaves_etcd(etcd: LocalEtcd) -> None:
    client = HeldEtcd(etcd.endpoint)
    pub = Publisher(client, "c", "n1", flush_s=0.01)
    try:
        pub.set_lease(client.grant(30))
        k = PageKey(os.urandom(16))
        client.gate.clear()
        pub.placed([k], [0])
        assert client.entered.wait(5)                    # the put is in flight, held
        pub.removed([k])
        client.gate.set()
        assert pub.flushed(5)
        assert wait_for(lambda: not anchor_in_etcd(client, k), 5) and pub.stats()["anchors"] == 0
        # A lease change while a delete is in flight does not put the page back.
        k2 = PageKey(os.urandom(16))
        pub.placed([k2], [0])
        assert pub.flushed(5) and anchor_in_etcd(client, k2)
        client.entered.clear()
        client.gate.clear()
        pub.removed([k2])
        assert client.entered.wait(5)
        pub.set_lease(client.grant(30))
        client.gate.set()
        assert pub.flushed(5)
        time.sleep(0.2)
        assert not anchor_in_etcd(client, k2) and pub.stats()["anchors"] == 0
    finally:
        client.gate.set()
        pub.close()


def test_writes_whose_answer_was_lost_are_sent_again(etcd: LocalEtcd) -> None:
    client = HeldEtcd(etcd.endpoint)
    pub = Publisher(client, "c", "n1", flush_s=0.01)
    try:
        pub.set_lease(client.grant(30))
        # A put committed, its answer lost; then the page leaves: the delete must be sent.
        k = PageKey(os.urandom(16))
        client.lose_answers = 1
        pub.placed([k], [0])
        assert wait_for(lambda: pub.stats()["errors"] == 1, 5) and anchor_in_etcd(client, k)
        pub.removed([k])
        assert pub.flushed(5) and wait_for(lambda: not anchor_in_etcd(client, k), 5)
        # A delete committed, its answer lost; then the page comes back: the put must be sent.
        k2 = PageKey(os.urandom(16))
        pub.placed([k2], [0])
        assert pub.flushed(5) and anchor_in_etcd(client, k2)
        client.lose_answers = 1
        pub.removed([k2])
        assert wait_for(lambda: pub.stats()["errors"] == 2, 5) and not anchor_in_etcd(client, k2)
        pub.placed([k2], [0])
        assert pub.flushed(5) and wait_for(lambda: anchor_in_etcd(client, k2), 5)
        assert not pub.stats()["etcd_away"]
    finally:
        pub.close()


def test_an_idle_watch_is_resumed_not_listed_again(etcd: LocalEtcd, monkeypatch: pytest.MonkeyPatch) -> None:
    from tierkv.cluster import etcd as E

    monkeypatch.setattr(E, "WATCH_IDLE_S", 0.5)          # the watch's stream ends after 0.5 s of silence
    client = Etcd([etcd.endpoint])
    view = Directory(client, "c", check_s=0.1).start()
    try:
        assert wait_for(lambda: view.rewatches >= 2, 10)
        lease = client.grant(30)
        client.put(D.anchor_key(D.pages_prefix("c"), b"k" * 16, "n"), b"dram", lease)
        assert view.wait(lambda d: d.holders([b"k" * 16]) == {"n": 1}, 5)
        assert view.relists == 1
    finally:
        view.close()


def test_a_listing_goes_in_pages_at_one_revision(etcd: LocalEtcd) -> None:
    client = Etcd([etcd.endpoint])
    for i in range(10):
        client.put(b"/p/" + bytes([65 + i]), b"v")
    client.put(b"/q", b"outside")
    rev, kvs = client.get_prefix_paged(b"/p/", page=3)
    assert [kv.key for kv in kvs] == [b"/p/" + bytes([65 + i]) for i in range(10)] and rev > 0
    assert client.get_prefix_paged(b"/none/", page=3)[1] == []
