"""Page-aligned host memory for O_DIRECT I/O, and a pool of reusable bounce buffers.

O_DIRECT transfers need the buffer address, the length and the file offset to be
multiples of the device's logical block size; :data:`ALIGN` (4096) covers every
block size in use. Used by :mod:`tierkv.tiers.nvme` (and any tier that does
O_DIRECT I/O on a file or block device).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from tierkv.errors import InputError

ALIGN = 4096
#: The most 4 KiB blocks a page of a block-addressed (coded) tier may span: its index record
#: counts the page's block runs in 16 bits, and a page can take one run per block.
MAX_PAGE_BLOCKS = 0xFFFF


def round_up(nbytes: int, align: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-nbytes // align) * align


def is_aligned(buf: np.ndarray, align: int = ALIGN) -> bool:
    """Whether ``buf`` starts on an ``align``-byte boundary."""
    return int(buf.ctypes.data) % align == 0


def aligned_empty(nbytes: int) -> np.ndarray:
    """A 1-D ``uint8`` array of ``nbytes`` zero bytes starting on a page boundary.

    Backed by an anonymous mmap, so it is page-aligned (which numpy's allocator is
    not: large numpy arrays start 16 bytes past a page) and its pages are faulted
    in on first touch. The mmap lives as long as the array does.
    """
    if nbytes <= 0:
        raise InputError(f"aligned buffer needs a positive size, got {nbytes} bytes")
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


class BouncePool:
    """Reusable aligned buffers of ``buffer_bytes`` each, for unaligned callers.

    ``borrow`` hands out an idle buffer or allocates a new one, so it never blocks;
    at most ``keep`` idle buffers are retained (one per I/O thread keeps a steady
    state free of allocations and page faults). Thread-safe.
    """

    def __init__(self, buffer_bytes: int, keep: int) -> None:
        self.buffer_bytes = buffer_bytes
        self._keep = keep
        self._idle: list[np.ndarray] = []
        self._lock = threading.Lock()

    @contextmanager
    def borrow(self) -> Iterator[np.ndarray]:
        """A buffer for the duration of the ``with`` block; contents are stale."""
        with self._lock:
            buf = self._idle.pop() if self._idle else None
        if buf is None:
            buf = aligned_empty(self.buffer_bytes)
        try:
            yield buf
        finally:
            with self._lock:
                if len(self._idle) < self._keep:
                    self._idle.append(buf)

    def clear(self) -> None:
        """Drop the idle buffers (their memory goes back when the last view dies)."""
        with self._lock:
            self._idle.clear()
