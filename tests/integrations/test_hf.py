"""The transformers cache backed by tierkv, end to end with SmolLM2-135M-Instruct on CPU.

A three-turn chat (about 300 tokens) through a store whose DRAM tier holds two pages,
so earlier turns are read back from the NVMe tier (a file): each turn's tokens must
equal a full recompute with a plain ``DynamicCache``, and the model must process only
the tokens after the reused prefix. Skips where the demo extra is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierkv.store.api import Store
from tierkv.config import DramConfig, NvmeConfig, StoreConfig
from tierkv.errors import ConfigError
from tierkv.integrations import smollm2

_missing = smollm2.missing_requirements()
if _missing:
    pytest.skip(f"needs {', '.join(_missing)}: {smollm2.INSTALL_HINT}", allow_module_level=True)

from transformers import DynamicCache  # noqa: E402

from tierkv.integrations.chat import Conversation, greedy, run_chat, stop_ids_of  # noqa: E402
from tierkv.integrations.hf import TierKVCache, model_layout  # noqa: E402

MESSAGES = (
    "Here is a note: a tiered store keeps the KV cache of a chat in host memory and on an NVMe drive, "
    "so that a returning conversation loads its earlier tokens instead of computing them again. "
    "Summarize the note in one sentence.",
    "Why is loading faster than computing?",
    "Name one cost of keeping the cache.",
)


@pytest.fixture
def store(tmp_path: Path, smol: smollm2.LoadedModel) -> Iterator[Store]:
    layout = model_layout(smol.model)
    config = StoreConfig(path=str(tmp_path / "store"), model_id=smol.model_id, layout=layout,
                         dram=DramConfig(2 * layout.page_bytes), nvme=NvmeConfig(128 * layout.page_bytes))
    s = Store.open(config)
    yield s
    s.close()


def test_declared_layout_matches_the_model(smol: smollm2.LoadedModel) -> None:
    assert model_layout(smol.model) == smollm2.kv_layout("fp32", 16)


def test_multi_turn_reuse_matches_full_recompute(smol: smollm2.LoadedModel, store: Store, one_thread: None) -> None:
    cache = TierKVCache(store, smol.model)
    turns = run_chat(smol.model, smol.tokenizer, cache, MESSAGES, max_new_tokens=16)
    assert 200 <= sum(t.prompt_tokens for t in turns) + sum(t.generated_tokens for t in turns) <= 600
    for t in turns:
        assert t.outputs_identical, f"turn {t.turn}: reuse and full recompute generated different tokens"
        assert t.matches_plain_cache, f"turn {t.turn}: reuse and the in-memory plain cache differ"
        assert t.computed_tokens == t.prompt_tokens - t.reused_tokens, "the reused prefix was recomputed"
        assert t.recompute_computed_tokens == t.prompt_tokens
        assert sum(t.tokens_per_tier.values()) == t.reused_tokens
    assert turns[0].reused_tokens == 0
    for prev, t in zip(turns, turns[1:]):
        # Every full page of the previous turn (prompt and reply, less the last token) is reused.
        held = prev.prompt_tokens + prev.generated_tokens - 1
        assert t.reused_tokens == held // 16 * 16
        assert t.tokens_per_tier.get("nvme", 0) > 0, "nothing came from the NVMe tier"
    stored = [e for e in cache.scheduler.take_events() if e.kind.value == "stored"]
    assert sum(len(e.keys) for e in stored) == sum(t.pages_stored for t in turns)


def test_round_trip_through_the_store_is_bit_exact(smol: smollm2.LoadedModel, store: Store,
                                                   one_thread: None) -> None:
    conv = Conversation(smol.tokenizer)
    prompt = conv.prompt(MESSAGES[0])
    plain = DynamicCache()
    greedy(smol.model, prompt, plain, max_new_tokens=1, stop_ids=stop_ids_of(smol.tokenizer))
    cache = TierKVCache(store, smol.model)
    saved = cache.save(plain, prompt)
    n = len(prompt) // 16 * 16
    assert saved.tokens == n and saved.pages_stored == n // 16
    loaded = cache.load(prompt + [0])
    assert loaded.tokens == n
    for layer, (mine, ref) in enumerate(zip(loaded.cache.layers, plain.layers)):
        mk, mv, rk, rv = (getattr(c, name) for c in (mine, ref) for name in ("keys", "values"))
        assert isinstance(mk, torch.Tensor) and isinstance(rk, torch.Tensor)
        assert isinstance(mv, torch.Tensor) and isinstance(rv, torch.Tensor)
        assert mk.dtype == rk.dtype == torch.float32
        assert torch.equal(mk, rk[:, :, :n]), f"layer {layer} K differs"
        assert torch.equal(mv, rv[:, :, :n]), f"layer {layer} V differs"


def test_a_store_of_another_layout_is_refused(smol: smollm2.LoadedModel, tmp_path: Path) -> None:
    config = StoreConfig(path=str(tmp_path / "bf16"), model_id=smol.model_id, layout=smollm2.kv_layout("bf16"),
                         dram=DramConfig("16MiB"))
    with Store.open(config) as s, pytest.raises(ConfigError, match="does not match"):
        TierKVCache(s, smol.model)


def _tiny_llama(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def _tiny_store(path: Path, model: torch.nn.Module, dram_pages: int) -> Store:
    layout = model_layout(model, 4)
    return Store.open(StoreConfig(path=str(path), model_id="tiny", layout=layout,
                                  dram=DramConfig(dram_pages * layout.page_bytes)))


def test_another_model_of_the_same_layout_never_loads_its_kv(tmp_path: Path, one_thread: None) -> None:
    """Two checkpoints of one layout (a base model and its tune, say) share a store:
    neither may be handed the other's KV, which would silently change its output."""
    a, b = _tiny_llama(0), _tiny_llama(1)
    prompt = list(range(1, 30))
    with _tiny_store(tmp_path / "s", a, 64) as s:
        cache_a = TierKVCache(s, a)
        loaded = cache_a.load(prompt)
        out = greedy(a, prompt, loaded.cache, max_new_tokens=2, stop_ids=[])
        assert cache_a.save(loaded.cache, prompt + list(out.tokens)).pages_stored == 7
        assert cache_a.load(prompt).tokens == 28
        assert TierKVCache(s, b).load(prompt).tokens == 0, "model b was handed model a's KV"
        assert TierKVCache(s, _tiny_llama(0)).load(prompt).tokens == 28, "the same weights must match"


def test_a_cache_larger_than_the_store_saves_what_fits(tmp_path: Path, one_thread: None) -> None:
    model = _tiny_llama(0)
    prompt = list(range(1, 30))                              # 7 full pages of 4 tokens
    with _tiny_store(tmp_path / "s", model, 4) as s:
        cache = TierKVCache(s, model)
        loaded = cache.load(prompt)
        out = greedy(model, prompt, loaded.cache, max_new_tokens=2, stop_ids=[])
        saved = cache.save(loaded.cache, prompt + list(out.tokens))
        assert (saved.pages_stored, saved.tokens) == (4, 16)
        again = cache.load(prompt)
        assert again.tokens == 16
        st = s.stats()
        assert (st.pages_requested, st.pages_hit) == (7 + 7, 4), "both loads' misses must be counted"


def test_a_read_only_store_is_refused_up_front(tmp_path: Path) -> None:
    model = _tiny_llama(0)
    layout = model_layout(model, 4)
    cfg = StoreConfig(path=str(tmp_path / "s"), model_id="tiny", layout=layout, nvme=NvmeConfig("1MiB"))
    Store.open(cfg).close()
    with Store.open(cfg, read_only=True) as s, pytest.raises(ConfigError, match="writer"):
        TierKVCache(s, model)


def test_the_fingerprint_ignores_wrappers_and_meta_weights_need_a_name(tmp_path: Path) -> None:
    from tierkv.integrations.hf import model_fingerprint

    model = _tiny_llama(0)

    class Wrapped(torch.nn.Module):          # what torch.compile and DDP do to parameter names
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self._orig_mod = inner

    assert model_fingerprint(Wrapped(model)) == model_fingerprint(model) != model_fingerprint(_tiny_llama(1))
    meta = _tiny_llama(0).to("meta")
    with pytest.raises(ConfigError, match="meta device"):
        model_fingerprint(meta)
    with _tiny_store(tmp_path / "s", model, 4) as s:
        assert TierKVCache(s, model, fingerprint="my-checkpoint-v1").fingerprint == "my-checkpoint-v1"
