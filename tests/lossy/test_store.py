"""Lossy pages in a real store (tierkv.store.lossy_pages): put under keys of their own,
returned only to a get or lookup that accepts their budget, decoded to exactly what the
format decodes, after the exact pages; never to an exact call, another budget or another
tenant; kept across a restart on an NVMe tier, where a coding tier stores them small."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tierkv.config import DramConfig, NvmeConfig, StoreConfig
from tierkv.errors import InputError
from tierkv.layout import KVLayout
from tierkv.lossy.alloc import Importance, allocate
from tierkv.lossy.format import decode, encode
from tierkv.store.api import Store
from tierkv.store.lossy_pages import from_float, to_float

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_page=128)
TPP, PB = 128, LAYOUT.page_bytes
N = 4


def pages(seed: int, n: int = N) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, *LAYOUT.page_shape)).astype(np.float32)
    return np.stack([from_float(p, "bf16") for p in x])


def tokens(seed: int, n: int = N) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n * TPP).astype(np.uint32)


def config(path: Path, **nvme: object) -> StoreConfig:
    return StoreConfig(path=str(path), model_id="lossy-test", layout=LAYOUT, dram=DramConfig(8 * PB),
                       nvme=NvmeConfig(32 * PB, **nvme) if nvme is not None else None)  # type: ignore[arg-type]


def expected(raw: np.ndarray, budget: float, imp: Importance | None = None) -> tuple[np.ndarray, np.ndarray]:
    """What a lossy get must return for these exact pages: the format's decode, as bf16."""
    rows, evicted = [], []
    for i, row in enumerate(raw):
        page = to_float(row[None], "bf16", LAYOUT.page_shape)[0]
        sub = None if imp is None else Importance(imp.a2[:, :, i * TPP:(i + 1) * TPP], imp.qe)
        d = decode(encode(page, allocate(page, budget, sub), "bf16", budget))
        rows.append(from_float(d.page, "bf16"))
        evicted.append(~d.kept)
    return np.stack(rows), np.stack(evicted)


def test_lossy_pages_are_served_only_to_who_asks_for_their_budget(tmp_path: Path) -> None:
    toks, raw = tokens(1), pages(1)
    with Store.open(config(tmp_path / "s")) as s:
        r = s.put_lossy(toks, raw, 4.0)
        assert (r.stored, r.already_present, r.dropped) == (N, 0, 0)
        assert s.put_lossy(toks, raw, 4.0).already_present == N
        out = np.zeros((N, PB), np.uint8)
        # Never to an exact call, another budget, another tenant.
        assert s.lookup(toks).cached_pages == 0 and s.get(toks, out).pages == 0
        assert s.lookup(toks, accept_lossy=3.0).cached_pages == 0
        assert s.lookup(toks, "other", accept_lossy=4.0).cached_pages == 0
        assert s.lookup(toks, accept="derived").cached_pages == 0
        look = s.lookup(toks, accept_lossy=4.0)
        assert (look.cached_pages, look.lossy, look.derived) == (N, N, 0)
        got = s.get(toks, out, accept_lossy=4.0)
        assert (got.pages, got.lossy) == (N, N)
        want, evicted = expected(raw, 4.0)
        assert np.array_equal(out, want) and got.evicted is not None and np.array_equal(got.evicted, evicted)
        assert not np.array_equal(out, raw)                    # lossy: not the exact pages
        assert s.stats().lossy_pages == N


def test_exact_pages_first_then_lossy_ones(tmp_path: Path) -> None:
    toks, raw = tokens(2), pages(2)
    imp = Importance(np.random.default_rng(2).exponential(1.0, (2, 2, N * TPP)) ** 3, np.ones((2, 2, 64)))
    with Store.open(config(tmp_path / "s")) as s:
        s.put(toks[:2 * TPP], raw[:2])
        s.put_lossy(toks, raw, 2.5, importance=imp)
        out = np.zeros((N, PB), np.uint8)
        got = s.get(toks, out, accept_lossy=2.5)
        assert (got.pages, got.lossy) == (N, 2)
        assert np.array_equal(out[:2], raw[:2])                # exact where exact pages are
        want, evicted = expected(raw, 2.5, imp)
        assert np.array_equal(out[2:], want[2:])
        assert got.evicted is not None and not got.evicted[:2].any() and np.array_equal(got.evicted[2:], evicted[2:])
        assert got.evicted[2:].any()                           # 2.5 bits with peaked attention: some tokens go
        assert s.lookup(toks, accept_lossy=2.5).lossy == 2


def test_they_survive_a_restart_and_a_coding_tier_stores_them_small(tmp_path: Path) -> None:
    toks, raw = tokens(3), pages(3)
    cfg = config(tmp_path / "s", codec="lossless")
    with Store.open(cfg) as s:
        s.put_lossy(toks, raw, 4.0)
    with Store.open(cfg) as s:                                 # persisted at close, read back from NVMe
        out = np.zeros((N, PB), np.uint8)
        got = s.get(toks, out, accept_lossy=4.0)
        assert got.pages == N and np.array_equal(out, expected(raw, 4.0)[0])
        nvme = s.stats().tiers["nvme"]
        blocks_raw = N * PB // 4096
        assert nvme.used_slots * nvme.slot_bytes < 0.4 * blocks_raw * 4096   # about 4/16 of the raw pages


@pytest.mark.parametrize("budget, message", [(16.0, "under 16"), (0.5, "at least 1"), (float("nan"), "bits an"),
                                             (True, "bits an")])
def test_bad_budgets_are_refused(tmp_path: Path, budget: float, message: str) -> None:
    with Store.open(config(tmp_path / "s")) as s:
        with pytest.raises(InputError, match=message):
            s.put_lossy(tokens(4), pages(4), budget)
        with pytest.raises(InputError, match=message):
            s.lookup(tokens(4), accept_lossy=budget)
        with pytest.raises(InputError, match="cannot be asked together"):
            s.get(tokens(4), np.zeros((N, PB), np.uint8), accept="derived", accept_lossy=4.0)


def test_layouts_lossy_pages_cannot_code_are_refused(tmp_path: Path) -> None:
    fp8 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp8_e4m3", tokens_per_page=128)
    cfg = StoreConfig(path=str(tmp_path / "f"), model_id="m", layout=fp8, dram=DramConfig(8 * fp8.page_bytes))
    with Store.open(cfg) as s:
        with pytest.raises(InputError, match="a K/V layout of bf16, fp16 or fp32 pages"):
            s.put_lossy(tokens(5), np.zeros((N, fp8.page_bytes), np.uint8), 4.0)
    tiny = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="bf16", tokens_per_page=4)
    cfg = StoreConfig(path=str(tmp_path / "t"), model_id="m", layout=tiny, dram=DramConfig(8 * tiny.page_bytes))
    with Store.open(cfg) as s:
        with pytest.raises(InputError, match="below what this page needs at its narrowest"):   # a 48-byte header
            s.put_lossy(np.arange(4, dtype=np.uint32), np.zeros((1, tiny.page_bytes), np.uint8), 8.0)


def test_through_a_daemon_clients_code_and_decode(tmp_path: Path, sock_dir: Path) -> None:
    """A daemon's client codes its pages and decodes what it gets (the daemon moves blobs):
    the same rows as in-process; a client limited to some tenants, and rows that are no
    lossy blobs of this store's pages, are refused."""
    from tierkv.serve import protocol as P
    from tierkv.serve.daemon import NodeService

    toks, raw = tokens(6), pages(6)
    svc = NodeService(config(tmp_path / "d"), sock_dir / "d.sock").start()
    try:
        with Store.connect(sock_dir / "d.sock") as remote:
            remote.put(toks[:TPP], raw[:1], "acme")
            r = remote.put_lossy(toks, raw, 4.0, "acme")
            assert (r.stored, r.already_present) == (N, 0)
            assert remote.lookup(toks, "acme").cached_pages == 1
            look = remote.lookup(toks, "acme", accept_lossy=4.0)
            assert (look.cached_pages, look.lossy) == (N, N - 1)
            assert remote.lookup(toks, "other", accept_lossy=4.0).cached_pages == 0
            out = np.zeros((N, PB), np.uint8)
            got = remote.get(toks, out, "acme", accept_lossy=4.0)
            assert (got.pages, got.lossy) == (N, N - 1)
            want, evicted = expected(raw, 4.0)
            assert np.array_equal(out[0], raw[0]) and np.array_equal(out[1:], want[1:])
            assert got.evicted is not None and np.array_equal(got.evicted[1:], evicted[1:])
            inproc = np.zeros_like(out)
            assert svc.store.get(toks, inproc, "acme", accept_lossy=4.0).lossy == N - 1
            assert np.array_equal(inproc, out)
            with pytest.raises(InputError, match="cannot be asked together"):
                remote.lookup(toks, "acme", accept="derived", accept_lossy=4.0)
            # Rows that are no lossy blobs of this store's pages at this budget are refused by
            # the daemon, whatever a client sends.
            conn = remote._acquire()
            other = tokens(7)
            for row, budget, message in ((raw[0], 4.0, "not a lossy page's blob"),
                                         (remote_rows(raw[:1], 3.0)[0], 4.0, "at 3.0 bits")):
                scratch, view = conn.scratch_rows(1, PB)
                view[0] = row
                with pytest.raises(InputError, match=message):
                    conn.call(P.Op.PUT, conn.tokens(b"", other, P.PUT_REQ.pack(scratch.id, 0, 1, 0, 1, budget)))
            assert remote.lookup(other, accept_lossy=4.0).cached_pages == 0
    finally:
        svc.close()


def remote_rows(raw: np.ndarray, budget: float) -> np.ndarray:
    from tierkv.store.lossy_pages import code_rows
    return code_rows(LAYOUT, raw, len(raw), budget, None, None, True, "test")


def test_demotion_moves_lossy_and_exact_pages_together_to_a_coding_tier(tmp_path: Path) -> None:
    """DRAM of two pages over a coding NVMe tier: lossy pages at 12 bits (whose blobs the
    codec could pack tighter) and exact ones go down together, and every one reads back as
    put (tests/tiers/test_blocks.py holds the mixed batch a review found cut short)."""
    cfg = StoreConfig(path=str(tmp_path / "s"), model_id="lossy-test", layout=LAYOUT, dram=DramConfig(2 * PB),
                      nvme=NvmeConfig(32 * PB, codec="lossless"), policy="lru")
    def sparse(seed: int) -> np.ndarray:   # mostly zeros: the codec packs such a row tighter than its blob
        rng = np.random.default_rng(seed)
        x = rng.standard_normal(LAYOUT.page_shape)
        return from_float(np.where(rng.random(x.shape) < 0.05, np.round(x * 2) / 4, 0).astype(np.float32), "bf16")
    smooth = np.stack([sparse(i) for i in range(N)])
    toks, other = tokens(10), tokens(11)
    with Store.open(cfg) as s:
        s.put(toks[:TPP], smooth[:1])
        s.put_lossy(toks, smooth, 12.0)
        s.put(other, pages(11))                      # pushes everything above down to NVMe
        out = np.zeros((N, PB), np.uint8)
        got = s.get(toks, out, accept_lossy=12.0)
        assert (got.pages, got.lossy) == (N, N - 1)
        assert np.array_equal(out[0], smooth[0]) and np.array_equal(out[1:], expected(smooth, 12.0)[0][1:])
        assert s.get(other, np.zeros((N, PB), np.uint8)).pages == N
