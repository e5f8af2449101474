"""Moving cached keys to new positions (tierkv.splice.rope): exact against a fresh prefill
of the edited text where the maths says it must be (the first layer's keys do not depend
on context), in a real transformers Llama (random weights, built from a config: nothing
downloaded); both pairing conventions against the rotation written out; the store's page
layouts; bad input refused."""

from __future__ import annotations

import numpy as np
import pytest

from tierkv.errors import InputError
from tierkv.layout import KVLayout
from tierkv.splice.rope import Convention, Rope, from_float32, move_tokens, to_float32

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HEADS, DIM, TPP = 2, 32, 16


@pytest.fixture(scope="module")
def llama() -> object:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=HEADS, max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(cfg).eval()


def prefill(model: object, tokens: object) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each layer's (keys, values) as ``[tokens, heads, head_dim]`` float32."""
    with torch.no_grad():
        cache = model(tokens, use_cache=True).past_key_values   # type: ignore[operator]
    return [(layer.keys[0].permute(1, 0, 2).numpy(), layer.values[0].permute(1, 0, 2).numpy())
            for layer in cache.layers]


def pages(kv: list[tuple[np.ndarray, np.ndarray]], layout: KVLayout) -> np.ndarray:
    """The store's pages ``[n, page_bytes]`` of the first whole pages of ``kv``."""
    n = kv[0][0].shape[0] // TPP
    arr = np.zeros((n, *layout.page_shape), np.float32)
    for layer, (k, v) in enumerate(kv):
        arr[:, layer, 0] = k[:n * TPP].reshape(n, TPP, HEADS, DIM)
        arr[:, layer, 1] = v[:n * TPP].reshape(n, TPP, HEADS, DIM)
    return from_float32(arr, layout.dtype).view(np.uint8).reshape(n, layout.page_bytes)


def as_float(raw: np.ndarray, layout: KVLayout) -> np.ndarray:
    width = 4 if layout.dtype.value == "fp32" else 2
    return to_float32(raw.view(f"<u{width}").reshape(raw.shape[0], *layout.page_shape), layout.dtype)


def test_the_first_layers_keys_move_exactly_across_a_deletion(llama: object) -> None:
    tokens = torch.randint(0, 1000, (1, 2048), generator=torch.Generator().manual_seed(1))
    old = prefill(llama, tokens)
    s, e = 300, 556                                      # 256 tokens deleted
    fresh = prefill(llama, torch.cat([tokens[:, :s], tokens[:, e:]], 1))
    rope = Rope.from_model(llama)
    assert rope.rope_type == "default" and rope.rotary_dim == DIM
    moved = rope.move(old[0][0][e:], np.arange(e, 2048), np.arange(s, 2048 - (e - s)))
    assert np.abs(moved - fresh[0][0][s:]).max() <= 1e-6 * max(1.0, np.abs(fresh[0][0]).max())
    assert np.abs(old[0][0][e:] - fresh[0][0][s:]).max() > 0.1          # unmoved keys are wrong there
    # A later layer attended to the deleted span: moved, it is close, not exact (a derived page).
    later = rope.move(old[1][0][e:], np.arange(e, 2048), np.arange(s, 2048 - (e - s)))
    assert np.abs(later - fresh[1][0][s:]).max() > 1e-4


@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-6), ("bf16", 1.6e-2), ("fp16", 2e-3)])
def test_pages_move_across_page_boundaries(llama: object, dtype: str, tol: float) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=HEADS, head_dim=DIM, dtype=dtype, tokens_per_page=TPP)
    tokens = torch.randint(0, 1000, (1, 512), generator=torch.Generator().manual_seed(2))
    s, e = 100, 237                                      # 137 deleted: rows cross page boundaries
    edited = torch.cat([tokens[:, :s], tokens[:, e:]], 1)
    n = edited.shape[1] // TPP * TPP
    old = pages(prefill(llama, tokens), layout)
    fresh = pages(prefill(llama, edited[:, :n]), layout)
    dst = np.zeros_like(fresh)
    src_t, dst_t = np.arange(e, e + n - s), np.arange(s, n)
    move_tokens(old, src_t, src_t, dst, dst_t, dst_t, layout, Rope.from_model(llama))
    got, want = as_float(dst, layout), as_float(fresh, layout)
    k_got = got[:, 0, 0].reshape(-1, HEADS, DIM)[s:n]
    k_want = want[:, 0, 0].reshape(-1, HEADS, DIM)[s:n]
    assert np.abs(k_got - k_want).max() <= tol * max(1.0, np.abs(k_want).max())
    # Values carry no position: bit for bit the old token's, whatever the dtype.
    v_got = dst.view(np.uint8).reshape(dst.shape[0], -1)
    old_v = as_float(old, layout)[:, 0, 1].reshape(-1, HEADS, DIM)[e:e + n - s]
    assert np.array_equal(got[:, 0, 1].reshape(-1, HEADS, DIM)[s:n], old_v) and v_got.shape == dst.shape
    assert not dst.reshape(dst.shape[0], -1)[: s // TPP].any()       # rows not named are not written


@pytest.mark.parametrize("convention", ["half", "interleaved"])
def test_both_pairings_against_the_rotation_written_out(convention: Convention) -> None:
    rng = np.random.default_rng(3)
    rope = Rope.from_theta(10000.0, 16, rotary_dim=12, convention=convention)   # partial: 4 channels unrotated
    k = rng.standard_normal((5, 3, 16)).astype(np.float32)
    old, new = np.array([0, 3, 9, 100, 7]), np.array([4, 0, 9, 1000, 70])
    got = rope.move(k, old, new)
    inv = (1.0 / np.float32(10000.0) ** (np.arange(0, 12, 2, dtype=np.float32) / np.float32(12))).astype(np.float32)

    def angle(p: int, i: int) -> float:   # as the model computes it: float32 position times float32 frequency
        return float(np.float32(np.float32(p) * inv[i]))

    pairs = [(i, i + 6) for i in range(6)] if convention == "half" else [(2 * i, 2 * i + 1) for i in range(6)]
    want = k.astype(np.float64).copy()
    for t in range(5):
        for i, (a, b) in enumerate(pairs):
            th = angle(new[t], i) - angle(old[t], i)
            want[t, :, a] = k[t, :, a] * np.cos(th) - k[t, :, b] * np.sin(th)
            want[t, :, b] = k[t, :, b] * np.cos(th) + k[t, :, a] * np.sin(th)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.array_equal(got[..., 12:], k[..., 12:])
    back = rope.move(got, new, old)                       # there and back: the identity
    np.testing.assert_allclose(back, k, atol=2e-5)


def test_scaled_frequencies_come_from_the_model(llama: object) -> None:
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    model = transformers.LlamaForCausalLM(cfg).eval()
    rope = Rope.from_model(model)
    plain = Rope.from_theta(10000.0, 32)
    assert rope.rope_type == "linear"
    np.testing.assert_allclose(rope.inv_freq, plain.inv_freq / 4, rtol=1e-6)


def test_bad_input_is_refused() -> None:
    rope = Rope.from_theta(10000.0, 8)
    k = np.zeros((2, 1, 8), np.float32)
    with pytest.raises(InputError, match="one old and one new position"):
        rope.move(k, np.array([0]), np.array([1, 2]))
    with pytest.raises(InputError, match="whole numbers"):
        rope.move(k, np.array([0.5, 1.0]), np.array([1, 2]))
    with pytest.raises(InputError, match="keys must be"):
        rope.move(np.zeros((2, 1, 6), np.float32), np.array([0, 1]), np.array([1, 2]))
    with pytest.raises(InputError, match="sequence's length"):
        Rope(np.ones(4, np.float32), 8, rope_type="dynamic")
    with pytest.raises(InputError, match="convention"):
        Rope(np.ones(4, np.float32), 8, convention="sideways")  # type: ignore[arg-type]
    latent = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="bf16", tokens_per_page=4, kind="latent")
    page = np.zeros((1, latent.page_bytes), np.uint8)
    with pytest.raises(InputError, match="needs K\\+V pages"):
        move_tokens(page, np.array([0]), np.array([0]), page, np.array([1]), np.array([1]), latent, rope)
    fp8 = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="fp8_e4m3", tokens_per_page=4)
    page = np.zeros((1, fp8.page_bytes), np.uint8)
    with pytest.raises(InputError, match="bf16, fp16 or fp32"):
        move_tokens(page, np.array([0]), np.array([0]), page, np.array([1]), np.array([1]), fp8, rope)


def _first_layer_error(model: object, rope: Rope) -> float:
    tokens = torch.randint(0, 100, (1, 96), generator=torch.Generator().manual_seed(5))
    old = prefill(model, tokens)
    fresh = prefill(model, torch.cat([tokens[:, :20], tokens[:, 50:]], 1))
    moved = rope.move(old[0][0][50:], np.arange(50, 96), np.arange(20, 66))
    return float(np.abs(moved - fresh[0][0][20:]).max())


def test_the_pairing_is_the_model_types(llama: object) -> None:
    """Cohere pairs channels interleaved: taken for "half", its keys would be moved wrongly."""
    cfg = transformers.CohereConfig(vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(4)
    cohere = transformers.CohereForCausalLM(cfg).eval()
    rope = Rope.from_model(cohere)
    assert rope.convention == "interleaved"
    assert _first_layer_error(cohere, rope) <= 1e-5
    assert _first_layer_error(cohere, Rope.from_model(cohere, "half")) > 1e-2   # the other pairing: wrong


def test_models_it_cannot_move_exactly_are_refused() -> None:
    smol3 = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(
        vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=64, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1)).eval()
    with pytest.raises(InputError, match="layers without RoPE"):
        Rope.from_model(smol3)
    gemma3 = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32)).eval()
    with pytest.raises(InputError, match="per layer type|no rotary|rotary embeddings"):
        Rope.from_model(gemma3)
    dynamic = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})).eval()
    with pytest.raises(InputError, match="dynamic"):
        Rope.from_model(dynamic)


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 100000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0},
])
def test_a_config_alone_gives_the_models_frequencies(rope_parameters: dict[str, object]) -> None:
    """For a process that splices through a daemon: no weights loaded, the same rotation."""
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16384,
                                   rope_parameters=rope_parameters)
    from_config, from_model = Rope.from_config(cfg), Rope.from_model(transformers.LlamaForCausalLM(cfg))
    assert from_config.rope_type == from_model.rope_type == rope_parameters["rope_type"]
    assert np.array_equal(from_config.inv_freq, from_model.inv_freq)
    assert (from_config.head_dim, from_config.convention) == (from_model.head_dim, from_model.convention)


def test_pages_in_vllms_cpu_order_move_as_standard_ones() -> None:
    """vLLM's CPU block order (per head: K transposed [head_dim, tokens], then V [tokens,
    head_dim]), packed here element by element from its definition, moves as the standard
    order does."""
    layers, heads, dim, tpp = 2, 2, 8, 4
    std = KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype="fp32", tokens_per_page=tpp)
    cpu = KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype="fp32", tokens_per_page=tpp,
                   page_order="vllm_cpu")
    rng = np.random.default_rng(8)
    k, v = rng.standard_normal((2, 3 * tpp, layers, heads, dim)).astype(np.float32)   # [token, layer, head, dim]

    def pack(order: str, kk: np.ndarray, vv: np.ndarray) -> np.ndarray:
        n = kk.shape[0] // tpp
        out = np.zeros((n, layers * heads * 2 * tpp * dim), np.float32)
        for t in range(kk.shape[0]):
            for layer in range(layers):
                for h in range(heads):
                    for d in range(dim):
                        p, r = divmod(t, tpp)
                        if order == "std":
                            base = ((layer * 2) * tpp + r) * heads * dim + h * dim + d
                            out[p, base] = kk[t, layer, h, d]
                            out[p, base + tpp * heads * dim] = vv[t, layer, h, d]
                        else:
                            head = (layer * heads + h) * 2 * tpp * dim
                            out[p, head + d * tpp + r] = kk[t, layer, h, d]
                            out[p, head + tpp * dim + r * dim + d] = vv[t, layer, h, d]
        return out.view(np.uint8)

    rope = Rope.from_theta(10000.0, dim)
    src_t, dst_t = np.arange(3, 9), np.arange(1, 7)          # rows across page boundaries
    results = []
    for order, layout in (("std", std), ("cpu", cpu)):
        src, dst = pack(order, k, v), pack(order, np.zeros_like(k[:2 * tpp]), np.zeros_like(v[:2 * tpp]))
        move_tokens(src, src_t, src_t, dst, dst_t, dst_t - 1, layout, rope)
        results.append(dst)
    moved_k = rope.move(k[3:9], src_t, dst_t - 1)
    want_k, want_v = np.zeros_like(k[:2 * tpp]), np.zeros_like(v[:2 * tpp])
    want_k[1:7], want_v[1:7] = moved_k, v[3:9]
    assert np.array_equal(results[0], pack("std", want_k, want_v))
    assert np.array_equal(results[1], pack("cpu", want_k, want_v))
