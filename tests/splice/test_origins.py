"""Derived pages' origins (tierkv.store.derived): recorded by every splice, in memory and in
the store's LMDB index, read back by ``Store.origins``, a reader and a daemon's client;
kept across a restart for the pages that are, dropped for those that are not (a splice
that failed after recording, pages evicted), and an unreadable record costs its origin,
never its page."""

from __future__ import annotations

from pathlib import Path

import lmdb
import numpy as np
import pytest

from tierkv.config import DramConfig, NvmeConfig, StoreConfig
from tierkv.errors import TierIOError
from tierkv.keys import PageKey, namespace_digest, page_keys, tenant_salt
from tierkv.serve import protocol as P
from tierkv.splice.rope import Rope
from tierkv.store import derived
from tierkv.store.api import Store
from tierkv.store.derived import Origin
from tierkv.store.index import ORIGINS_DB

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.splice.llama import LAYOUT, TPP, kv_pages  # noqa: E402

NS = namespace_digest("llama-test", LAYOUT, tenant_salt(""))


def config(path: Path, dram_pages: int = 24, nvme_pages: int = 128, **kw: object) -> StoreConfig:
    return StoreConfig(path=str(path), model_id="llama-test", layout=LAYOUT, policy="lru",
                       dram=DramConfig(dram_pages * LAYOUT.page_bytes),
                       nvme=NvmeConfig(nvme_pages * LAYOUT.page_bytes) if nvme_pages else None,
                       **kw)  # type: ignore[arg-type]


def expected(old: np.ndarray, start: int, end: int, rep: int, first: int, n: int) -> list[tuple[int, ...]]:
    """The cached prompt's pages each derived page's rows come from (by the splice's maths)."""
    delta = rep - (end - start)
    out = []
    for j in range(first, first + n):
        new_idx = np.arange(j * TPP, (j + 1) * TPP)
        old_idx = np.where(new_idx < start, new_idx, new_idx - delta)
        out.append(tuple(int(p) for p in np.unique(old_idx // TPP)))
    return out


@pytest.mark.parametrize("start, end, replacement, mode", [
    (100, 237, 0, "truncate"),
    (100, 140, 40, "replace"),
    (100, 100, 21, "insert"),
])
def test_each_derived_page_has_its_origin(llama: object, tmp_path: Path, start: int, end: int, replacement: int,
                                          mode: str) -> None:
    rng = np.random.default_rng(start + end)
    old = rng.integers(0, 1000, 640).astype(np.uint32)
    rep = rng.integers(0, 1000, replacement).astype(np.uint32)
    with Store.open(config(tmp_path / "s")) as store:
        store.put(old, kv_pages(llama, old))
        res = store.splice(old, start, end, rep, rope=Rope.from_model(llama))
        assert res.stored == res.derived > 0
        store.put(res.tokens[:res.prefill_to], kv_pages(llama, res.tokens)[:res.first_derived])
        found = store.origins(res.tokens)
        assert len(found) == res.derived == store.lookup(res.tokens, accept="derived").derived
        old_keys = page_keys(old, LAYOUT, NS)
        for o, sources, page in zip(found, expected(old, start, end, replacement, res.first_derived, res.derived),
                                    range(res.first_derived, res.first_derived + res.derived)):
            assert o is not None and (o.page, o.mode, o.delta, o.start, o.end) == (page, mode, res.delta, start, end)
            assert o.sources == sources and o.source_keys == tuple(old_keys[p] for p in sources)
        assert any(len(o.sources) == 2 for o in found if o is not None) == bool(res.delta % TPP)
        # Nothing else is derived: the cached prompt, another tenant's edited one.
        assert store.origins(old) == [] and store.origins(res.tokens, "other") == []
        # Recorded in the index too, one record per derived page.
        assert store._index is not None and len(store._index.origins()) == res.derived


def test_origins_survive_a_restart_with_their_pages(llama: object, tmp_path: Path) -> None:
    """After a restart the derived pages (persisted at close) have the same origins, a
    reader sees them too, and origins whose pages are not held (what a crash between a
    splice's record and its store leaves) are gone."""
    old = np.random.default_rng(1).integers(0, 1000, 640).astype(np.uint32)
    cfg = config(tmp_path / "s")
    with Store.open(cfg) as store:
        store.put(old, kv_pages(llama, old))
        res = store.truncate(old, 50, 130, rope=Rope.from_model(llama))
        before = store.origins(res.tokens)
        assert len(before) == res.derived > 0
        assert store._index is not None and len(store._index.origins()) == res.derived
        stray = [bytes([i]) * 16 for i in range(5)]      # origins of pages never stored
        one = before[0]
        assert one is not None
        store._index.write_origins(put=[(k, one.pack(k)) for k in stray])
    with Store.open(cfg) as store:
        assert store.lookup(res.tokens, accept="derived").derived == res.derived
        assert store.origins(res.tokens) == before
        assert store._index is not None and len(store._index.origins()) == len(store._provenance) == res.derived
        assert store._index.origins(stray) == []
    with Store.open(cfg, read_only=True) as reader:
        assert reader.lookup(res.tokens, accept="derived").derived == res.derived
        assert reader.origins(res.tokens) == before


def test_origins_are_recorded_before_their_pages_and_go_with_a_failed_splice(
        llama: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Origins are durable before their pages are stored, so a crash between leaves
    origins without pages (dropped at the next open), never pages without origins; a
    splice whose pages fail to be stored takes its origins back."""
    old = np.random.default_rng(2).integers(0, 1000, 320).astype(np.uint32)
    with Store.open(config(tmp_path / "s")) as store:
        store.put(old, kv_pages(llama, old))
        real = store._store
        seen: list[int] = []

        def check(keys: list[PageKey], rows: np.ndarray, first: int) -> None:
            assert store._index is not None
            recorded = {k for k, _ in store._index.origins(keys[first:])}   # read back from LMDB
            assert recorded == set(keys[first:])
            seen.append(len(recorded))
            real(keys, rows, first)
        with monkeypatch.context() as m:
            m.setattr(store, "_store", check)
            res = store.truncate(old, 40, 80, rope=Rope.from_model(llama))
        assert seen == [res.derived] and len(store.origins(res.tokens)) == res.derived

        def fail(*_a: object, **_k: object) -> None:
            raise TierIOError("the tier failed")
        with monkeypatch.context() as m:
            m.setattr(store, "_store", fail)
            with pytest.raises(TierIOError):
                store.truncate(old, 100, 150, rope=Rope.from_model(llama))
        assert store._index is not None and len(store._index.origins()) == res.derived == len(store._provenance)


def test_a_derived_page_held_already_keeps_its_origin(llama: object, tmp_path: Path) -> None:
    """Two edits that make the same derived page from different rows (deleting 20 or 30
    tokens before the same suffix, after the same prefix): the page keeps the first
    splice's bytes, and so its origin."""
    rng = np.random.default_rng(5)
    head, tail = rng.integers(0, 1000, 40).astype(np.uint32), rng.integers(0, 1000, 200).astype(np.uint32)
    one = np.concatenate([head, rng.integers(0, 1000, 20).astype(np.uint32), tail])
    two = np.concatenate([head, rng.integers(0, 1000, 30).astype(np.uint32), tail])
    rope = Rope.from_model(llama)
    with Store.open(config(tmp_path / "s")) as store:
        store.put(one, kv_pages(llama, one))
        store.put(two, kv_pages(llama, two))
        a = store.truncate(one, 40, 60, rope=rope)
        b = store.truncate(two, 40, 70, rope=rope)
        assert np.array_equal(a.tokens, b.tokens) and a.derived == b.derived > 0
        found = store.origins(a.tokens)
        assert len(found) == a.derived and all(o is not None and o.delta == -20 for o in found)
        assert store._index is not None
        assert all(Origin.unpack(k, v).delta == -20 for k, v in store._index.origins())


def test_an_unreadable_origin_costs_the_origin_not_the_page(llama: object, tmp_path: Path) -> None:
    old = np.random.default_rng(3).integers(0, 1000, 320).astype(np.uint32)
    cfg = config(tmp_path / "s", dram_pages=4)
    with Store.open(cfg) as store:
        store.put(old, kv_pages(llama, old))
        res = store.truncate(old, 40, 80, rope=Rope.from_model(llama))
        store.flush()
        n = store.lookup(res.tokens, accept="derived").derived
        assert n > 1
    env = lmdb.open(str(tmp_path / "s" / "index.lmdb"), max_dbs=16, subdir=True)
    db = env.open_db(ORIGINS_DB)
    with env.begin(db=db, write=True) as txn:
        key, value = next(iter(txn.cursor()))
        txn.put(key, bytes([value[0] ^ 1]) + bytes(value[1:]))   # the mode byte flipped: the seal fails
    env.close()
    with Store.open(cfg) as store:
        assert store.lookup(res.tokens, accept="derived").derived == n   # every page still served
        found = store.origins(res.tokens)
        assert len(found) == n and found.count(None) == 1
        assert store._index is not None and len(store._index.origins()) == n - 1


def test_origins_of_evicted_pages_go_while_the_store_runs(llama: object, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(derived, "PRUNE_MIN", 8)
    old = np.random.default_rng(4).integers(0, 1000, 320).astype(np.uint32)
    rope = Rope.from_model(llama)
    with Store.open(config(tmp_path / "s", dram_pages=40, nvme_pages=0)) as store:
        store.put(old, kv_pages(llama, old))
        most = 0
        for cut in range(8):
            store.pin(old)   # the cached prompt stays; derived pages push each other out
            res = store.truncate(old, 20 + 16 * cut, 40 + 16 * cut, rope=rope)
            store.unpin(old)
            most = max(most, len(store._provenance))
            assert store.origins(res.tokens) == [o for o in store.origins(res.tokens) if o is not None]
        # 108 origins recorded in all; at most 20 derived pages fit beside the pinned 20, and
        # a prune comes once there would be twice as many origins as pages held at the last.
        assert most <= 2 * 20
        store._provenance.prune()
        held = store._manager.held(b"".join(store._provenance._origins))
        assert all(held)


def test_origins_through_a_daemon_page_by_page(llama: object, tmp_path: Path, sock_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from tierkv.serve.daemon import NodeService

    monkeypatch.setattr(P, "ORIGINS_PER_REPLY", 3)   # a reply carries 3: the client asks until it has them all
    svc = NodeService(config(tmp_path / "d", nvme_pages=0), sock_dir / "d.sock").start()
    try:
        with Store.connect(sock_dir / "d.sock") as remote:
            old = np.random.default_rng(6).integers(0, 1000, 320).astype(np.uint32)
            remote.put(old, kv_pages(llama, old), "acme")
            res = remote.splice(old, 40, 80, np.zeros(0, np.uint32), rope=Rope.from_model(llama), tenant="acme")
            found = remote.origins(res.tokens, "acme")
            assert len(found) == res.derived > 3
            assert found == svc.store.origins(res.tokens, "acme")
            assert all(isinstance(o, Origin) and o.mode == "truncate" and o.delta == -40 for o in found)
            assert remote.origins(res.tokens, "other") == []
    finally:
        svc.close()

