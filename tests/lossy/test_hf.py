"""Lossy pages through the transformers cache (TierKVCache.save_lossy, load(accept_lossy=)):
on a small Llama, pages saved lossy come back only to a lossy load; at 8 bits without
eviction the continuation's logits stay close to the exact cache's; with eviction the
cache holds fewer entries than positions and the model runs on at the right positions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tierkv.config import DramConfig, StoreConfig
from tierkv.errors import InputError
from tierkv.store.api import Store

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tierkv.integrations.hf import TierKVCache, model_layout  # noqa: E402
from tierkv.lossy import scoring  # noqa: E402

TPP = 64


def logits_after(model: object, cache: object, follow: np.ndarray, start: int) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.from_numpy(follow)[None], past_key_values=cache,  # type: ignore[operator]
                    position_ids=torch.arange(start, start + follow.size)[None], use_cache=True)
    return out.logits[0].float().numpy()  # type: ignore[no-any-return]


def test_lossy_pages_through_the_transformers_cache(llama: object, tmp_path: Path) -> None:
    layout = model_layout(llama, TPP)  # type: ignore[arg-type]
    cfg = StoreConfig(path=str(tmp_path / "s"), model_id="llama-test", layout=layout,
                      dram=DramConfig(32 * layout.page_bytes))
    ids = np.random.default_rng(1).integers(0, 1000, 4 * TPP + 24).astype(np.int64)
    prompt, follow = ids[:4 * TPP], ids[4 * TPP:]
    with torch.no_grad():
        full = llama(torch.from_numpy(prompt)[None], use_cache=True)  # type: ignore[operator]
    with Store.open(cfg) as store:
        tkv = TierKVCache(store, llama)  # type: ignore[arg-type]
        saved = tkv.save_lossy(full.past_key_values, prompt, 8.0, evict=False)
        assert saved.pages_stored == 4 and saved.tokens == 4 * TPP
        assert tkv.load(prompt).tokens == 0                        # an exact load sees none of them
        assert tkv.load(prompt, accept_lossy=4.0).tokens == 0      # nor a load at another budget
        got = tkv.load(np.concatenate([prompt, follow[:1]]), accept_lossy=8.0)
        assert (got.tokens, got.lossy_tokens, got.evicted_tokens) == (4 * TPP, 4 * TPP, 0)
        exact = TierKVCache(store, llama, tenant="exact")  # type: ignore[arg-type]
        exact.save(full.past_key_values, prompt)
        ref = exact.load(np.concatenate([prompt, follow[:1]]))
        a = logits_after(llama, got.cache, follow, got.tokens)
        b = logits_after(llama, ref.cache, follow, ref.tokens)
        assert np.abs(a - b).max() < 0.05 * np.abs(b).max()        # 8 bits: close to the exact cache
        # 1.6 bits (below the 1.78 these pages need keeping every token) with the prompt's
        # own importance: some tokens evicted, positions kept.
        pre = scoring.prefill(llama, prompt, window=32, dtype="fp32")
        tkv.save_lossy(full.past_key_values, prompt, 1.6, importance=pre.importance)
        low = tkv.load(np.concatenate([prompt, follow[:1]]), accept_lossy=1.6)
        assert low.tokens == 4 * TPP and 0 < low.evicted_tokens < low.tokens
        assert low.cache.get_seq_length() == low.tokens - low.evicted_tokens
        assert np.isfinite(logits_after(llama, low.cache, follow, low.tokens)).all()
        # A cache loaded lossy (then extended by the model) is never saved, exact or lossy.
        for save in (lambda: tkv.save(low.cache, ids), lambda: tkv.save_lossy(low.cache, ids, 4.0)):
            with pytest.raises(InputError, match="loaded with derived or lossy pages"):
                save()
        with pytest.raises(InputError, match="must be 'exact' or 'derived'"):
            tkv.load(prompt, accept="bogus", accept_lossy=4.0)


def test_save_lossy_stores_the_leading_pages_that_fit(llama: object, tmp_path: Path) -> None:
    layout = model_layout(llama, TPP)  # type: ignore[arg-type]
    cfg = StoreConfig(path=str(tmp_path / "s"), model_id="llama-test", layout=layout,
                      dram=DramConfig(2 * layout.page_bytes))
    prompt = np.random.default_rng(2).integers(0, 1000, 4 * TPP).astype(np.int64)
    with torch.no_grad():
        full = llama(torch.from_numpy(prompt)[None], use_cache=True)  # type: ignore[operator]
    with Store.open(cfg) as store:
        saved = TierKVCache(store, llama).save_lossy(full.past_key_values, prompt, 8.0)  # type: ignore[arg-type]
        assert (saved.pages_stored, saved.tokens) == (2, 2 * TPP)
