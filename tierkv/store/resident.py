"""Giving memory this process no longer needs back to the system (Linux and glibc; a
no-op elsewhere): a file mapping's pages (:func:`dont_need`, found with
:func:`mapped_at`) and the C heap's free pages (:func:`trim_heap`).

Used by :mod:`tierkv.store.index` (LMDB leaves every page a commit wrote mapped in the
writer), :mod:`tierkv.store.index_runs` (a reader's replay) and
:mod:`tierkv.store.opening` (a big adoption).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from pathlib import Path

_MADV_DONTNEED = 4
_madvise: Callable[[int, int, int], int] | None
try:
    _libc_madvise = ctypes.CDLL(None, use_errno=True).madvise
    _libc_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise = _libc_madvise
except (OSError, AttributeError):   # not Linux: nothing is released
    _madvise = None


def dont_need(addr: int, length: int) -> None:
    """``madvise(MADV_DONTNEED)`` over a shared file mapping: its pages leave this
    process's resident set and stay in the page cache (what is read next faults back)."""
    if _madvise is not None:
        _madvise(addr, length, _MADV_DONTNEED)


def mapped_at(path: Path) -> int | None:
    """Where this process maps ``path`` (its first mapping), from /proc/self/maps; None if
    it does not, or there is no such file."""
    want = str(path)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if line.rstrip("\n").endswith(want) and line.rstrip("\n")[-len(want) - 1] in " \t":
                    return int(line.split("-", 1)[0], 16)
    except (OSError, ValueError, IndexError):
        return None
    return None


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc only; elsewhere a no-op).

    Reading a big index allocates and frees buffers of every record's bytes (runs of
    about 16 KB: below malloc's mmap threshold); glibc keeps the freed heap resident
    (about 150 bytes per page measured at 65,536 pages) unless asked to trim it.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
