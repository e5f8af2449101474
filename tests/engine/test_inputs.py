"""Bad arguments to the engine copies and the HBM tier are InputError/LayoutError, never
silently reinterpreted (found by a review; every case ran on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierkv.engine import EngineKV, EngineLayout
from tierkv.engine.rows import CopyPath
from tierkv.errors import InputError, LayoutError
from tierkv.layout import KVLayout
from tierkv.tiers.hbm import HbmTier

STORE = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bf16", tokens_per_page=8)


def engine(**kw: object) -> EngineKV:
    layout = EngineLayout.for_store(STORE, "flash", 4)
    layers = [torch.zeros(layout.layer_shape(6), dtype=torch.bfloat16) for _ in range(STORE.num_layers)]
    return EngineKV(layout, layers, STORE, **kw)  # type: ignore[arg-type]


def test_layout_for_store_checks_its_arguments() -> None:
    assert EngineLayout.for_store(STORE, "FLASH").block_size == STORE.tokens_per_page
    with pytest.raises(LayoutError, match="unknown engine layout"):
        EngineLayout.for_store(STORE, "nope")
    with pytest.raises(LayoutError, match="block_size"):
        EngineLayout.for_store(STORE, "flash", 0)   # not "the default"


def test_copy_path_and_launch_width_are_checked() -> None:
    assert engine(path="kernel").path is CopyPath.KERNEL and engine(path="TORCH").path is CopyPath.TORCH
    with pytest.raises(InputError, match="copy path"):
        engine(path="bogus")
    with pytest.raises(InputError, match="max_ctas"):
        engine(max_ctas=0)
    with pytest.raises(InputError, match="copy path"):
        HbmTier(2, STORE.page_bytes, device="cpu", path="fast")  # type: ignore[arg-type]


def test_empty_batches_are_no_ops_and_layers_must_be_a_range() -> None:
    kv = engine()
    empty = torch.from_numpy(np.zeros((0, STORE.page_bytes), np.uint8))   # strides [0, 0]
    kv.scatter(empty, [])
    assert kv.gather([], out=empty).shape[0] == 0
    with pytest.raises(InputError, match="contiguous range"):
        kv.gather([0, 1], layers=[0])  # type: ignore[arg-type]


def test_layers_that_share_memory_are_refused() -> None:
    layout = EngineLayout.for_store(STORE, "flash", 4)
    big = torch.zeros((2, 7, 4, 2, 8), dtype=torch.bfloat16)      # layer 1 starts one block into layer 0
    with pytest.raises(InputError, match="layers 0 and 1 share memory"):
        EngineKV(layout, [big[:, :6], big[:, 1:]], STORE)
    tight = torch.zeros((2, 2048), dtype=torch.bfloat16)           # blocks one token apart overlap
    views = [torch.as_strided(t, layout.layer_shape(6), (6 * 64, 16, 16, 8, 1)) for t in tight]
    with pytest.raises(InputError, match="overlap inside a layer"):
        EngineKV(layout, views, STORE)


def test_layer_interleaved_views_of_one_allocation_are_accepted() -> None:
    """[blocks, layers, 2, block, heads, dim] split into per-layer FLASH views: spans
    overlap, bytes do not, and copies keep blocks apart."""
    layout = EngineLayout.for_store(STORE, "flash", 4)
    alloc = torch.zeros((6, STORE.num_layers, 2, 4, 2, 8), dtype=torch.bfloat16)
    layers = [alloc[:, i].transpose(0, 1) for i in range(STORE.num_layers)]
    kv = EngineKV(layout, layers, STORE)
    pages = torch.arange(2 * STORE.page_bytes, dtype=torch.int64).remainder(251).to(torch.uint8).view(2, -1)
    kv.scatter(pages, [0, 1, 4, 5])
    assert torch.equal(kv.gather([0, 1, 4, 5]), pages)
    assert not alloc[2:4].any()


def test_one_tensor_shared_by_two_layers_and_empty_layers_are_accepted() -> None:
    """vLLM's KV sharing hands two layers the same tensor: copies write it the same bytes.
    An engine with no blocks yet registers too."""
    layout = EngineLayout.for_store(STORE, "flash", 4)
    one = torch.zeros(layout.layer_shape(6), dtype=torch.bfloat16)
    kv = EngineKV(layout, [one, one], STORE)
    assert kv.num_blocks == 6
    empty = [torch.zeros(layout.layer_shape(0), dtype=torch.bfloat16) for _ in range(STORE.num_layers)]
    assert EngineKV(layout, empty, STORE).num_blocks == 0
