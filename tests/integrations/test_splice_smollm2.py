"""The rotation of tierkv.splice.rope on the real SmolLM2-135M (transformers, CPU, fp32): a
suffix's first-layer keys, moved across a 256-token deletion, match a fresh prefill of
the edited text (issue 25's target: within 1e-4); the later layers do not (they attended
to the deleted span), which is why moved pages are derived, never exact."""

from __future__ import annotations

import numpy as np
import torch

from tierkv.integrations import smollm2
from tierkv.splice.rope import Rope


def keys(model: torch.nn.Module, tokens: torch.Tensor) -> list[np.ndarray]:
    with torch.no_grad():
        cache = model(tokens, use_cache=True).past_key_values
    return [layer.keys[0].permute(1, 0, 2).numpy() for layer in cache.layers]


def test_first_layer_keys_move_exactly_on_smollm2(smol: smollm2.LoadedModel, one_thread: None) -> None:
    rope = Rope.from_model(smol.model)
    assert (rope.head_dim, rope.rotary_dim, rope.rope_type) == (smollm2.HEAD_DIM, smollm2.HEAD_DIM, "default")
    text = ("The agent read the file, ran the tests, and wrote a summary of what failed. " * 40)
    tokens = torch.tensor([smol.tokenizer.encode(text, add_special_tokens=False)[:1024]])
    s, e = 300, 556
    old, fresh = keys(smol.model, tokens), keys(smol.model, torch.cat([tokens[:, :s], tokens[:, e:]], 1))
    n = tokens.shape[1]
    moved = rope.move(old[0][e:], np.arange(e, n), np.arange(s, n - (e - s)))
    assert np.abs(moved - fresh[0][s:]).max() <= 1e-4
    later = rope.move(old[1][e:], np.arange(e, n), np.arange(s, n - (e - s)))
    assert np.abs(later - fresh[1][s:]).max() > 1e-3
