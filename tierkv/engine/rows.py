"""Row copies between 2-D byte tensors (tier slots, page buffers), and the shared argument checks.

``copy_rows(src, src_rows, dst, dst_rows, width)`` copies the first ``width`` bytes of
row ``src_rows[i]`` to row ``dst_rows[i]``, between any two of: CUDA device memory
(the HBM tier's pool), pinned host memory (the DRAM tier's buffer), plain CPU memory.
It is what the HBM tier's reads and writes and the DRAM <-> HBM copy-table entries
run. Paths (:class:`CopyPath`): ``KERNEL`` is one launch of the chunk-copy kernel over
every row (pinned host rows are read or written in place); ``TORCH`` is index ops on
the device plus one DMA copy per run of consecutive host rows. Stream-ordered on the
current CUDA stream (complete on return on CPU). Called by :mod:`tierkv.tiers.hbm`
and :mod:`tierkv.engine.kv`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np
import torch

from tierkv.engine import cuda
from tierkv.errors import InputError

# Row or block indices as callers hold them; a CUDA tensor is read back to the host first.
Indices = Sequence[int] | np.ndarray | torch.Tensor


class CopyPath(enum.Enum):
    """How copies run: ``TORCH`` index ops and DMA copies, or the one-launch ``KERNEL``."""

    TORCH = "torch"
    KERNEL = "kernel"


def parse_path(path: CopyPath | str | None, device: torch.device) -> CopyPath:
    """``path`` as a :class:`CopyPath` (its value spelled out is fine); None: :func:`default_path`."""
    if path is None:
        return default_path(device)
    if isinstance(path, CopyPath):
        return path
    try:
        return CopyPath(str(path).lower())
    except ValueError:
        raise InputError(f"copy path must be one of {', '.join(p.value for p in CopyPath)}, got {path!r}") from None


def default_path(device: torch.device) -> CopyPath:
    """``KERNEL`` on CUDA where CuPy can build it, else ``TORCH``."""
    return CopyPath.KERNEL if device.type == "cuda" and cuda.kernel_available() else CopyPath.TORCH


def as_indices(values: Indices, what: str) -> np.ndarray:
    """``values`` as a 1-D int64 numpy array; InputError for anything but integers."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InputError(f"{what} must be a 1-D sequence of integers, got {arr.dtype} of shape {list(arr.shape)}")
    return arr.astype(np.int64, copy=False)


def check_rows_tensor(t: torch.Tensor, width: int, what: str) -> None:
    """``t`` must be a ``uint8 [rows, >= width]`` tensor whose rows are contiguous and disjoint."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{what} must be a torch tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] < width:
        raise InputError(f"{what} must be uint8 [rows, >= {width}], got {t.dtype} {list(t.shape)}")
    if t.shape[0] and (t.shape[1] > 1 and t.stride(1) != 1 or t.shape[0] > 1 and t.stride(0) < t.shape[1]):
        raise InputError(f"{what} rows must be contiguous and disjoint, got strides {list(t.stride())}")


def check_rows(rows: np.ndarray, limit: int, what: str, unique: bool) -> None:
    """Every row index inside ``[0, limit)``; no repeats when ``unique`` (a destination)."""
    if len(rows) and (rows.min() < 0 or rows.max() >= limit):
        bad = int(rows[(rows < 0) | (rows >= limit)][0])
        raise InputError(f"{what} {bad} out of range [0, {limit})")
    if unique and len(np.unique(rows)) != len(rows):
        raise InputError(f"{what}s name the same destination twice")


def runs(dst_rows: np.ndarray, src_rows: np.ndarray) -> list[tuple[int, int, int]]:
    """Split paired row lists into runs consecutive on both sides: (dst row, src row, length)."""
    if not len(dst_rows):
        return []
    breaks = np.flatnonzero((np.diff(dst_rows) != 1) | (np.diff(src_rows) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(dst_rows)]))
    return [(int(dst_rows[a]), int(src_rows[a]), int(b - a)) for a, b in zip(starts, ends)]


def copy_runs(dst: torch.Tensor, dst_rows: np.ndarray, src: torch.Tensor, src_rows: np.ndarray, width: int) -> None:
    """One ``copy_`` (a DMA copy between host and device) per run of consecutive rows."""
    for d, s, m in runs(dst_rows, src_rows):
        dst[d:d + m, :width].copy_(src[s:s + m, :width], non_blocking=True)


def copy_rows(src: torch.Tensor, src_rows: np.ndarray, dst: torch.Tensor, dst_rows: np.ndarray, width: int,
              path: CopyPath, max_ctas: int | None = None) -> None:
    """Copy ``width`` bytes of each ``src`` row to its ``dst`` row (arguments already checked)."""
    n = len(src_rows)
    if n == 0:
        return
    device = src.device if src.device.type == "cuda" else dst.device
    if path is CopyPath.KERNEL and (device.type == "cpu" or _reachable(src) and _reachable(dst)):
        def address(t: torch.Tensor) -> int:
            return cuda.device_address(t) if device.type == "cuda" else t.data_ptr()
        desc = np.stack([address(src) + src_rows * src.stride(0), address(dst) + dst_rows * dst.stride(0)], axis=1)
        cuda.copy_batch(desc, width, device, max_ctas)
        return
    if src.device == dst.device:
        if len(runs(dst_rows, src_rows)) <= 2:  # slices: no index tensors, no temporary
            copy_runs(dst, dst_rows, src, src_rows, width)
            return
        src_idx = torch.from_numpy(src_rows).to(src.device, non_blocking=True)
        dst_idx = torch.from_numpy(dst_rows).to(dst.device, non_blocking=True)
        dst[:, :width].index_copy_(0, dst_idx, src[:, :width].index_select(0, src_idx))
        return
    local = np.arange(n, dtype=np.int64)
    if src.device.type == "cuda":  # device rows -> host rows: gather on the device, then DMA per host run
        stage = src[:, :width].index_select(0, torch.from_numpy(src_rows).to(device, non_blocking=True))
        copy_runs(dst, dst_rows, stage, local, width)
    else:  # host rows -> device rows: DMA per host run into a device buffer, then scatter on the device
        stage = torch.empty((n, width), dtype=torch.uint8, device=device)
        copy_runs(stage, local, src, src_rows, width)
        dst[:, :width].index_copy_(0, torch.from_numpy(dst_rows).to(device, non_blocking=True), stage)


def _reachable(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or t.is_pinned()
