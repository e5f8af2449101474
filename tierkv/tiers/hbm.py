"""The HBM tier: a pool of page slots in one device tensor, and its DRAM <-> HBM copies.

The pool is one ``uint8 [num_slots, slot_bytes]`` torch tensor allocated at open on
``device`` (a CUDA device; ``"cpu"`` gives the same tier over host memory, which is how
CI puts it through the conformance suite). ``read``/``write`` take numpy host buffers
like every tier (pageable rows are staged through pinned memory); ``read_into`` /
``write_from`` take torch tensors (device, pinned host, or CPU) and return futures that
a CUDA event completes, for engines. Every copy runs on the tier's own CUDA stream.

:func:`hbm_to_dram` and :func:`dram_to_hbm` are the copy-table entries (see
:mod:`tierkv.store.transfer`): one batched copy between the pinned DRAM buffer and the pool,
no staging. Volatile. Thread-safe as every tier (disjoint slots may be copied
concurrently). Called by the API's tier set-up and by engine connectors.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np
import torch

from tierkv.engine.rows import CopyPath, Indices, as_indices, check_rows, check_rows_tensor, copy_rows, parse_path
from tierkv.engine.streams import CopyStream
from tierkv.errors import CapacityError, ConfigError, InputError, TierIOError
from tierkv.tiers.base import Tier, TierKind
from tierkv.tiers.dram import DramTier


class HbmTier(Tier):
    """Slots in one device tensor of ``num_slots * slot_bytes`` bytes on ``device``."""

    kind = TierKind.HBM
    persistent = False

    def __init__(self, num_slots: int, slot_bytes: int, device: str | torch.device = "cuda",
                 path: CopyPath | str | None = None, *, name: str | None = None) -> None:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"an HBM tier on {dev} needs a CUDA device, and none is available here")
        if dev.type not in ("cuda", "cpu"):
            raise ConfigError(f"an HBM tier lives on a 'cuda' device (or 'cpu' for tests), got {dev}")
        super().__init__(num_slots, slot_bytes, name=name)
        try:
            self._buf = torch.zeros((num_slots, slot_bytes), dtype=torch.uint8, device=dev)
        except RuntimeError as exc:  # torch.OutOfMemoryError on CUDA, RuntimeError on CPU
            self._closed = True
            asked = f"asked for {num_slots * slot_bytes / 2**30:.1f} GiB of HBM tier on {dev}"
            if dev.type != "cuda":
                raise CapacityError(f"{asked}: {exc}") from None
            free, total = torch.cuda.mem_get_info(dev)
            raise CapacityError(f"{asked}, {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB free") from None
        self.device = self._buf.device
        self.path = parse_path(path, self.device)
        self._copies = CopyStream(self.device)

    @property
    def pool(self) -> torch.Tensor:
        """The slots as one ``uint8 [num_slots, slot_bytes]`` device tensor, for engine copies that
        target slots in place (``EngineKV.gather(out=tier.pool, rows=slots)``). The caller owns
        the slots it touches (allocated to it); reading freed slots gives stale bytes."""
        self._check_open()
        return self._buf

    # -- device-tensor I/O, for engines -----------------------------------------------------------
    def read_into(self, slots: Sequence[int], dst: torch.Tensor, rows: Indices | None = None) -> Future[None]:
        """Copy slot ``slots[i]`` into row ``rows[i]`` of ``dst`` on the tier's stream (default: one row per slot).

        ``dst`` is ``uint8 [n, width <= slot_bytes]``, rows contiguous, on the tier's device
        or the host (pinned for an asynchronous copy). Only the first ``dst.shape[1]``
        bytes of each slot are read.
        """
        slot_idx, row_idx = self._check_tensor_io(slots, dst, rows)
        width = dst.shape[1]
        return self._copies.submit(lambda: copy_rows(self._buf, slot_idx, dst, row_idx, width, self.path),
                                   keep=(dst,))

    def write_from(self, slots: Sequence[int], src: torch.Tensor, rows: Indices | None = None) -> Future[None]:
        """Copy row ``rows[i]`` of ``src`` (default: one row per slot) into slot ``slots[i]``; inverse of ``read_into``."""
        slot_idx, row_idx = self._check_tensor_io(slots, src, rows, slot_unique=True)
        width = src.shape[1]
        return self._copies.submit(lambda: copy_rows(src, row_idx, self._buf, slot_idx, width, self.path),
                                   keep=(src,))

    def _check_tensor_io(self, slots: Sequence[int], buf: torch.Tensor, rows: Indices | None,
                         slot_unique: bool = False) -> tuple[np.ndarray, np.ndarray]:
        self._check_open()
        check_rows_tensor(buf, 0, "HBM tier buffer")
        if buf.shape[1] > self.slot_bytes:
            raise InputError(f"rows of {buf.shape[1]} bytes exceed the slot size of {self.slot_bytes}")
        if buf.device.type not in ("cpu", self.device.type) or buf.device.type == "cuda" and buf.device != self.device:
            raise InputError(f"an HBM tier on {self.device} cannot copy to or from a tensor on {buf.device}")
        slot_idx = as_indices(list(slots), "slots")
        row_idx = np.arange(buf.shape[0], dtype=np.int64) if rows is None else as_indices(rows, "rows")
        if len(row_idx) != len(slot_idx):
            raise InputError(f"{len(slot_idx)} slots but {len(row_idx)} rows")
        check_rows(slot_idx, self.num_slots, "slot", slot_unique)
        check_rows(row_idx, buf.shape[0], "row", not slot_unique)
        return slot_idx, row_idx

    # -- numpy host I/O, like every tier ------------------------------------------------------------
    def _write(self, slots: Sequence[int], src: np.ndarray) -> None:
        if not len(slots):
            return
        host = self._host_view(src, fill=True)
        self.write_from(slots, host).result()

    def _read(self, slots: Sequence[int], dst: np.ndarray) -> None:
        if not len(slots):
            return
        host = self._host_view(dst, fill=False)
        self.read_into(slots, host).result()
        if host.data_ptr() != dst.ctypes.data:
            dst[...] = host.numpy()

    def _host_view(self, buf: np.ndarray, fill: bool) -> torch.Tensor:
        """``buf`` as a tensor the copy can use directly: itself on CPU or when pinned, else a pinned copy."""
        t = torch.from_numpy(buf)
        if self.device.type == "cpu" or t.is_pinned():
            return t
        staged = torch.empty(buf.shape, dtype=torch.uint8, pin_memory=True)
        if fill:
            staged.copy_(t)
        return staged

    def _close(self) -> None:
        self._copies.close()
        del self._buf


def dram_rows(dram: DramTier) -> torch.Tensor:
    """The DRAM tier's whole buffer as a ``uint8 [num_slots, slot_bytes]`` tensor (pinned when CUDA is present)."""
    return torch.from_numpy(dram.buffer)


def hbm_to_dram(src: Tier, src_slots: Sequence[int], dst: Tier, dst_slots: Sequence[int], nbytes: int) -> np.ndarray:
    """Copy-table entry: HBM slots to DRAM slots in one batched copy; returns the DRAM rows written."""
    if not isinstance(src, HbmTier) or not isinstance(dst, DramTier):
        return _staged(src, src_slots, dst, dst_slots, nbytes)
    host = dram_rows(dst)
    _result(src.read_into(src_slots, host[:, :nbytes], rows=dst_slots))
    return _rows_of(dst, dst_slots, nbytes)


def dram_to_hbm(src: Tier, src_slots: Sequence[int], dst: Tier, dst_slots: Sequence[int], nbytes: int) -> np.ndarray:
    """Copy-table entry: DRAM slots to HBM slots in one batched copy; returns the DRAM rows read."""
    if not isinstance(src, DramTier) or not isinstance(dst, HbmTier):
        return _staged(src, src_slots, dst, dst_slots, nbytes)
    host = dram_rows(src)
    _result(dst.write_from(dst_slots, host[:, :nbytes], rows=src_slots))
    return _rows_of(src, src_slots, nbytes)


def _result(f: Future[None]) -> None:
    try:
        f.result()
    except TierIOError:
        raise
    except RuntimeError as exc:
        raise TierIOError(f"DRAM <-> HBM copy failed: {exc}") from exc


def _rows_of(dram: DramTier, slots: Sequence[int], nbytes: int) -> np.ndarray:
    """The DRAM rows a copy touched: a view when the slots are consecutive, else a copy."""
    buf = dram.buffer
    first = slots[0] if len(slots) else 0
    if list(slots) == list(range(first, first + len(slots))):
        return buf[first:first + len(slots), :nbytes]
    return np.take(buf[:, :nbytes], list(slots), axis=0)


def _staged(src: Tier, src_slots: Sequence[int], dst: Tier, dst_slots: Sequence[int], nbytes: int) -> np.ndarray:
    staging = np.empty((len(src_slots), nbytes), dtype=np.uint8)
    src.read(src_slots, staging)
    dst.write(dst_slots, staging)
    return staging
