"""Page checksums: xxh3-64 over a page's stored bytes, computed with the GIL released.

Computed when a page crosses into a persistent tier and checked on every read from
one. Called by :mod:`tierkv.store.transfer`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

try:
    from tierkv._native import checksum64 as _native_checksum  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - where the extension is not built
    _native_checksum = None
try:
    from tierkv._native import copy_checksums as _native_copy  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - where the extension is not built (or is older)
    _native_copy = None


def checksum64(row: np.ndarray) -> int:
    """xxh3-64 of a contiguous byte row (same value as ``xxhash.xxh3_64_intdigest``)."""
    if _native_checksum is not None:
        return int(_native_checksum(row))
    return xxhash.xxh3_64_intdigest(row.data)


def checksum_rows(rows: np.ndarray) -> list[int]:
    """Checksums of each row of a 2-D uint8 array."""
    return [checksum64(rows[i]) for i in range(rows.shape[0])]


def copy_checksummed(dst: np.ndarray, src: np.ndarray) -> list[int]:
    """``dst[...] = src`` for two 2-D uint8 arrays of one shape (not overlapping), and the
    checksums of the rows copied: in one pass over the memory where the extension is
    built (each 16 KiB of a row hashed while in cache, the copy's stores bypassing it;
    1.3-1.4x the copy followed by the hash, on 1 MiB chunks here: docs/benchmarks.md
    "One pass for the copy and its checksums"), else the copy, then the hash."""
    if dst.ndim != 2 or dst.shape != src.shape:
        raise ValueError(f"copy_checksummed needs two 2-D arrays of one shape, got {dst.shape} and {src.shape}")
    if (_native_copy is not None and dst.dtype == np.uint8 and src.dtype == np.uint8
            and (dst.shape[1] < 2 or (dst.strides[1] == 1 and src.strides[1] == 1))
            and not np.may_share_memory(dst, src)):
        return list(_native_copy(dst, src))
    dst[...] = src   # rows that are not contiguous, or that overlap: numpy's copy, then the hash
    return checksum_rows(dst)


def copy_checksummed_rows(dst: np.ndarray, rows: Sequence[np.ndarray]) -> list[int]:
    """:func:`copy_checksummed` from separate rows (a put's pages as they were given): row
    ``i`` into ``dst[i]``, each the width of ``dst``."""
    if dst.ndim != 2 or len(rows) != dst.shape[0] or any(r.shape != (dst.shape[1],) for r in rows):
        raise ValueError(f"copy_checksummed_rows needs {dst.shape[0] if dst.ndim == 2 else '?'} rows of "
                         f"{dst.shape[1:]} bytes for a 2-D destination of shape {dst.shape}")
    if _native_copy is not None and dst.dtype == np.uint8 and (dst.shape[1] < 2 or dst.strides[1] == 1):
        try:
            return list(_native_copy(dst, list(rows)))
        except (BufferError, ValueError):   # a row not contiguous, or in dst (shapes are checked above)
            pass
    for i, row in enumerate(rows):
        dst[i] = row
    return checksum_rows(dst)
