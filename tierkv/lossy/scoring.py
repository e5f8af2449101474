"""What an allocation needs from a model, measured with transformers (CPU).

:func:`prefill` runs a prompt and returns its KV (float32, as the store's pages hold it
once rounded to the page dtype) and the :class:`~tierkv.lossy.alloc.Importance` of every
token and key channel, from a short scoring pass: the prompt's last ``window`` tokens are
run again as queries against the rest with eager attention, and their attention
probabilities and query projections averaged per KV head. :func:`calibrate` measures a
model's per-layer sensitivities (:class:`~tierkv.lossy.alloc.Calibration`): each layer's
keys, then values, coded at 2 bits alone, the KL divergence of the next-token
distributions over a continuation from the clean ones, divided by what the distortion
model predicts for it. :func:`cache_of` builds a transformers cache of the kept tokens
of decoded pages, and :func:`nll` and :func:`agreement` score a continuation with it.
torch and transformers are imported by the caller's model; nothing here downloads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierkv.lossy.alloc import Calibration, Importance, _tables
from tierkv.lossy.quant import from_bf16_bits, roundtrip, to_bf16_bits


@dataclass(frozen=True)
class Prefilled:
    """A prompt's KV ``kv[layers, 2, tokens, heads, dim]`` (float32 values of ``dtype``),
    its importance, and the logits after its last token."""

    kv: np.ndarray
    importance: Importance
    last_logits: np.ndarray


def _torch() -> Any:
    import torch
    return torch


def _layers_kv(cache: Any) -> np.ndarray:
    layers = cache.layers
    k = np.stack([lyr.keys[0].float().numpy() for lyr in layers])       # [L, H, N, D]
    v = np.stack([lyr.values[0].float().numpy() for lyr in layers])
    return np.stack([k, v], axis=1).transpose(0, 1, 3, 2, 4).copy()    # [L, 2, N, H, D]


def as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (bf16, fp16, fp32) and back to float32: what a page of it holds."""
    if dtype == "bf16":
        return from_bf16_bits(to_bf16_bits(x))
    if dtype == "fp16":
        return x.astype(np.float16).astype(np.float32)
    return x.astype(np.float32)


def prefill(model: Any, tokens: np.ndarray, *, window: int = 64, dtype: str = "bf16") -> Prefilled:
    """Run ``tokens`` and score them (module docstring)."""
    torch = _torch()
    n = int(tokens.size)
    window = max(1, min(window, n - 1))
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    with torch.no_grad():
        out = model(ids, use_cache=True)
    kv = as_dtype(_layers_kv(out.past_key_values), dtype)
    L, _, N, H, D = kv.shape
    cfg = model.config
    qheads = int(cfg.num_attention_heads)
    group = qheads // H
    captured: list[Any] = []
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda _m, _i, o: captured.append(o.detach()))
             for layer in model.model.layers]
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation("eager")
        with torch.no_grad():
            head = model(ids[:, :n - window], use_cache=True)
            scored = model(ids[:, n - window:], past_key_values=head.past_key_values, use_cache=True,
                           output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
        for h in hooks:
            h.remove()
    a2 = np.zeros((L, H, N))
    # Per token, the mean over the queries that can see it (causal: a token inside the
    # window is seen by the window's queries from its own on) and over its KV head's
    # query heads (query head i reads KV head i // group).
    seen = np.minimum(window, N - np.arange(N)).astype(np.float64)
    for layer, att in enumerate(scored.attentions):                      # [1, qheads, window, N]
        p = att[0].float().numpy() ** 2
        a2[layer] = p.reshape(H, group, window, N).sum(axis=(1, 2)) / (group * seen)
    q = np.stack([c[0, -window:].float().numpy() for c in captured[-L:]])   # [L, window, qheads * D]
    q2 = (q.reshape(L, window, H, group, D) ** 2).mean(axis=(1, 3))       # [L, H, D]
    half = D // 2                                                        # rotary pairs (c, c + D/2) share energy
    pair = (q2[..., :half] + q2[..., half:]) / 2
    qe = np.concatenate([pair, pair], axis=-1)
    return Prefilled(kv, Importance(a2, qe), out.logits[0, -1].float().numpy())


def cache_of(kv: np.ndarray, kept: np.ndarray) -> Any:
    """A transformers DynamicCache of the ``kept`` tokens of ``kv`` ([L, 2, N, H, D])."""
    torch = _torch()
    from transformers import DynamicCache

    cache = DynamicCache()
    idx = np.flatnonzero(kept)
    for layer in range(kv.shape[0]):
        k = torch.from_numpy(kv[layer, 0, idx].transpose(1, 0, 2).copy())[None]
        v = torch.from_numpy(kv[layer, 1, idx].transpose(1, 0, 2).copy())[None]
        cache.update(k, v, layer)
    return cache


def _logits(model: Any, kv: np.ndarray, kept: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Logits of ``tokens`` run after the prompt whose KV (kept tokens) is ``kv``, at the
    positions they follow it at (evicted tokens keep their positions)."""
    torch = _torch()
    n = kv.shape[2]
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    pos = torch.arange(n, n + tokens.size)[None]
    with torch.no_grad():
        out = model(ids, past_key_values=cache_of(kv, kept), position_ids=pos, use_cache=True)
    return out.logits[0].float().numpy()   # type: ignore[no-any-return]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def nll(model: Any, kv: np.ndarray, kept: np.ndarray, continuation: np.ndarray) -> float:
    """Teacher-forced NLL per token (nats) of ``continuation[1:]`` after the prompt."""
    lp = _log_softmax(_logits(model, kv, kept, continuation[:-1]))
    return float(-lp[np.arange(continuation.size - 1), continuation[1:]].mean())


def next_token_logprobs(model: Any, kv: np.ndarray, kept: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return _log_softmax(_logits(model, kv, kept, tokens))


def greedy(model: Any, kv: np.ndarray, first: int, steps: int) -> np.ndarray:
    """``steps`` greedy tokens after the prompt (``first``: the prompt's own next token)."""
    torch = _torch()
    cache = cache_of(kv, np.ones(kv.shape[2], bool))
    n = kv.shape[2]
    out = [first]
    with torch.no_grad():
        for i in range(steps - 1):
            logits = model(torch.tensor([[out[-1]]]), past_key_values=cache,
                           position_ids=torch.tensor([[n + i]]), use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
    return np.array(out, np.int64)


def agreement(model: Any, kv: np.ndarray, kept: np.ndarray, generated: np.ndarray) -> float:
    """Top-1 agreement with ``generated`` (the lossless greedy tokens), teacher-forced:
    the share of its tokens after the first that the cache's argmax predicts."""
    pred = _logits(model, kv, kept, generated[:-1]).argmax(axis=-1)
    return float((pred == generated[1:]).mean())


def calibrate(model: Any, tokens: np.ndarray, continuation: np.ndarray, *, model_id: str = "",
              page_tokens: int = 128, dtype: str = "bf16", step: Callable[[], None] = lambda: None) -> Calibration:
    """Per-layer sensitivities of ``model`` (module docstring), measured on ``tokens``
    (the prompt, whole pages of ``page_tokens``) and ``continuation``; ``step`` is called
    after each of the ``2 x layers`` runs (a progress bar)."""
    pre = prefill(model, tokens, dtype=dtype)
    kv, imp = pre.kv, pre.importance
    L, _, N, H, D = kv.shape
    kept = np.ones(N, bool)
    clean = next_token_logprobs(model, kv, kept, continuation)
    pages = [slice(p, p + page_tokens) for p in range(0, N - page_tokens + 1, page_tokens)]
    neutral = Calibration.neutral(L)
    predicted_k, predicted_v = np.zeros(L), np.zeros(L)
    for sl in pages:
        t = _tables(kv[:, :, sl], Importance(imp.a2[:, :, sl], imp.qe), neutral)
        predicted_k += t.dk[1].sum(axis=(1, 2))       # keys at 2 bits
        predicted_v += t.dv[0].sum(axis=1)            # values at 2 bits
    sens: dict[int, list[float]] = {0: [], 1: []}
    for layer in range(L):
        for kind, predicted in ((0, predicted_k), (1, predicted_v)):
            noisy = kv.copy()
            for sl in pages:
                part = noisy[layer, kind, sl]                        # [T, H, D]
                groups = part.transpose(1, 2, 0) if kind == 0 else part   # keys per channel, values per token
                coded = roundtrip(groups, 2)
                noisy[layer, kind, sl] = coded.transpose(2, 0, 1) if kind == 0 else coded
            lp = next_token_logprobs(model, noisy, kept, continuation)
            kl = float((np.exp(clean) * (clean - lp)).sum(axis=-1).mean())
            sens[kind].append(max(kl, 0.0) / max(float(predicted[layer]), 1e-30))
            step()
    return Calibration(model_id, tuple(sens[0]), tuple(sens[1]), imp.qe.copy())
