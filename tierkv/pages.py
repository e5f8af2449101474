"""Validation of page batches handed in by serving engines.

Engines pass pages as a torch tensor ``[n, *layout.page_shape]`` in the layout's
dtype, or as raw bytes: a uint8 torch tensor or numpy array ``[n, page_bytes]``.
Either becomes a zero-copy ``uint8 [n, page_bytes]`` numpy view. Every mismatch
raises :class:`~tierkv.errors.InputError` naming what was expected. Called by the API.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Union

import numpy as np

from tierkv.errors import InputError
from tierkv.layout import KVLayout

if TYPE_CHECKING:
    import torch

# torch is imported lazily (it takes seconds, and minutes in the emulated rig guest): a
# caller holding a tensor has imported it already, so sys.modules tells whether one can be.
PageBatch = Union["torch.Tensor", np.ndarray]


def _is_tensor(x: object) -> bool:
    torch_mod = sys.modules.get("torch")
    return torch_mod is not None and isinstance(x, torch_mod.Tensor)


def page_rows(pages: PageBatch, layout: KVLayout, what: str, max_pages: int) -> np.ndarray:
    """A ``uint8 [n, page_bytes]`` view of ``pages``; raises InputError on any mismatch."""
    pb = layout.page_bytes
    if _is_tensor(pages):
        rows = _torch_rows(pages, layout, what)  # type: ignore[arg-type]
    elif isinstance(pages, np.ndarray):
        if pages.dtype != np.uint8 or pages.ndim != 2 or pages.shape[1] != pb:
            raise InputError(f"{what}: a numpy page batch must be uint8 of shape [n, {pb}], "
                             f"got {pages.dtype} {tuple(pages.shape)}")
        if not pages.flags.c_contiguous:
            raise InputError(f"{what}: the page batch must be C-contiguous")
        rows = pages
    else:
        raise InputError(f"{what}: pages must be a torch.Tensor or numpy.ndarray, got {type(pages).__name__}")
    if rows.shape[0] > max_pages:
        raise InputError(f"{what}: {rows.shape[0]} pages given but the tokens hold only {max_pages} full "
                         f"pages of {layout.tokens_per_page} tokens")
    return rows


def _torch_rows(t: torch.Tensor, layout: KVLayout, what: str) -> np.ndarray:
    import torch

    pb = layout.page_bytes
    if t.device.type != "cpu":
        raise InputError(f"{what}: pages on {t.device} are not supported by this store's tiers; "
                         "expected a CPU tensor (configure an HBM tier for device pages)")
    if not t.is_contiguous():
        raise InputError(f"{what}: the page tensor must be contiguous (call .contiguous())")
    if t.dtype == torch.uint8 and t.dim() == 2 and t.shape[1] == pb:
        return t.numpy()
    want = getattr(torch, layout.dtype.torch_name)
    if t.dtype != want:
        raise InputError(f"{what}: expected dtype {want} (layout {layout.dtype.value}) "
                         f"or uint8 [n, {pb}], got {t.dtype}")
    if t.dim() != 1 + len(layout.page_shape) or tuple(t.shape[1:]) != layout.page_shape:
        raise InputError(f"{what}: expected shape [n, {', '.join(map(str, layout.page_shape))}], "
                         f"got {list(t.shape)}")
    return t.view(torch.uint8).reshape(t.shape[0], pb).numpy()
