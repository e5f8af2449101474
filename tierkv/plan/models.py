"""Model architectures for ``tierkv plan``: a built-in table and a Hugging Face ``config.json`` parser.

:class:`ModelSpec` holds what the planner needs of a model: the KV-cache geometry
(which becomes a :class:`tierkv.layout.KVLayout`), the attention shape (for the
quadratic part of prefill FLOPs), the parameters active per token (for the linear
part) and the weight bytes (for the HBM left to the KV cache). Built-in models are the
relevant fields of each model's public ``config.json``, parsed by the same
:func:`from_hf_config` as a user's file, so one code path serves both. Called by
:mod:`tierkv.plan.planner` and :mod:`tierkv.cli.plan`.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tierkv.errors import ConfigError, InputError
from tierkv.layout import DType, KVLayout, LayoutKind


class AttentionKind(enum.Enum):
    """How a model's attention caches keys and values."""

    MHA = "mha"   # one K and one V head per query head
    GQA = "gqa"   # fewer K/V heads than query heads
    MLA = "mla"   # one compressed latent (plus a shared RoPE key) per token


@dataclass(frozen=True)
class ModelSpec:
    """One model's architecture as the planner uses it.

    ``num_kv_heads`` and ``head_dim`` describe what is *cached* per layer and token:
    for MLA that is one latent of ``kv_lora_rank + qk_rope_head_dim``. ``qk_head_dim``
    and ``v_head_dim`` are the per-head widths attention computes with.
    ``active_params`` counts the weights one token passes through, without the
    embedding and output head (prefill computes logits for the last token only).
    """

    name: str
    attention: AttentionKind
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    qk_head_dim: int
    v_head_dim: int
    active_params: int
    total_params: int
    weight_bytes_per_param: int
    max_context_tokens: int

    def layout(self, dtype: DType | str = DType.BF16, tokens_per_page: int = 16) -> KVLayout:
        kind = LayoutKind.LATENT if self.attention is AttentionKind.MLA else LayoutKind.KV
        return KVLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                        dtype=DType.parse(dtype), tokens_per_page=tokens_per_page, kind=kind)

    @property
    def attention_flops_coeff(self) -> int:
        """``c`` in ``attention FLOPs = c * N**2`` for a causal prefill of ``N`` tokens.

        Per layer and head, QK^T and AV each take N**2/2 multiply-adds of width
        ``qk_head_dim`` and ``v_head_dim``: ``2 * N**2/2 * (d_qk + d_v)`` FLOPs.
        """
        return self.num_layers * self.num_attention_heads * (self.qk_head_dim + self.v_head_dim)

    @property
    def weight_bytes(self) -> int:
        return self.total_params * self.weight_bytes_per_param


# Relevant fields of each model's public config.json on huggingface.co (the file named
# in the comment, main branch). Only fields the planner reads are kept.
BUILTIN_CONFIGS: dict[str, dict[str, object]] = {
    # meta-llama/Llama-3.1-8B-Instruct/config.json: GQA, 32 layers, 8 KV heads, head_dim 4096/32 = 128
    "llama-3.1-8b": {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # meta-llama/Llama-3.1-70B-Instruct/config.json: GQA, 80 layers, 8 KV heads, head_dim 8192/64 = 128
    "llama-3.1-70b": {"num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 28672,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                      "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # meta-llama/Llama-3.1-405B-Instruct/config.json: GQA, 126 layers, 8 KV heads, head_dim 16384/128 = 128
    "llama-3.1-405b": {"num_hidden_layers": 126, "hidden_size": 16384, "intermediate_size": 53248,
                       "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256,
                       "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # Qwen/Qwen2.5-7B-Instruct/config.json: GQA, 28 layers, 4 KV heads, head_dim 3584/28 = 128
    "qwen2.5-7b": {"num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # Qwen/Qwen2.5-72B-Instruct/config.json: GQA, 80 layers, 8 KV heads, head_dim 8192/64 = 128
    "qwen2.5-72b": {"num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 29568,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064,
                    "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # mistralai/Mistral-7B-Instruct-v0.3/config.json: GQA, 32 layers, 8 KV heads, head_dim 128,
    # no sliding window (v0.1 had a 4096-token window, which would cap the cache per request)
    "mistral-7b": {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32768,
                   "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # mistralai/Mixtral-8x7B-Instruct-v0.1/config.json: GQA, 32 layers, 8 KV heads, head_dim 128;
    # 8 experts of 14336, 2 per token
    "mixtral-8x7b": {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                     "num_local_experts": 8, "num_experts_per_tok": 2,
                     "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # deepseek-ai/DeepSeek-V3/config.json: MLA, 61 layers, cached latent kv_lora_rank 512 +
    # qk_rope_head_dim 64; 128 heads of qk 128+64 and v 128; 256 routed experts (8 per token) + 1
    # shared of 2048, first 3 layers dense; FP8 weights (quantization_config)
    "deepseek-v3": {"num_hidden_layers": 61, "hidden_size": 7168, "intermediate_size": 18432,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280,
                    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048, "first_k_dense_replace": 3,
                    "max_position_embeddings": 163840, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}},
    # HuggingFaceTB/SmolLM2-135M-Instruct/config.json: GQA, 30 layers, 3 KV heads, head_dim 576/9 = 64
    "smollm2-135m": {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16"},
}


def builtin(name: str) -> ModelSpec:
    """The built-in model ``name`` (case-insensitive); InputError lists the known names."""
    key = name.strip().lower()
    if key not in BUILTIN_CONFIGS:
        raise InputError(f"unknown model {name!r}; built-in models: {', '.join(BUILTIN_CONFIGS)} "
                         "(or pass --model-config PATH to a Hugging Face config.json)")
    return from_hf_config(BUILTIN_CONFIGS[key], key)


def load_hf_config(path: str | os.PathLike[str]) -> ModelSpec:
    """Parse a Hugging Face ``config.json``; ConfigError names the file and what is wrong."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"model config {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"model config {str(p)!r} is not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model config {str(p)!r}: expected a JSON object, got {type(data).__name__}")
    name = str(data.get("_name_or_path") or p.parent.name or p.stem)
    return from_hf_config(data, name, where=str(p))


def from_hf_config(cfg: Mapping[str, object], name: str, where: str = "model config") -> ModelSpec:
    """A :class:`ModelSpec` from the fields of a Hugging Face ``config.json``.

    Handles ``num_key_value_heads`` absent (MHA), ``head_dim`` absent
    (``hidden_size / num_attention_heads``), DeepSeek's MLA (``kv_lora_rank``,
    ``qk_rope_head_dim``) and MoE fields of Mixtral, Qwen-MoE and DeepSeek.
    A multimodal config's ``text_config`` is used when the top level has no layers; its
    quantization and dtype, when it lacks them, come from the top level.
    """
    outer = cfg
    text = cfg.get("text_config")
    if "num_hidden_layers" not in cfg and isinstance(text, Mapping):
        cfg = text
    f = _Fields(cfg, where)
    layers, hidden, heads = f.int("num_hidden_layers"), f.int("hidden_size"), f.int("num_attention_heads")
    if f.opt_int("kv_lora_rank") is not None:
        kv_lora, rope = f.int("kv_lora_rank"), f.int("qk_rope_head_dim")
        nope, v_dim = f.int("qk_nope_head_dim"), f.int("v_head_dim")
        kind, kv_heads, cached_dim, qk_dim = AttentionKind.MLA, 1, kv_lora + rope, nope + rope
    else:
        head_dim = f.opt_int("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads "
                                  f"{heads} and head_dim is absent")
            head_dim = hidden // heads
        kv_heads = f.opt_int("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                              f"{kv_heads}")
        kind = AttentionKind.MHA if kv_heads == heads else AttentionKind.GQA
        cached_dim = qk_dim = v_dim = head_dim
    active, total = _params(f, kind, layers, hidden, heads, kv_heads, qk_dim, v_dim)
    return ModelSpec(name=name, attention=kind, num_layers=layers, num_attention_heads=heads,
                     num_kv_heads=kv_heads, head_dim=cached_dim, qk_head_dim=qk_dim, v_head_dim=v_dim,
                     active_params=active, total_params=total,
                     weight_bytes_per_param=_weight_bytes(cfg, outer),
                     max_context_tokens=f.opt_int("max_position_embeddings") or 131072)


class _Fields:
    """Typed access to config fields, with errors that name the file and the field."""

    def __init__(self, cfg: Mapping[str, object], where: str) -> None:
        self.cfg, self.where = cfg, where

    def opt_int(self, key: str) -> int | None:
        value = self.cfg.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{self.where}: {key} must be a positive integer, got {value!r}")
        return value

    def count(self, key: str) -> int:
        """A field that may be 0 or absent (absent reads as 0)."""
        value = self.cfg.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{self.where}: {key} must be an integer >= 0, got {value!r}")
        return value

    def int(self, key: str) -> int:
        value = self.opt_int(key)
        if value is None:
            raise ConfigError(f"{self.where}: missing field {key!r}")
        return value


def _params(f: _Fields, kind: AttentionKind, layers: int, hidden: int, heads: int, kv_heads: int,
            qk_dim: int, v_dim: int) -> tuple[int, int]:
    """(active non-embedding parameters per token, total parameters), from the config's shapes."""
    if kind is AttentionKind.MLA:
        q_rank = f.opt_int("q_lora_rank")
        q = hidden * q_rank + q_rank * heads * qk_dim if q_rank else hidden * heads * qk_dim
        kv_rank, rope = f.int("kv_lora_rank"), f.int("qk_rope_head_dim")
        attn = q + hidden * (kv_rank + rope) + kv_rank * heads * (qk_dim - rope + v_dim) + heads * v_dim * hidden
    else:
        attn = hidden * heads * qk_dim + 2 * hidden * kv_heads * qk_dim + heads * v_dim * hidden
    dense_mlp = 3 * hidden * (f.opt_int("intermediate_size") or 4 * hidden)  # gated (SwiGLU) MLP
    experts = f.opt_int("n_routed_experts") or f.opt_int("num_local_experts") or f.opt_int("num_experts")
    active_mlp = total_mlp = dense_mlp * layers
    if experts:
        per_tok = f.opt_int("num_experts_per_tok") or 2
        expert = 3 * hidden * (f.opt_int("moe_intermediate_size") or f.opt_int("intermediate_size") or 4 * hidden)
        shared = (f.opt_int("n_shared_experts") or 0) * expert \
            + 3 * hidden * (f.opt_int("shared_expert_intermediate_size") or 0)
        dense_layers = min(layers, f.count("first_k_dense_replace"))
        moe_layers = layers - dense_layers
        router = hidden * experts
        active_mlp = dense_layers * dense_mlp + moe_layers * (per_tok * expert + shared + router)
        total_mlp = dense_layers * dense_mlp + moe_layers * (experts * expert + shared + router)
    vocab = f.opt_int("vocab_size") or 32000
    embeddings = vocab * hidden * (1 if f.cfg.get("tie_word_embeddings") else 2)
    return layers * attn + active_mlp, layers * attn + total_mlp + embeddings


def _weight_bytes(cfg: Mapping[str, object], outer: Mapping[str, object]) -> int:
    """Bytes per weight: 1 for FP8 quantization, else from the dtype (``torch_dtype``, or ``dtype`` as
    recent transformers write it); ``cfg`` (the text config) first, then ``outer`` (the whole file)."""
    quant = cfg.get("quantization_config") or outer.get("quantization_config")
    if isinstance(quant, Mapping) and str(quant.get("quant_method", "")).lower() == "fp8":
        return 1
    dtype = next((c[k] for c in (cfg, outer) for k in ("torch_dtype", "dtype") if c.get(k)), "bfloat16")
    return 4 if str(dtype).lower() in ("float32", "fp32") else 2
