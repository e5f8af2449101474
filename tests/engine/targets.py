"""Where engine-copy tests run: every body runs on CPU, and on CUDA (``gpu`` marker) when present.

``cpu-torch`` is the CPU path CI runs; ``cpu-kernel`` runs the CUDA kernel's descriptor
batches through the host emulation, so CI checks the addresses every launch would use;
``cuda-torch`` and ``cuda-kernel`` run the same bodies on a GPU and skip cleanly elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tierkv.engine.cuda import cupy_present
from tierkv.engine.geometry import EngineLayout, EngineLayoutKind
from tierkv.engine.rows import CopyPath

HAS_CUDA = torch.cuda.is_available()
_NO_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
_NO_KERNEL = pytest.mark.skipif(not cupy_present(), reason="no CUDA device or no CuPy")


@dataclass(frozen=True)
class Target:
    device: torch.device
    path: CopyPath

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in host memory, pinned when the target is CUDA (so copies can be asynchronous)."""
        t = t.cpu()
        return t.pin_memory() if self.cuda else t


TARGETS = [
    pytest.param(Target(torch.device("cpu"), CopyPath.TORCH), id="cpu-torch"),
    pytest.param(Target(torch.device("cpu"), CopyPath.KERNEL), id="cpu-kernel"),
    pytest.param(Target(torch.device("cuda", 0), CopyPath.TORCH), id="cuda-torch", marks=[pytest.mark.gpu, _NO_CUDA]),
    pytest.param(Target(torch.device("cuda", 0), CopyPath.KERNEL), id="cuda-kernel",
                 marks=[pytest.mark.gpu, _NO_KERNEL]),
]
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, _NO_CUDA]),
]


def random_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A uint8 tensor of random bytes."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, shape, dtype=np.uint8))


def random_layers(layout: EngineLayout, num_blocks: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    """Per-layer engine KV tensors of random bytes (any bit pattern, NaNs included)."""
    dtype = getattr(torch, layout.dtype.torch_name)
    shape = layout.layer_shape(num_blocks)
    item = layout.dtype.itemsize
    return [random_bytes((*shape[:-1], shape[-1] * item), seed + i).view(dtype).to(device)
            for i in range(layout.num_layers)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A CPU uint8 copy of ``t``'s bytes, for exact comparisons."""
    return t.detach().cpu().contiguous().view(torch.uint8).clone()


def reference_pages(layout: EngineLayout, tokens_per_page: int, layers: list[torch.Tensor],
                    block_ids: list[int]) -> torch.Tensor:
    """Store pages built by plain slicing and concatenation, independent of tierkv.engine."""
    k = tokens_per_page // layout.block_size
    pages = []
    for i in range(len(block_ids) // k):
        ids = block_ids[i * k:(i + 1) * k]
        per_layer = []
        for t in layers:
            t = t.cpu()
            if layout.kind is EngineLayoutKind.FLASH:
                per_layer.append(torch.stack([torch.cat([t[0, b] for b in ids]), torch.cat([t[1, b] for b in ids])]))
            elif layout.kind is EngineLayoutKind.BLOCKS_FIRST:
                per_layer.append(torch.cat([t[b] for b in ids], dim=1))
            else:
                per_layer.append(torch.cat([t[b] for b in ids], dim=0))
        pages.append(as_bytes(torch.stack(per_layer)).reshape(-1))
    return torch.stack(pages) if pages else torch.zeros((0, 1), dtype=torch.uint8)
