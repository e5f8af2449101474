"""A small transformers Llama (random weights, from a config) and its KV as a store's pages:
what the splice tests move and compare against a fresh prefill. Import it after
``pytest.importorskip("torch")`` and ``("transformers")``."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from tierkv.layout import KVLayout
from tierkv.splice.rope import to_float32

HEADS, DIM, TPP, LAYERS = 2, 32, 16, 2
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="fp32", tokens_per_page=TPP)


def make_llama() -> object:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=HEADS, max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(cfg).eval()


def kv_pages(model: object, tokens: np.ndarray) -> np.ndarray:
    """The model's KV of ``tokens`` as the store's pages (whole pages only), fp32."""
    with torch.no_grad():
        cache = model(torch.from_numpy(tokens.astype(np.int64))[None], use_cache=True).past_key_values  # type: ignore[operator]
    n = tokens.size // TPP
    arr = np.zeros((n, *LAYOUT.page_shape), np.float32)
    for layer, c in enumerate(cache.layers):
        arr[:, layer, 0] = c.keys[0].permute(1, 0, 2).numpy()[:n * TPP].reshape(n, TPP, HEADS, DIM)
        arr[:, layer, 1] = c.values[0].permute(1, 0, 2).numpy()[:n * TPP].reshape(n, TPP, HEADS, DIM)
    return arr.view(np.uint8).reshape(n, LAYOUT.page_bytes)


def layer0_keys(pages: np.ndarray) -> np.ndarray:
    arr = to_float32(pages.view(np.uint32).reshape(pages.shape[0], *LAYOUT.page_shape), LAYOUT.dtype)
    return arr[:, 0, 0].reshape(-1, HEADS, DIM)
