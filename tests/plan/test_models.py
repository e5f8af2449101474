"""Model table and Hugging Face config parsing: KV bytes by hand, MLA, MHA, missing fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierkv.errors import ConfigError, InputError
from tierkv.layout import DType, LayoutKind
from tierkv.plan.models import BUILTIN_CONFIGS, AttentionKind, builtin, from_hf_config, load_hf_config


def test_llama_3_1_8b_bf16_by_hand() -> None:
    layout = builtin("llama-3.1-8b").layout(DType.BF16, tokens_per_page=16)
    assert layout.token_bytes == 32 * 8 * 128 * 2 * 2 == 131_072
    assert layout.page_bytes == 131_072 * 16
    assert builtin("llama-3.1-8b").layout(DType.FP8_E4M3).token_bytes == 65_536


def test_deepseek_v3_mla_by_hand() -> None:
    model = builtin("deepseek-v3")
    layout = model.layout(DType.BF16)
    assert model.attention is AttentionKind.MLA and layout.kind is LayoutKind.LATENT
    assert (layout.num_kv_heads, layout.head_dim) == (1, 512 + 64)
    assert layout.token_bytes == 61 * (512 + 64) * 2 == 70_272
    assert (model.qk_head_dim, model.v_head_dim) == (128 + 64, 128)


@pytest.mark.parametrize("name, layers, kv_heads, head_dim", [
    ("llama-3.1-70b", 80, 8, 128), ("llama-3.1-405b", 126, 8, 128), ("qwen2.5-7b", 28, 4, 128),
    ("qwen2.5-72b", 80, 8, 128), ("mistral-7b", 32, 8, 128), ("mixtral-8x7b", 32, 8, 128),
    ("smollm2-135m", 30, 3, 64)])
def test_builtin_geometry(name: str, layers: int, kv_heads: int, head_dim: int) -> None:
    m = builtin(name)
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.attention) == (layers, kv_heads, head_dim, AttentionKind.GQA)
    assert m.layout().token_bytes == layers * kv_heads * head_dim * 2 * 2


@pytest.mark.parametrize("name, attr, published", [
    ("llama-3.1-8b", "total_params", 8.03e9),        # model card: 8.03B
    ("qwen2.5-7b", "total_params", 7.61e9),           # model card: 7.61B (QKV biases not counted here)
    ("mixtral-8x7b", "total_params", 46.7e9),         # 46.7B total
    ("deepseek-v3", "total_params", 671e9),           # 671B without the MTP module
    ("deepseek-v3", "active_params", 36.6e9 - 0.9e9),  # 36.6B activated, 0.9B of it the output head
])
def test_parameter_estimates_match_published(name: str, attr: str, published: float) -> None:
    assert getattr(builtin(name), attr) == pytest.approx(published, rel=0.01)


def test_every_builtin_parses_and_names_are_listed_on_error() -> None:
    for name in BUILTIN_CONFIGS:
        assert builtin(name.upper()).name == name
    with pytest.raises(InputError, match="unknown model 'llama-9'.*llama-3.1-8b"):
        builtin("llama-9")


def _write(tmp_path: Path, cfg: dict[str, object]) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def test_hf_deepseek_v3_style_config(tmp_path: Path) -> None:
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
           "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
           "q_lora_rank": 1536, "intermediate_size": 18432, "moe_intermediate_size": 2048,
           "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
           "vocab_size": 129280, "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
           "quantization_config": {"quant_method": "fp8"}, "_name_or_path": "my-dsv3"}
    m = load_hf_config(_write(tmp_path, cfg))
    assert m.name == "my-dsv3" and m.attention is AttentionKind.MLA
    assert m.layout(DType.BF16).token_bytes == 70_272
    assert m.weight_bytes_per_param == 1 and m.max_context_tokens == 163840
    assert m.active_params == builtin("deepseek-v3").active_params


def test_hf_mha_without_kv_heads_or_head_dim(tmp_path: Path) -> None:
    m = load_hf_config(_write(tmp_path, {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
                                          "intermediate_size": 3072, "vocab_size": 50257}))
    assert m.attention is AttentionKind.MHA and m.num_kv_heads == 12 and m.head_dim == 64
    assert m.layout().token_bytes == 12 * 12 * 64 * 2 * 2


def test_hf_explicit_head_dim_wins_and_text_config_is_used() -> None:
    cfg = {"text_config": {"num_hidden_layers": 4, "hidden_size": 3072, "num_attention_heads": 16,
                           "num_key_value_heads": 8, "head_dim": 256}}
    m = from_hf_config(cfg, "mm")
    assert (m.num_kv_heads, m.head_dim, m.attention) == (8, 256, AttentionKind.GQA)


@pytest.mark.parametrize("cfg, message", [
    ({"hidden_size": 768, "num_attention_heads": 12}, "missing field 'num_hidden_layers'"),
    ({"num_hidden_layers": 2, "hidden_size": 770, "num_attention_heads": 12}, "not a multiple"),
    ({"num_hidden_layers": -2, "hidden_size": 768, "num_attention_heads": 12}, "positive integer, got -2"),
    ({"num_hidden_layers": 2, "hidden_size": 768, "num_attention_heads": 12, "num_key_value_heads": 5},
     "not a multiple of num_key_value_heads 5"),
    ({"num_hidden_layers": 2, "hidden_size": 768, "num_attention_heads": 12, "kv_lora_rank": 512},
     "missing field 'qk_rope_head_dim'"),
])
def test_hf_bad_configs(cfg: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_hf_config(cfg, "bad")


def test_hf_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_hf_config(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        load_hf_config(tmp_path / "x.json")


@pytest.mark.parametrize("top, text, per_param", [
    ({"quantization_config": {"quant_method": "fp8"}, "torch_dtype": "bfloat16"}, {}, 1),  # top-level quant
    ({"torch_dtype": "float32"}, {}, 4),                                 # top-level dtype
    ({"dtype": "float32"}, {}, 4),                                       # newer transformers' key
    ({"torch_dtype": "float32"}, {"torch_dtype": "bfloat16"}, 2),        # the text config's own wins
    ({"quantization_config": {"quant_method": "fp8"}}, {"quantization_config": {"quant_method": "gptq"}}, 2),
    ({"torch_dtype": "bfloat16", "dtype": "float32"}, {}, 2),            # torch_dtype before dtype
])
def test_multimodal_weights_read_the_top_level(top: dict[str, object], text: dict[str, object],
                                               per_param: int) -> None:
    geometry = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4}
    model = from_hf_config({**top, "text_config": {**geometry, **text}}, "mm")
    assert model.weight_bytes_per_param == per_param
    assert from_hf_config({**top, **geometry, **text}, "flat").weight_bytes_per_param == per_param
