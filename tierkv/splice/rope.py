"""Rotary position embeddings of cached keys, moved to new positions (Leyline-style splices).

A key cached at position ``p`` holds ``R(a_p) k`` (rotary embedding, RoPE): each pair of
its first ``rotary_dim`` channels rotated by the angle ``a_p[i] = p * inv_freq[i]``. Moved
to position ``q``, the same key is ``R(a_q - a_p) R(a_p) k``: a rotation by the difference,
with no need of ``k`` itself. :class:`Rope` does that for a model's rotary convention:

- the pairs: ``half`` (channels ``i`` and ``i + rotary_dim/2``; Llama, Mistral, Qwen, the
  ``rotate_half`` of transformers) or ``interleaved`` (``2i`` and ``2i+1``; GPT-J, and
  models converted from Meta's original checkpoints);
- ``rotary_dim`` <= ``head_dim`` (partial rotary: the other channels are not rotated);
- the inverse frequencies, scaling included (linear, llama3, yarn: static ones, read from
  the model or computed by transformers from its config). Scalings whose frequencies
  depend on the sequence length (``dynamic``, ``longrope``) are refused: a key computed
  under one set of frequencies cannot be moved into another by a rotation.

Angles are computed as the model computes them (``float32(position) * inv_freq`` rounded to
float32) and their difference applied in float64, so a moved key matches a fresh
computation at its new position to float32 rounding: the first layer's keys, which do not
depend on context, agree with a fresh prefill of the edited text to about 1e-6.

Values carry no position and are never rotated. Pure numpy; thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from tierkv.errors import InputError
from tierkv.layout import DType, KVLayout, LayoutKind, from_standard_order, to_standard_order

Convention = Literal["half", "interleaved"]
#: Scalings whose frequencies change with the sequence's length.
POSITION_DEPENDENT = frozenset({"dynamic", "longrope"})
#: Rope types (transformers' names) whose frequencies are fixed: a moved key is a rotation.
STATIC_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
#: Model types whose rotary pairs are interleaved (``2i``, ``2i+1``) in transformers.
INTERLEAVED_TYPES = frozenset({"cohere", "gptj"})
#: Model types with layers that use no RoPE (told by ``layer_types``, not ``no_rope_layers``).
MIXED_ROPE_LAYERS = frozenset({"cohere2", "llama4", "llama4_text"})


@dataclass(frozen=True, eq=False)
class Rope:
    """A model's rotary embedding: ``inv_freq`` (float32, ``rotary_dim / 2`` of them),
    ``head_dim``, the pairing ``convention``, and the scaling's name (``rope_type``)."""

    inv_freq: np.ndarray
    head_dim: int
    convention: Convention = "half"
    rope_type: str = "default"

    def __post_init__(self) -> None:
        inv = np.asarray(self.inv_freq, dtype=np.float32).reshape(-1)
        object.__setattr__(self, "inv_freq", inv)
        if self.convention not in ("half", "interleaved"):
            raise InputError(f"rotary convention must be 'half' or 'interleaved', got {self.convention!r}")
        if not inv.size or 2 * inv.size > self.head_dim or not np.isfinite(inv).all():
            raise InputError(f"{inv.size} inverse frequencies do not fit a head of {self.head_dim} channels "
                             "(rotary_dim = 2 x their number, at most head_dim)")
        if self.rope_type in POSITION_DEPENDENT:
            raise InputError(f"rope_type {self.rope_type!r} changes its frequencies with the sequence's length: "
                             "a cached key cannot be moved to a new position by a rotation")

    @property
    def rotary_dim(self) -> int:
        return 2 * int(self.inv_freq.size)

    # -- where it comes from ----------------------------------------------------------------
    @classmethod
    def from_theta(cls, theta: float, head_dim: int, *, rotary_dim: int | None = None,
                   convention: Convention = "half") -> Rope:
        """The original RoPE: ``inv_freq[i] = theta ** (-2i / rotary_dim)`` (as transformers computes it)."""
        dim = head_dim if rotary_dim is None else rotary_dim
        if dim <= 0 or dim % 2 or dim > head_dim:
            raise InputError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {dim}")
        inv = (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
        return cls(inv.astype(np.float32), head_dim, convention)

    @classmethod
    def from_model(cls, model: Any, convention: Convention | None = None) -> Rope:
        """The rotary embedding a transformers model's decoder uses: its ``rotary_emb``
        module's ``inv_freq`` (scaling applied) and its config's head size and
        ``rope_type``. ``convention``: the pairing, by default what the model type is
        known to use (``interleaved`` for Cohere and GPT-J, ``half`` otherwise).

        Refused with InputError, rather than moved wrongly: models where some layers use
        no RoPE (``no_rope_layers``, Cohere2, Llama 4) or where layer types have rotary
        embeddings of their own (Gemma 3, Olmo 3), and rope types not known to be a
        fixed rotation per position (:data:`STATIC_TYPES`)."""
        rotary, text, model_type = _rotary_of(model)
        return _rope(rotary, text, model_type, convention)

    @classmethod
    def from_config(cls, config: Any, convention: Convention | None = None) -> Rope:
        """:meth:`from_model` from a transformers config (``AutoConfig.from_pretrained`` of
        the model's folder) without its weights: the model is laid out on the meta device
        and only its rotary embedding made for real, so its frequencies are computed as
        the model computes them. For a process that splices through a daemon and never
        loads the model."""
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError as exc:
            raise InputError(f"Rope.from_config needs torch and transformers ({exc})") from None
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(text_config)
        except (ValueError, KeyError, RuntimeError, TypeError) as exc:   # a model type transformers cannot build
            raise InputError(f"cannot lay out a {getattr(text_config, 'model_type', '?')} model from its config "
                             f"({exc}); use Rope.from_model with the loaded model") from None
        rotary, text, model_type = _rotary_of(model)
        with torch.device("cpu"):
            real = type(rotary)(text)
        return _rope(real, text, model_type, convention)

    # -- moving keys ------------------------------------------------------------------------
    def angles(self, positions: np.ndarray) -> np.ndarray:
        """The rotation angles at ``positions``, as the model computes them (float32), in float64."""
        pos = np.asarray(positions)
        if pos.dtype.kind not in "iu" or (pos < 0).any():
            raise InputError("positions must be whole numbers >= 0")
        if (pos >= 1 << 24).any():   # float32 represents every integer below 2**24 exactly
            raise InputError("positions must be below 2**24")
        return (pos.astype(np.float32)[..., None] * self.inv_freq).astype(np.float32).astype(np.float64)

    def move(self, keys: np.ndarray, old_positions: np.ndarray, new_positions: np.ndarray) -> np.ndarray:
        """``keys`` (``[tokens, ..., head_dim]`` float, cached at ``old_positions``, one per
        token) as they would be at ``new_positions``: a new float32 array."""
        k = np.asarray(keys)
        if k.dtype.kind != "f":
            raise InputError(f"keys must be floating point, got {k.dtype}")
        if k.ndim < 2 or k.shape[-1] != self.head_dim:
            raise InputError(f"keys must be [tokens, ..., {self.head_dim}], got shape {k.shape}")
        old, new = np.asarray(old_positions), np.asarray(new_positions)
        if old.shape != (k.shape[0],) or new.shape != (k.shape[0],):
            raise InputError(f"one old and one new position per token: {k.shape[0]} tokens, got "
                             f"{old.shape} and {new.shape}")
        delta = self.angles(new) - self.angles(old)          # [tokens, rotary_dim/2]
        cos, sin = np.cos(delta), np.sin(delta)
        extra = (1,) * (k.ndim - 2)
        cos = cos.reshape(k.shape[0], *extra, -1)
        sin = sin.reshape(k.shape[0], *extra, -1)
        out = k.astype(np.float32, copy=True)
        r = self.rotary_dim
        if self.convention == "half":
            x1 = k[..., :r // 2].astype(np.float64)
            x2 = k[..., r // 2:r].astype(np.float64)
            out[..., :r // 2] = x1 * cos - x2 * sin
            out[..., r // 2:r] = x2 * cos + x1 * sin
        else:
            x1 = k[..., 0:r:2].astype(np.float64)
            x2 = k[..., 1:r:2].astype(np.float64)
            out[..., 0:r:2] = x1 * cos - x2 * sin
            out[..., 1:r:2] = x2 * cos + x1 * sin
        return out


def _rotary_of(model: Any) -> tuple[Any, Any, str]:
    """The decoder's one rotary embedding module, the text config, and the model type;
    InputError for what :meth:`Rope.from_model` refuses."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    if text is None:
        raise InputError("the model has no config to read its rotary embedding from")
    model_type = str(getattr(text, "model_type", ""))
    if getattr(text, "no_rope_layers", None) is not None or model_type in MIXED_ROPE_LAYERS:
        raise InputError(f"{model_type or 'this model'} has layers without RoPE: moving its cached keys would "
                         "rotate those wrongly; splices are not supported for it yet")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    found = [(name, m) for name, m in decoder.named_modules()
             if name.split(".")[-1] == "rotary_emb" and hasattr(m, "inv_freq")]
    if not found:
        per_type = [name for name, _ in decoder.named_modules() if name.split(".")[-1] == "rotary_emb"]
        raise InputError("the model's decoder has rotary embeddings per layer type (different frequencies by "
                         "layer), not supported yet" if per_type else
                         "the model's decoder has no rotary embedding module (a 'rotary_emb' with 'inv_freq'): "
                         "it does not use RoPE, or not as transformers' Llama-family models do")
    if len(found) > 1:
        raise InputError(f"the model's decoder has {len(found)} rotary embeddings "
                         f"({', '.join(n for n, _ in found)}): which one its layers use is not known here")
    return found[0][1], text, model_type


def _rope(rotary: Any, text: Any, model_type: str, convention: Convention | None) -> Rope:
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if rope_type not in STATIC_TYPES:
        raise InputError(f"rope_type {rope_type!r} is not known to be a fixed rotation per position "
                         f"(known: {', '.join(sorted(STATIC_TYPES))}); splices are not supported for it")
    try:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    except (AttributeError, TypeError, ValueError) as exc:   # transformers' own config errors included
        raise InputError(f"cannot read the model's head size from its config: {exc}") from None
    if convention is None:
        convention = "interleaved" if model_type in INTERLEAVED_TYPES else "half"
    return Rope(rotary.inv_freq.detach().to("cpu").float().numpy(), int(head_dim), convention, rope_type)


# -- on the store's pages ---------------------------------------------------------------------
def to_float32(raw: np.ndarray, dtype: DType) -> np.ndarray:
    """Elements of ``dtype`` held as their bits (``uint32`` for fp32, ``uint16`` for fp16 and
    bf16) as float32."""
    if dtype is DType.FP32:
        return raw.view(np.float32)
    if dtype is DType.FP16:
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)   # bf16: the high half of a float32


def from_float32(x: np.ndarray, dtype: DType) -> np.ndarray:
    """``x`` as the bits of ``dtype`` (bf16 rounded to nearest even, NaN kept NaN)."""
    if dtype is DType.FP32:
        return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    if dtype is DType.FP16:
        return np.ascontiguousarray(x, dtype=np.float16).view(np.uint16)
    bits = x.astype(np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def move_tokens(src: np.ndarray, src_tokens: np.ndarray, src_positions: np.ndarray, dst: np.ndarray,
                dst_tokens: np.ndarray, dst_positions: np.ndarray, layout: KVLayout, rope: Rope) -> None:
    """Copy tokens between pages of ``layout`` (``[pages, page_bytes]`` uint8 arrays), every
    layer: token ``src_tokens[i]`` (its index across ``src``'s pages: page ``t //
    tokens_per_page``, row ``t % tokens_per_page``), cached at ``src_positions[i]``, becomes
    token ``dst_tokens[i]`` of ``dst`` at ``dst_positions[i]``: its keys rotated by
    :meth:`Rope.move`, its values copied bit for bit. Standard K+V pages only."""
    if layout.kind is not LayoutKind.KV:
        raise InputError(f"moving tokens needs K+V pages, not {layout.kind.value} pages")
    if layout.dtype not in _RAW:
        raise InputError(f"moving tokens needs bf16, fp16 or fp32 pages, not {layout.dtype.value}")
    if layout.head_dim != rope.head_dim:
        raise InputError(f"the layout's head_dim {layout.head_dim} is not the rotary embedding's {rope.head_dim}")
    tpp = layout.tokens_per_page
    views = []
    for name, pages in (("src", src), ("dst", dst)):
        if pages.dtype != np.uint8 or pages.ndim != 2 or pages.shape[1] != layout.page_bytes:
            raise InputError(f"{name} must be [pages, {layout.page_bytes}] uint8, got {pages.dtype} {pages.shape}")
        views.append(pages.view(_RAW[layout.dtype]).reshape(pages.shape[0], *layout.page_shape))
    sv, dv = views
    cpu = layout.page_order.engine_blocks
    if cpu:   # moved in the standard order, then packed back (every row of dst: those not named unchanged)
        sv, dv = to_standard_order(sv, layout), to_standard_order(dv, layout)
    s_idx, d_idx = np.asarray(src_tokens, np.int64), np.asarray(dst_tokens, np.int64)
    if s_idx.shape != d_idx.shape or s_idx.ndim != 1:
        raise InputError(f"src_tokens and dst_tokens must be 1-D and alike, got {s_idx.shape} and {d_idx.shape}")
    for idx, pages, name in ((s_idx, src, "src"), (d_idx, dst, "dst")):
        if idx.size and (idx.min() < 0 or idx.max() >= pages.shape[0] * tpp):
            raise InputError(f"{name}_tokens must be within its {pages.shape[0] * tpp} tokens")
    if len(np.unique(d_idx)) != d_idx.size:
        raise InputError("dst_tokens names a token twice")
    sp, sr = np.divmod(s_idx, tpp)
    dp, dr = np.divmod(d_idx, tpp)
    keys = sv[sp, :, 0, sr]                    # [tokens, layers, heads, head_dim] raw
    values = sv[sp, :, 1, sr]
    moved = rope.move(to_float32(np.ascontiguousarray(keys), layout.dtype), src_positions, dst_positions)
    dv[dp, :, 0, dr] = from_float32(moved, layout.dtype)
    dv[dp, :, 1, dr] = values
    if cpu:
        views[1][...] = from_standard_order(dv, layout)


_RAW = {DType.FP32: np.uint32, DType.FP16: np.uint16, DType.BF16: np.uint16}
