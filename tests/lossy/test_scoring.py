"""What the allocation learns from a model (tierkv.lossy.scoring), on a small transformers
Llama (random weights, from a config): the KV and importance of a prompt, a cache of
kept tokens that predicts exactly what the full cache does when nothing is lost, and a
calibration with one sensitivity per layer for keys and values."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.splice.llama import DIM, HEADS, LAYERS  # noqa: E402
from tierkv.lossy import scoring  # noqa: E402
from tierkv.lossy.quant import from_bf16_bits, to_bf16_bits  # noqa: E402

N = 96


def tokens(seed: int, n: int = N) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n).astype(np.int64)


def test_prefill_gives_the_kv_and_its_importance(llama: object) -> None:
    before = llama.config._attn_implementation  # type: ignore[attr-defined]
    pre = scoring.prefill(llama, tokens(1), window=16)
    assert llama.config._attn_implementation == before  # type: ignore[attr-defined]   # eager for the pass only
    assert pre.kv.shape == (LAYERS, 2, N, HEADS, DIM)
    assert np.array_equal(pre.kv, from_bf16_bits(to_bf16_bits(pre.kv)))            # rounded as a bf16 page
    a2, qe = pre.importance.a2, pre.importance.qe
    assert a2.shape == (LAYERS, HEADS, N) and qe.shape == (LAYERS, HEADS, DIM)
    assert (a2 >= 0).all() and (a2 > 0).any() and (qe > 0).all()
    assert np.array_equal(qe[..., :DIM // 2], qe[..., DIM // 2:])   # rotary pairs share their energy
    # The window's queries attend causally: the last token is seen by one query only, the first by all.
    assert a2[:, :, 0].sum() > 0 and pre.last_logits.shape == (1000,)


def test_a_lossless_cache_predicts_as_the_model_does(llama: object) -> None:
    import torch

    prompt, follow = tokens(2), tokens(3, 24)
    pre = scoring.prefill(llama, prompt, dtype="fp32")
    kept = np.ones(N, bool)
    with torch.no_grad():
        full = llama(torch.from_numpy(np.concatenate([prompt, follow]))[None]).logits[0].float().numpy()  # type: ignore[operator]
    lp = scoring.next_token_logprobs(llama, pre.kv, kept, follow)
    ref = full[N:] - np.log(np.exp(full[N:] - full[N:].max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - full[N:].max(-1, keepdims=True)
    assert np.abs(lp - ref).max() < 1e-3
    gen = scoring.greedy(llama, pre.kv, int(pre.last_logits.argmax()), 12)
    assert scoring.agreement(llama, pre.kv, kept, gen) == 1.0
    # Evicting tokens changes the predictions (positions kept: the model still runs).
    some = kept.copy()
    some[10:60] = False
    assert np.isfinite(scoring.nll(llama, pre.kv, some, follow))
    assert np.abs(scoring.next_token_logprobs(llama, pre.kv, some, follow) - lp).max() > 1e-3


def test_calibration_measures_every_layer(llama: object) -> None:
    cal = scoring.calibrate(llama, tokens(4, 128), tokens(5, 16), model_id="tiny", page_tokens=64)
    assert cal.model_id == "tiny" and len(cal.key) == len(cal.value) == LAYERS
    assert all(np.isfinite(x) and x >= 0 for x in cal.key + cal.value) and max(cal.value) > 0


def test_importance_follows_each_query_head_to_its_kv_head(llama: object) -> None:
    """a2 by hand: query head i reads KV head i // group; a token in the window is averaged
    over the queries that can see it."""
    import torch

    toks, window = tokens(6), 16
    pre = scoring.prefill(llama, toks, window=window)
    ids = torch.from_numpy(toks)[None]
    before = llama.config._attn_implementation  # type: ignore[attr-defined]
    llama.set_attn_implementation("eager")  # type: ignore[attr-defined]
    try:
        with torch.no_grad():
            head = llama(ids[:, :N - window], use_cache=True)  # type: ignore[operator]
            att = llama(ids[:, N - window:], past_key_values=head.past_key_values,  # type: ignore[operator]
                        output_attentions=True).attentions
    finally:
        llama.set_attn_implementation(before)  # type: ignore[attr-defined]
    qheads = att[0].shape[1]
    group = qheads // HEADS
    for layer in range(LAYERS):
        a = att[layer][0].float().numpy() ** 2                  # [qheads, window, N]
        for h in range(HEADS):
            mine = [i for i in range(qheads) if i // group == h]
            for t in (0, N // 2, N - window, N - 3, N - 1):
                seen = min(window, N - t)
                want = a[mine][:, -seen:, t].sum() / (len(mine) * seen)
                assert np.isclose(pre.importance.a2[layer, h, t], want, rtol=1e-4), (layer, h, t)
