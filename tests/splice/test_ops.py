"""The store's splice (tierkv.splice.ops) on real stores (DRAM and an NVMe tier of O_DIRECT
files) with a real transformers Llama (random weights, from a config): the pages past an
edit are moved from the cached ones, their first layer's keys exact against a fresh
prefill of the edited text; derived pages are returned only when asked for, never to an
exact lookup or get, never to another tenant."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tierkv.config import DramConfig, NvmeConfig, StoreConfig
from tierkv.errors import InputError
from tierkv.splice.rope import Rope
from tierkv.store.api import Store
from tierkv.store import derived

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.splice.llama import DIM, HEADS, LAYERS, LAYOUT, TPP, kv_pages, layer0_keys  # noqa: E402


@pytest.fixture
def store(tmp_path: Path) -> object:
    cfg = StoreConfig(path=str(tmp_path / "s"), model_id="llama-test", layout=LAYOUT,
                      dram=DramConfig(24 * LAYOUT.page_bytes), nvme=NvmeConfig(128 * LAYOUT.page_bytes), policy="lru")
    with Store.open(cfg) as s:
        yield s


@pytest.mark.parametrize("start, end, replacement", [
    (100, 237, 0),      # 137 tokens deleted: rows cross page boundaries
    (96, 160, 0),       # 64 deleted: whole pages
    (100, 140, 40),     # 40 replaced by 40 others: same positions, different context
    (100, 100, 21),     # 21 inserted
])
def test_a_splice_moves_the_suffix_and_serves_it_only_when_asked(llama: object, store: Store, start: int, end: int,
                                                                  replacement: int) -> None:
    rng = np.random.default_rng(start + end + replacement)
    old = rng.integers(0, 1000, 640).astype(np.uint32)
    store.put(old, kv_pages(llama, old))
    rep = rng.integers(0, 1000, replacement).astype(np.uint32)
    res = store.splice(old, start, end, rep, rope=Rope.from_model(llama))
    new = res.tokens
    assert np.array_equal(new, np.concatenate([old[:start], rep, old[end:]]))
    first = start // TPP if not replacement else -(-(start + replacement) // TPP)   # a deletion: the edit's page
    assert res.prefill_from == start // TPP * TPP and res.first_derived == first
    assert res.prefill_to == first * TPP and (replacement or res.prefill_to == res.prefill_from)
    assert res.derived == new.size // TPP - res.first_derived and res.stored == res.derived > 0
    fresh = kv_pages(llama, new)
    # Exact gets and lookups never see a derived page: the edited prompt is cached up to the edit.
    assert store.lookup(new).cached_pages == start // TPP
    out = np.zeros((new.size // TPP, LAYOUT.page_bytes), np.uint8)
    assert store.get(new, out).pages == start // TPP
    # The engine prefills the replacement and the page it ends in, and puts them (exact pages).
    store.put(new[:res.prefill_to], fresh[:res.first_derived])
    assert store.lookup(new).cached_pages == res.first_derived
    look = store.lookup(new, accept="derived")
    assert look.cached_pages == new.size // TPP and look.derived == res.derived
    got = store.get(new, out, accept="derived")
    assert got.pages == new.size // TPP and got.derived == res.derived
    a = res.first_derived * TPP
    assert np.abs(layer0_keys(out)[a:] - layer0_keys(fresh)[a:]).max() <= 1e-5   # the first layer: exact
    assert store.stats().derived_pages == res.derived
    # Another tenant's prompt of the same tokens has none of them.
    assert store.lookup(new, "other", accept="derived").cached_pages == 0


def test_values_move_bit_for_bit_and_only_cached_rows_are_moved(llama: object, store: Store) -> None:
    rng = np.random.default_rng(9)
    old = rng.integers(0, 1000, 480).astype(np.uint32)
    pages = kv_pages(llama, old)
    store.put(old[:320], pages[:20])                       # the prompt cached up to token 320 only
    res = store.splice(old, 50, 90, np.zeros(0, np.uint32), rope=Rope.from_model(llama))
    # A deletion: derived pages from the edit's page (3); new token i >= 50 is old token
    # i + 40, cached while below 320.
    assert res.first_derived == 3 and res.derived == (320 - 40) // TPP - 3
    store.put(res.tokens[:res.prefill_to], kv_pages(llama, res.tokens)[:res.first_derived])
    out = np.zeros((res.tokens.size // TPP, LAYOUT.page_bytes), np.uint8)
    got = store.get(res.tokens, out, accept="derived")
    assert got.pages == res.first_derived + res.derived
    moved = out[res.first_derived:got.pages].view(np.float32).reshape(-1, *LAYOUT.page_shape)[:, :, 1]
    src = pages.view(np.float32).reshape(-1, *LAYOUT.page_shape)[:, :, 1]           # values [page, layer, tpp, H, D]
    src_tokens = src.transpose(0, 2, 1, 3, 4).reshape(-1, LAYERS, HEADS, DIM)
    moved_tokens = moved.transpose(0, 2, 1, 3, 4).reshape(-1, LAYERS, HEADS, DIM)
    new_idx = np.arange(res.first_derived * TPP, res.first_derived * TPP + moved_tokens.shape[0])
    old_idx = np.where(new_idx < 50, new_idx, new_idx + 40)
    assert np.array_equal(moved_tokens, src_tokens[old_idx])


def test_bad_splices_are_refused(llama: object, store: Store) -> None:
    old = np.arange(64, dtype=np.uint32)
    rope = Rope.from_model(llama)
    with pytest.raises(InputError, match="start <= end"):
        store.splice(old, 10, 5, [], rope=rope)
    with pytest.raises(InputError, match="start <= end"):
        store.splice(old, 0, 65, [], rope=rope)
    with pytest.raises(InputError, match="token index"):
        store.splice(old, 1.5, 5, [], rope=rope)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="accept"):
        store.get(old, np.zeros((4, LAYOUT.page_bytes), np.uint8), accept="approximate")
    assert store.splice(old, 10, 20, [], rope=rope).derived == 0          # nothing of it cached: nothing moved


def test_a_splices_own_reads_are_not_hits_and_a_reader_cannot_splice(llama: object, store: Store,
                                                                      tmp_path: Path) -> None:
    old = np.random.default_rng(3).integers(0, 1000, 320).astype(np.uint32)
    store.put(old, kv_pages(llama, old))
    before = store.stats()
    res = store.splice(old, 40, 80, np.zeros(0, np.uint32), rope=Rope.from_model(llama))
    assert res.derived > 0 and res.stored == res.derived
    after = store.stats()
    assert after.pages_hit == before.pages_hit and after.pages_requested == before.pages_requested
    assert {n: t.hits for n, t in after.tiers.items()} == {n: t.hits for n, t in before.tiers.items()}
    store.close()
    cfg = StoreConfig(path=str(tmp_path / "s"), model_id="llama-test", layout=LAYOUT,
                      dram=DramConfig(24 * LAYOUT.page_bytes), nvme=NvmeConfig(128 * LAYOUT.page_bytes), policy="lru")
    with Store.open(cfg, read_only=True) as reader:
        with pytest.raises(InputError, match="splice needs the writer; the store at .* was opened read-only"):
            reader.splice(old, 40, 80, [], rope=Rope.from_model(llama))


def test_truncate_and_insert_are_splices(llama: object, store: Store) -> None:
    old = np.random.default_rng(4).integers(0, 1000, 320).astype(np.uint32)
    store.put(old, kv_pages(llama, old))
    rope = Rope.from_model(llama)
    cut = store.truncate(old, 33, 70, rope=rope)
    assert np.array_equal(cut.tokens, np.concatenate([old[:33], old[70:]])) and cut.delta == -37 and cut.derived > 0
    ins = np.arange(5, dtype=np.uint32)
    added = store.insert(old, 100, ins, rope=rope)
    assert np.array_equal(added.tokens, np.concatenate([old[:100], ins, old[100:]])) and added.delta == 5


def test_a_daemons_clients_splice_and_get_derived_pages(llama: object, tmp_path: Path, sock_dir: Path) -> None:
    """The same through ``tierkv serve``: the rotary embedding travels with the request."""
    from tierkv.serve.daemon import NodeService

    cfg = StoreConfig(path=str(tmp_path / "d"), model_id="llama-test", layout=LAYOUT,
                      dram=DramConfig(64 * LAYOUT.page_bytes), policy="lru")
    svc = NodeService(cfg, sock_dir / "d.sock").start()
    try:
        with Store.connect(sock_dir / "d.sock") as remote:
            old = np.random.default_rng(6).integers(0, 1000, 320).astype(np.uint32)
            remote.put(old, kv_pages(llama, old), "acme")
            res = remote.splice(old, 40, 80, np.zeros(0, np.uint32), rope=Rope.from_model(llama), tenant="acme")
            assert res.derived > 0 and res.stored == res.derived
            fresh = kv_pages(llama, res.tokens)
            remote.put(res.tokens[:res.prefill_to], fresh[:res.first_derived], "acme")
            assert remote.lookup(res.tokens, "acme").cached_pages == res.first_derived     # exact: none derived
            look = remote.lookup(res.tokens, "acme", accept="derived")
            assert look.derived == res.derived and look.cached_pages == res.first_derived + res.derived
            out = np.zeros((res.tokens.size // TPP, LAYOUT.page_bytes), np.uint8)
            got = remote.get(res.tokens, out, "acme", accept="derived")
            assert got.derived == res.derived and got.pages == look.cached_pages
            a = res.first_derived * TPP
            n = got.pages * TPP
            assert np.abs(layer0_keys(out)[a:n] - layer0_keys(fresh)[a:n]).max() <= 1e-5
            assert remote.get(res.tokens, out, "acme").derived == 0
            assert remote.lookup(res.tokens, "other", accept="derived").cached_pages == 0
    finally:
        svc.close()


def test_a_deletion_reads_only_the_pages_its_rows_come_from(llama: object, store: Store,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The span removed is not read (a history trim may drop most of a prompt), and an
    edit that changes nothing stores nothing."""
    old = np.random.default_rng(12).integers(0, 1000, 640).astype(np.uint32)
    store.put(old, kv_pages(llama, old))
    reads: list[tuple[int, int]] = []
    real = derived.read_exact

    def spy(s: Store, tokens: np.ndarray, tenant: str | bytes, first: int, rows: np.ndarray) -> int:
        reads.append((first, rows.shape[0]))
        return real(s, tokens, tenant, first, rows)

    monkeypatch.setattr(derived, "read_exact", spy)
    res = store.truncate(old, 40, 520, rope=Rope.from_model(llama))   # 480 of 640 tokens dropped
    assert res.first_derived == 2 and res.derived == 8 and res.stored == 8
    assert reads == [(2, 1), (32, 8)]                  # the edit's page, then pages 32-39: none of 3-31
    reads.clear()
    assert store.splice(old, 100, 100, [], rope=Rope.from_model(llama)).derived == 0 and reads == []
