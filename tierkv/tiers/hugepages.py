"""Transparent huge pages for the shared memory the store maps (memfds): the DRAM tier's
pool and ``tierkv serve``'s page buffers; and the advice that also gives them to the private
I/O buffers of :func:`tierkv.tiers.aligned.aligned_empty` (``huge=True``). No numpy here:
``tierkv doctor`` reads the mode.

Linux gives shared memory huge pages only where ``shmem_enabled`` allows (most distributions
ship ``never``); with ``advise`` a mapping that asks for them (``MADV_HUGEPAGE``) gets them.
A memfd-to-memfd copy of 128 MiB ran 11.5 GB/s with 4 KiB pages and 17.2 GB/s with huge
pages on the development VM, and the first fill of a large fresh pool several times
slower (compaction on a fragmented host): a trade-off the host's owner decides
(docs/serve.md, "Huge pages").
"""

from __future__ import annotations

import mmap
import os

#: Under /sys: the kernel's switch for transparent huge pages in shared memory (memfds,
#: tmpfs), and (newer kernels) the one for 2 MiB pages alone (``inherit`` by default).
SHMEM_ENABLED = "kernel/mm/transparent_hugepage/shmem_enabled"
SHMEM_ENABLED_2M = "kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled"
#: The switch for transparent huge pages in private memory (aligned_empty's ``huge`` buffers),
#: and (newer kernels) the 2 MiB size's own, which decides unless it says ``inherit``.
THP_ENABLED = "kernel/mm/transparent_hugepage/enabled"
THP_ENABLED_2M = "kernel/mm/transparent_hugepage/hugepages-2048kB/enabled"
#: Where huge pages are given.
HUGE_MODES = ("advise", "within_size", "always", "force")
HUGE_PAGE = 2 << 20


def advise_huge(m: mmap.mmap, start: int = 0, length: int | None = None) -> None:
    """Ask for huge pages on the whole 2 MiB pages of a mapping (of ``length`` bytes from
    ``start``, a multiple of the 4 KiB page; by default all of it): a smaller range, or the
    tail past the last whole one, keeps 4 KiB pages (kernels before 6.11 would give a small
    memfd a whole 2 MiB page). A no-op where the kernel gives none."""
    whole = (len(m) - start if length is None else length) // HUGE_PAGE * HUGE_PAGE
    _madvise(m, "MADV_HUGEPAGE", start, whole)


def advise_no_huge(m: mmap.mmap, start: int, length: int) -> None:
    """Keep ``length`` bytes of a mapping from ``start`` (4 KiB multiples) on 4 KiB pages,
    whatever the kernel's mode. A no-op where the kernel has no huge pages."""
    _madvise(m, "MADV_NOHUGEPAGE", start, length)


def _madvise(m: mmap.mmap, name: str, start: int, length: int) -> None:
    advice = getattr(mmap, name, None)
    if advice is None or length <= 0:
        return
    try:
        m.madvise(advice, start, length)
    except OSError:   # a kernel without THP
        pass


def _mode(path: str) -> str | None:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def private_huge_state(sysfs: str = "/sys") -> tuple[str, str | None]:
    """``(transparent_hugepage/enabled's mode, the 2 MiB size's own)``: ``unknown`` where the
    first cannot be read, None where the kernel has no second."""
    return (_mode(os.path.join(sysfs, THP_ENABLED)) or "unknown",
            _mode(os.path.join(sysfs, THP_ENABLED_2M)))


def private_huge_mode(sysfs: str = "/sys") -> str:
    """The kernel's mode for 2 MiB transparent huge pages in private memory: ``always``,
    ``madvise`` (what :func:`advise_huge` asks for is given) or ``never``; the 2 MiB size's
    own setting where it has one other than ``inherit``, else the main switch's
    (``unknown`` where unreadable: a kernel without THP)."""
    main, own = private_huge_state(sysfs)
    return own if own is not None and own != "inherit" else main


def shmem_huge_state(sysfs: str = "/sys") -> tuple[str, str | None]:
    """``(shmem_enabled's mode, the 2 MiB size's own mode)``: ``unknown`` where the first
    cannot be read, None where the kernel has no second. ``sysfs``: another tree standing
    for /sys (tierkv doctor's)."""
    return (_mode(os.path.join(sysfs, SHMEM_ENABLED)) or "unknown",
            _mode(os.path.join(sysfs, SHMEM_ENABLED_2M)))


def shmem_huge_pages(sysfs: str = "/sys") -> str:
    """Whether a memfd gets 2 MiB pages, as a mode: ``shmem_enabled``'s (``never``,
    ``advise``, ``within_size``, ``always``, ...; ``unknown`` where unreadable), except
    ``never`` where that allows them but the 2 MiB size's own setting says ``never``.
    Both must allow them: measured on this VM's 6.18 kernel, an advised memfd got none
    with ``shmem_enabled`` never and the 2 MiB setting advise, nor the other way round."""
    main, own = shmem_huge_state(sysfs)
    return "never" if main in HUGE_MODES and own == "never" else main
