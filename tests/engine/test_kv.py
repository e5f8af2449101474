"""Gather and scatter between an engine's paged KV and store pages, on every layout and path.

Each body runs on CPU (torch path, and the kernel's descriptors through the host
emulation) and on CUDA when present. Expected pages come from plain slicing
(``targets.reference_pages``), never from tierkv.engine itself. Every copy test checks
that its source is unchanged and that blocks and rows it did not target are untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.targets import TARGETS, Target, as_bytes, random_bytes, random_layers, reference_pages
from tierkv.engine import EngineKV, EngineLayout, EngineLayoutKind, gather, scatter
from tierkv.engine.rows import CopyPath
from tierkv.errors import InputError
from tierkv.layout import KVLayout, LayoutKind

NUM_BLOCKS = 12
KV_STORE = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bf16", tokens_per_page=8)
LATENT_STORE = KVLayout(num_layers=3, num_kv_heads=1, head_dim=24, dtype="bf16", tokens_per_page=8,
                        kind=LayoutKind.LATENT)
# (engine layout kind, store layout, engine block size): k = 8 // block size blocks per page
CASES = [(kind, store, bs) for kind, store in (("flash", KV_STORE), ("blocks_first", KV_STORE), ("mla", LATENT_STORE))
         for bs in (8, 4)]
CASE_IDS = [f"{kind}-k{8 // bs}" for kind, _, bs in CASES]


def make_kv(target: Target, kind: str, store: KVLayout, block_size: int, seed: int = 0) -> tuple[EngineKV, list[torch.Tensor]]:
    layout = EngineLayout.for_store(store, kind, block_size)
    layers = random_layers(layout, NUM_BLOCKS, target.device, seed)
    return EngineKV(layout, layers, store, path=target.path), layers


def snapshot(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    return [as_bytes(t) for t in layers]


def block_bytes(kind: str, layers: list[torch.Tensor], block: int) -> torch.Tensor:
    """Every byte of one engine block across layers (both planes)."""
    parts = [t[:, block] if kind == "flash" else t[block] for t in layers]
    return torch.cat([as_bytes(p).reshape(-1) for p in parts])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("kind", "store", "block_size"), CASES, ids=CASE_IDS)
def test_gather_matches_slicing(target: Target, kind: str, store: KVLayout, block_size: int) -> None:
    kv, layers = make_kv(target, kind, store, block_size)
    before = snapshot(layers)
    k = store.tokens_per_page // block_size
    ids = [9, 2, 5, 11, 0, 7, 3, 4][: 4 * k]
    pages = gather(kv, ids)
    assert pages.device == target.device and pages.shape == (len(ids) // k, store.page_bytes)
    assert torch.equal(as_bytes(pages), reference_pages(kv.layout, store.tokens_per_page, layers, ids))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(layers)))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("kind", "store", "block_size"), CASES, ids=CASE_IDS)
def test_scatter_writes_only_targeted_blocks(target: Target, kind: str, store: KVLayout, block_size: int) -> None:
    kv, layers = make_kv(target, kind, store, block_size, seed=10)
    k = store.tokens_per_page // block_size
    ids = [6, 1, 10, 3, 8, 4][: 3 * k]
    pages = random_bytes((3, store.page_bytes), seed=99).to(target.device)
    kept_pages = as_bytes(pages)
    others = {b: block_bytes(kind, layers, b) for b in range(NUM_BLOCKS) if b not in ids}
    scatter(pages, kv, ids)
    assert torch.equal(as_bytes(pages), kept_pages)
    assert torch.equal(reference_pages(kv.layout, store.tokens_per_page, layers, ids), kept_pages)
    for b, old in others.items():
        assert torch.equal(block_bytes(kind, layers, b), old), f"untargeted block {b} changed"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("kind", "store", "block_size"), CASES[::2], ids=CASE_IDS[::2])
def test_rows_and_host_pages(target: Target, kind: str, store: KVLayout, block_size: int) -> None:
    """Gather into chosen rows of a larger (host, pinned on CUDA) buffer; other rows untouched; back again."""
    kv, layers = make_kv(target, kind, store, block_size, seed=20)
    buf = target.host(random_bytes((7, store.page_bytes), seed=5))
    before = as_bytes(buf)
    ids, rows = [4, 9, 0], [6, 1, 3]
    kv.gather(ids, out=buf, rows=rows)
    if target.cuda:
        torch.cuda.synchronize()
    expected = before.clone()
    expected[rows] = reference_pages(kv.layout, store.tokens_per_page, layers, ids)
    assert torch.equal(as_bytes(buf), expected)
    other, _ = make_kv(target, kind, store, block_size, seed=30)
    other.scatter(buf, [2, 5, 7], rows=rows)
    if target.cuda:
        torch.cuda.synchronize()
    assert torch.equal(as_bytes(other.gather([2, 5, 7])), expected[rows])
    assert torch.equal(as_bytes(buf), expected)


@pytest.mark.parametrize("target", TARGETS)
def test_pitched_pages_and_layer_ranges(target: Target) -> None:
    """Pages inside wider rows (tier slots wider than a page); a layer range copies only those layers."""
    kv, layers = make_kv(target, "flash", KV_STORE, 8, seed=40)
    pb, lpb = KV_STORE.page_bytes, kv.geometry.layer_page_bytes
    wide = random_bytes((4, pb + 64), seed=6).to(target.device)
    before = as_bytes(wide)
    kv.gather([3, 8], out=wide[:, :pb], rows=[2, 0], layers=range(1, 3))
    expected = before.clone()
    ref = reference_pages(kv.layout, KV_STORE.tokens_per_page, layers, [3, 8])
    expected[[2, 0], lpb:pb] = ref[:, lpb:]
    assert torch.equal(as_bytes(wide), expected)
    kv.scatter(wide[:, :pb], [5, 6], rows=[1, 3], layers=range(0, 1))
    got = reference_pages(kv.layout, KV_STORE.tokens_per_page, layers, [5, 6])
    assert torch.equal(got[:, :lpb], expected[[1, 3], :lpb])


@pytest.mark.parametrize("target", TARGETS)
def test_flash_view_of_one_allocation(target: Target) -> None:
    """A FLASH layer that is a permuted view of one blocks-first allocation (non-default strides)."""
    layout = EngineLayout.for_store(KV_STORE, "flash")
    base = random_layers(EngineLayout.for_store(KV_STORE, "blocks_first"), NUM_BLOCKS, target.device, seed=50)
    layers = [t.transpose(0, 1) for t in base]
    kv = EngineKV(layout, layers, KV_STORE, path=target.path)
    pages = kv.gather([1, 10])
    assert torch.equal(as_bytes(pages), reference_pages(layout, KV_STORE.tokens_per_page, layers, [1, 10]))
    zeros = [torch.zeros_like(t) for t in base]
    EngineKV(layout, [t.transpose(0, 1) for t in zeros], KV_STORE, path=target.path).scatter(pages, [4, 2])
    assert torch.equal(as_bytes(zeros[0][4]), as_bytes(base[0][1]))
    assert not as_bytes(zeros[0][0]).any()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["fp32", "fp8_e4m3"])
def test_other_dtypes(target: Target, dtype: str) -> None:
    store = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=dtype, tokens_per_page=4)
    kv, layers = make_kv(target, "blocks_first", store, 4, seed=60)
    pages = kv.gather([7, 1])
    assert torch.equal(as_bytes(pages), reference_pages(kv.layout, 4, layers, [7, 1]))


@pytest.mark.parametrize("target", TARGETS[:2])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_batches_round_trip(target: Target, data: st.DataObject) -> None:
    kind, store, block_size = data.draw(st.sampled_from(CASES))
    kv, layers = make_kv(target, kind, store, block_size, seed=70)
    k = store.tokens_per_page // block_size
    n = data.draw(st.integers(0, min(8, NUM_BLOCKS // k)))
    ids = data.draw(st.permutations(range(NUM_BLOCKS)))[: n * k]
    rows = data.draw(st.permutations(range(8)))[:n]
    buf = torch.zeros((8, store.page_bytes), dtype=torch.uint8)
    kv.gather(ids, out=buf, rows=rows)
    assert torch.equal(buf[rows], reference_pages(kv.layout, store.tokens_per_page, layers, ids)[:n]
                       if n else buf[rows])
    dest = data.draw(st.permutations(range(NUM_BLOCKS)))[: n * k]
    fresh = [torch.zeros_like(t) for t in layers]
    EngineKV(kv.layout, fresh, store, path=target.path).scatter(buf, dest, rows=rows)
    for src, dst in zip(ids, dest):
        assert torch.equal(block_bytes(kind, fresh, dst), block_bytes(kind, layers, src))


def test_kernel_descriptors_are_layer_major_and_aligned() -> None:
    kv, _ = make_kv(Target(torch.device("cpu"), CopyPath.KERNEL), "flash", KV_STORE, 4)
    desc = kv.descriptors(np.array([0, 1, 2, 3]), 4096, KV_STORE.page_bytes, np.array([1, 0]), range(3), True)
    g = kv.geometry
    assert desc.shape == (3 * 2 * 2 * 2, 2)
    per_layer = desc.reshape(3, -1, 2)
    for j in range(3):  # each layer's destinations stay inside that layer's slice of each page
        off = (per_layer[j, :, 1] - 4096) % KV_STORE.page_bytes
        assert ((off >= j * g.layer_page_bytes) & (off < (j + 1) * g.layer_page_bytes)).all()


@pytest.mark.parametrize(("call", "message"), [
    (lambda kv, p: kv.gather([0, 12]), "block id 12 out of range"),
    (lambda kv, p: kv.gather([-1]), "block id -1 out of range"),
    (lambda kv, p: kv.gather([0, 1], out=p, rows=[3, 3]), "twice"),
    (lambda kv, p: kv.gather([0, 1], out=p, rows=[0, 4]), "page row 4 out of range"),
    (lambda kv, p: kv.gather([0, 1], out=p, rows=[0]), "2 pages of block ids but 1 rows"),
    (lambda kv, p: kv.scatter(p[:2], [5, 5]), "twice"),
    (lambda kv, p: kv.scatter(p[:, :100], [5]), "uint8"),
    (lambda kv, p: kv.scatter(p.view(torch.int16), [5]), "uint8"),
    (lambda kv, p: kv.scatter(p[:, ::2], [5]), "uint8"),
    (lambda kv, p: kv.gather([1.5]), "integers"),
    (lambda kv, p: kv.gather([0], layers=range(2, 4)), "contiguous range"),
    (lambda kv, p: kv.gather([0], layers=range(0, 3, 2)), "contiguous range"),
])
def test_bad_arguments(call: object, message: str) -> None:
    kv, layers = make_kv(Target(torch.device("cpu"), CopyPath.TORCH), "flash", KV_STORE, 8)
    pages = torch.zeros((4, KV_STORE.page_bytes), dtype=torch.uint8)
    before = snapshot(layers)
    with pytest.raises(InputError, match=message):
        call(kv, pages)  # type: ignore[operator]
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(layers)))
    assert not pages.any()


def test_k2_needs_whole_pages_of_blocks() -> None:
    kv, _ = make_kv(Target(torch.device("cpu"), CopyPath.TORCH), "flash", KV_STORE, 4)
    with pytest.raises(InputError, match="3 block ids do not fill whole pages of 2"):
        kv.gather([0, 1, 2])


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda ls: ls[:2], "declares 3 layers, got 2"),
    (lambda ls: [ls[0], ls[1], ls[2].float()], "layer 2: expected torch.bfloat16"),
    (lambda ls: [ls[0], ls[1], ls[2][:, :5]], "layer 2: expected"),
    (lambda ls: [t.reshape(-1) for t in ls], "has shape"),
    (lambda ls: [t.transpose(3, 4).contiguous().transpose(3, 4) for t in ls], "contiguous inside"),
    (lambda ls: [ls[0], ls[1], ls[2].transpose(0, 1).contiguous().transpose(0, 1)], "strides"),
    (lambda ls: ["not a tensor"] * 3, "torch tensors"),
])
def test_bad_engine_tensors(mutate: object, message: str) -> None:
    layout = EngineLayout.for_store(KV_STORE, EngineLayoutKind.FLASH)
    layers = random_layers(layout, NUM_BLOCKS, torch.device("cpu"), 0)
    with pytest.raises(InputError, match=message):
        EngineKV(layout, mutate(layers), KV_STORE)  # type: ignore[operator]
