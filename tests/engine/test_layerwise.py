"""Layer-wise loads: one completion per layer, layer i usable while later layers are in flight."""

from __future__ import annotations

import pytest
import torch

from tests.engine.targets import TARGETS, Target, as_bytes, random_bytes
from tests.engine.test_kv import KV_STORE, LATENT_STORE, NUM_BLOCKS, block_bytes, make_kv
from tierkv.engine import CopyStream, load_layers
from tierkv.errors import InputError

TIMEOUT_S = 30


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("kind", "block_size"), [("flash", 8), ("blocks_first", 4), ("mla", 8)])
@pytest.mark.parametrize("where", ["host", "device"])
def test_load_layers(target: Target, kind: str, block_size: int, where: str) -> None:
    store = LATENT_STORE if kind == "mla" else KV_STORE
    kv, layers = make_kv(target, kind, store, block_size, seed=80)
    pages = random_bytes((5, store.page_bytes), seed=81)
    pages = target.host(pages) if where == "host" else pages.to(target.device)
    kept = as_bytes(pages)
    k = store.tokens_per_page // block_size
    ids, rows = [11, 2, 7, 5, 0, 9][: 3 * k], [4, 0, 2]
    others = {b: block_bytes(kind, layers, b) for b in range(NUM_BLOCKS) if b not in ids}
    with CopyStream(target.device) as copier:
        load = load_layers(kv, pages, ids, copier, rows=rows)
        assert len(load.layers) == store.num_layers
        lpb = kv.geometry.layer_page_bytes
        for j in range(store.num_layers):
            load.layer(j).result(timeout=TIMEOUT_S)
            load.wait_layer(j)
            got = kv.gather(ids, layers=range(j, j + 1))  # on the current stream, after the wait
            assert torch.equal(as_bytes(got)[:, j * lpb:(j + 1) * lpb], kept[rows, j * lpb:(j + 1) * lpb])
        load.result(timeout=TIMEOUT_S)
    assert torch.equal(as_bytes(kv.gather(ids)), kept[rows])
    assert torch.equal(as_bytes(pages), kept)
    for b, old in others.items():
        assert torch.equal(block_bytes(kind, layers, b), old)


@pytest.mark.parametrize("target", TARGETS[:1])
def test_bad_loads_enqueue_nothing(target: Target) -> None:
    kv, layers = make_kv(target, "flash", KV_STORE, 8)
    pages = torch.zeros((2, KV_STORE.page_bytes), dtype=torch.uint8)
    with CopyStream("cpu") as copier:
        with pytest.raises(InputError, match="twice"):
            load_layers(kv, pages, [1, 1], copier)
        with pytest.raises(InputError, match="out of range"):
            load_layers(kv, pages, [1], copier, rows=[2])
    if torch.cuda.is_available():
        with CopyStream("cuda") as gpu, pytest.raises(InputError, match="copy stream is on"):
            load_layers(kv, pages, [1], gpu)
