"""The declared engine layouts and their mapping onto store pages."""

from __future__ import annotations

import pytest

from tierkv.engine.geometry import EngineLayout, EngineLayoutKind
from tierkv.errors import LayoutError
from tierkv.layout import DType, KVLayout, LayoutKind

STORE = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype="bf16", tokens_per_page=16)
LATENT = KVLayout(num_layers=4, num_kv_heads=1, head_dim=24, dtype="fp16", tokens_per_page=16, kind=LayoutKind.LATENT)


@pytest.mark.parametrize(("kind", "shape"), [
    ("flash", (2, 10, 16, 2, 8)), ("blocks_first", (10, 2, 16, 2, 8)),
])
def test_kv_layer_shapes(kind: str, shape: tuple[int, ...]) -> None:
    layout = EngineLayout.for_store(STORE, kind)
    assert layout.kind is EngineLayoutKind(kind)
    assert layout.layer_shape(10) == shape
    assert layout.planes == 2 and layout.chunk_bytes == 16 * 2 * 8 * 2


def test_mla_layer_shape() -> None:
    layout = EngineLayout.for_store(LATENT, EngineLayoutKind.MLA, block_size=8)
    assert layout.layer_shape(5) == (5, 8, 24)
    assert layout.planes == 1 and layout.chunk_bytes == 8 * 24 * 2
    g = layout.geometry(LATENT)
    assert (g.blocks_per_page, g.layer_page_bytes, g.plane_page_bytes) == (2, 16 * 24 * 2, 16 * 24 * 2)


def test_geometry_offsets_cover_the_page_once() -> None:
    for kind in ("flash", "blocks_first"):
        for block_size in (16, 8, 4):
            g = EngineLayout.for_store(STORE, kind, block_size).geometry(STORE)
            starts = sorted(layer * g.layer_page_bytes + p * g.plane_page_bytes + b * g.chunk_bytes
                            for layer in range(g.num_layers) for p in range(g.planes) for b in range(g.blocks_per_page))
            assert starts == list(range(0, STORE.page_bytes, g.chunk_bytes))
            assert g.page_bytes == STORE.page_bytes


@pytest.mark.parametrize(("engine", "message"), [
    (EngineLayout(EngineLayoutKind.FLASH, 3, 16, 2, 8), "num_layers 3 vs 4"),
    (EngineLayout(EngineLayoutKind.FLASH, 4, 16, 4, 8), "num_kv_heads 4 vs 2"),
    (EngineLayout(EngineLayoutKind.FLASH, 4, 16, 2, 16), "head_dim 16 vs 8"),
    (EngineLayout(EngineLayoutKind.FLASH, 4, 16, 2, 8, DType.FP16), "dtype"),
    (EngineLayout(EngineLayoutKind.FLASH, 4, 32, 2, 8), "not a multiple of block_size 32"),
    (EngineLayout(EngineLayoutKind.FLASH, 4, 6, 2, 8), "not a multiple of block_size 6"),
    (EngineLayout(EngineLayoutKind.MLA, 4, 16, 1, 8), "engine layout mla vs store layout kind kv"),
])
def test_mismatches_are_named(engine: EngineLayout, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        engine.geometry(STORE)


def test_engine_copies_refuse_pages_in_another_order() -> None:
    vllm_cpu = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype="bf16", tokens_per_page=16,
                        page_order="vllm_cpu")
    with pytest.raises(LayoutError, match="page_order 'vllm_cpu'; engine copies read and write the 'standard'"):
        EngineLayout.for_store(STORE, "flash").geometry(vllm_cpu)


def test_kv_engine_refuses_a_latent_store() -> None:
    with pytest.raises(LayoutError, match="flash vs store layout kind latent"):
        EngineLayout(EngineLayoutKind.FLASH, 4, 16, 1, 24, DType.FP16).geometry(LATENT)


@pytest.mark.parametrize("bad", [
    {"num_layers": 0}, {"block_size": -1}, {"num_kv_heads": True}, {"head_dim": 2.5}, {"kind": "paged"},
    {"dtype": "int4"}, {"kind": "mla", "num_kv_heads": 2},
])
def test_bad_declarations(bad: dict[str, object]) -> None:
    fields: dict[str, object] = {"kind": "flash", "num_layers": 2, "block_size": 16, "num_kv_heads": 2,
                                 "head_dim": 8, **bad}
    with pytest.raises(LayoutError):
        EngineLayout(**fields)  # type: ignore[arg-type]


def test_kind_and_dtype_spellings() -> None:
    layout = EngineLayout("BLOCKS_FIRST", 2, 16, 2, 8, "bfloat16")  # type: ignore[arg-type]
    assert layout.kind is EngineLayoutKind.BLOCKS_FIRST and layout.dtype is DType.BF16
