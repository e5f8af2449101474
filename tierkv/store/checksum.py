"""Page checksums: xxh3-64 over a page's stored bytes, computed with the GIL released.

Computed when a page crosses into a persistent tier and checked on every read from
one. Called by :mod:`tierkv.store.transfer`.
"""

from __future__ import annotations

import numpy as np
import xxhash

try:
    from tierkv._native import checksum64 as _native_checksum  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - where the extension is not built
    _native_checksum = None


def checksum64(row: np.ndarray) -> int:
    """xxh3-64 of a contiguous byte row (same value as ``xxhash.xxh3_64_intdigest``)."""
    if _native_checksum is not None:
        return int(_native_checksum(row))
    return xxhash.xxh3_64_intdigest(row.data)


def checksum_rows(rows: np.ndarray) -> list[int]:
    """Checksums of each row of a 2-D uint8 array."""
    return [checksum64(rows[i]) for i in range(rows.shape[0])]
