"""Page-aligned host memory for O_DIRECT I/O, and a pool of reusable bounce buffers.

O_DIRECT transfers need the buffer address, the length and the file offset to be
multiples of the device's logical block size; :data:`ALIGN` (4096) covers every
block size in use. Used by :mod:`tierkv.tiers.nvme` (and any tier that does
O_DIRECT I/O on a file or block device).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from tierkv.errors import InputError
from tierkv.tiers.hugepages import HUGE_PAGE, advise_huge, advise_no_huge, private_huge_mode

log = logging.getLogger(__name__)

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


#: statx(2): the mask bit asking for O_DIRECT's alignments (Linux 6.1+), the flag that
#: names the file by its descriptor, and where struct statx keeps the two (its layout is
#: part of the kernel's ABI: 256 bytes, ``stx_dio_mem_align`` at byte 152).
STATX_DIOALIGN = 0x2000
AT_EMPTY_PATH = 0x1000
_STATX_BYTES = 256
_STX_DIO_MEM_ALIGN = 152
_STX_DIO_OFFSET_ALIGN = 156


def dio_alignments(fd: int) -> tuple[int, int] | None:
    """The memory and the offset (and length) alignment O_DIRECT transfers on ``fd`` need,
    as the kernel reports them (``STATX_DIOALIGN``: 512 and 512 on this project's virtio
    disk; the memory's often 4 on NVMe drives); None where it does not say (a kernel before
    6.1, a filesystem without direct I/O, no ``statx`` in the C library), and the caller
    keeps to :data:`ALIGN`."""
    try:
        statx = ctypes.CDLL(None, use_errno=True).statx
    except (AttributeError, OSError):
        return None
    statx.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p)
    buf = ctypes.create_string_buffer(_STATX_BYTES)
    if statx(fd, b"", AT_EMPTY_PATH, STATX_DIOALIGN, buf) != 0:
        return None
    mask = int.from_bytes(buf.raw[0:4], "little")
    mem = int.from_bytes(buf.raw[_STX_DIO_MEM_ALIGN:_STX_DIO_MEM_ALIGN + 4], "little")
    offset = int.from_bytes(buf.raw[_STX_DIO_OFFSET_ALIGN:_STX_DIO_OFFSET_ALIGN + 4], "little")
    if not mask & STATX_DIOALIGN or mem == 0 or offset == 0:   # 0: the file does not support direct I/O
        return None
    return mem, offset


def aligned_empty(nbytes: int, *, huge: bool = False) -> np.ndarray:
    """A 1-D ``uint8`` array of ``nbytes`` zero bytes starting on a page boundary.

    Backed by a private anonymous mmap, so it is page-aligned (which numpy's
    allocator is not: large numpy arrays start 16 bytes past a page) and its pages are
    faulted in on first touch. (``mmap.mmap(-1, n)`` alone maps shared memory: every first
    touch of a 4 KiB page went through shmem, 1.4x the cost of a private one's.) The mmap
    lives as long as the array does.

    ``huge``: for a buffer that direct I/O moves again and again (a tier's bounce and
    staging buffers, the store's read buffer). It starts on a 2 MiB boundary and asks for
    transparent huge pages on its whole 2 MiB pages; the tail past the last one keeps 4 KiB
    pages, so no memory is taken past ``nbytes`` (the mapping reserves up to 2 MiB more
    address space, never touched and never huge), and a buffer under 2 MiB gets none
    (:class:`ScratchPool` cuts small ones out of a shared 2 MiB one). A direct read or
    write is cut into requests of at most the device's ``max_segments`` physically
    contiguous pieces: 4 KiB pages scattered in memory made a 2 MiB read several requests
    on this project's virtio disk, and O_DIRECT reads of 128 MiB into plain buffers ran
    3.1-6.7 GB/s from one process to the next (as their pages happened to lie) where a
    huge-page buffer read 6.7-7.1 every time (docs/benchmarks.md, "Huge-page I/O
    buffers"). Where the kernel gives no huge pages (``transparent_hugepage/enabled``
    ``never``) it is an ordinary aligned buffer. Per-call buffers stay without it: with
    ``defrag`` at its default a huge page's first touch may wait for compaction.
    """
    if nbytes <= 0:
        raise InputError(f"aligned buffer needs a positive size, got {nbytes} bytes")
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if not huge or nbytes < HUGE_PAGE:
        return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=np.uint8)
    m = mmap.mmap(-1, nbytes + HUGE_PAGE - mmap.PAGESIZE, flags=flags)
    whole = np.frombuffer(m, dtype=np.uint8)
    start = -int(whole.ctypes.data) % HUGE_PAGE
    huge_end = start + nbytes // HUGE_PAGE * HUGE_PAGE
    advise_huge(m, start, nbytes)
    # The slack around it and the tail past its last whole 2 MiB page: never huge (where the
    # kernel's mode is "always" they could merge into a huge page reaching past nbytes).
    advise_no_huge(m, 0, start)
    advise_no_huge(m, huge_end, len(m) - huge_end)
    if _thp_given():
        base = int(whole.ctypes.data)
        ref = weakref.ref(m)
        with _huge_lock:
            _huge[base + start] = (base + huge_end, ref)
        weakref.finalize(m, _forget_huge, base + start, ref)
    return whole[start:start + nbytes]


# The huge-page parts of aligned_empty's live huge buffers: start address -> (end address,
# a weak reference to the mapping). The mapping's own reference says whether the entry is
# still its: a mapping is unmapped before its finalizer runs (with the GIL released), so
# another thread's new buffer may have taken the address, and its entry, meanwhile.
_huge: dict[int, tuple[int, weakref.ref[mmap.mmap]]] = {}
_huge_lock = threading.Lock()


def _forget_huge(start: int, ref: weakref.ref[mmap.mmap]) -> None:
    with _huge_lock:
        entry = _huge.get(start)
        if entry is not None and entry[1] is ref:   # not a newer buffer's at the same address
            del _huge[start]


@functools.cache
def _thp_given() -> bool:
    """Whether the kernel gives private memory that asks for them huge pages (read once)."""
    return private_huge_mode() in ("always", "madvise")


def on_huge_pages(buf: np.ndarray) -> bool:
    """Whether every byte of ``buf`` (any strides) lies in the huge pages of a buffer of
    :func:`aligned_empty` (``huge=True``) that is still alive, as far as the kernel gave
    them: memory this process got elsewhere is not known to be (False), whatever it is.
    A direct transfer moves such memory in 2 MiB pieces (docs/design.md, "NVMe I/O")."""
    if buf.size == 0:
        return True
    lo = int(buf.ctypes.data) + sum(min(0, (n - 1) * st) for n, st in zip(buf.shape, buf.strides))
    hi = int(buf.ctypes.data) + sum(max(0, (n - 1) * st) for n, st in zip(buf.shape, buf.strides)) + buf.itemsize
    with _huge_lock:   # a dead mapping's entry (its finalizer not run yet) counts for nothing
        return any(start <= lo and hi <= end and ref() is not None for start, (end, ref) in _huge.items())


class ScratchPool:
    """Reusable aligned buffers of ``max_bytes`` each, for a hot path that needs a few
    buffers of varying size at a time (a coded tier's staging, packing and reading):
    once warm it faults nothing in. ``take`` hands out an idle buffer or allocates one
    (never blocks), or a fresh buffer of its own size where more than ``max_bytes`` is
    asked for; ``give`` returns one, kept while fewer than ``keep`` are idle.
    Contents are stale. Thread-safe.

    ``huge``: the buffers are :func:`aligned_empty`'s huge-page ones; buffers of under
    2 MiB are cut at 4 KiB boundaries out of one such 2 MiB buffer, as many as fit but no
    more than ``keep + 1`` (the ones past the first join the idle ones, up to ``keep``).
    An oversized buffer (used once) gets no huge pages.
    """

    def __init__(self, max_bytes: int, keep: int, *, huge: bool = False) -> None:
        if max_bytes <= 0 or keep < 0:
            raise InputError(f"a scratch pool needs buffers of a positive size and keep >= 0, got {max_bytes} "
                             f"bytes, keep {keep}")
        self.max_bytes = max_bytes
        self.huge = huge
        self._keep = keep
        self._idle: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A whole buffer of at least ``nbytes`` bytes (slice it; give back what was taken)."""
        if nbytes > self.max_bytes:
            return aligned_empty(nbytes)   # used once: no huge pages (their first touch may wait)
        with self._lock:
            if self._idle:
                return self._idle.pop()
        if not self.huge or self.max_bytes >= HUGE_PAGE:
            return aligned_empty(self.max_bytes, huge=self.huge)
        stride = round_up(self.max_bytes)
        fit = (HUGE_PAGE - self.max_bytes) // stride + 1
        shared = aligned_empty(HUGE_PAGE, huge=True)
        bufs = [shared[k * stride:k * stride + self.max_bytes] for k in range(min(fit, self._keep + 1))]
        with self._lock:
            self._idle += bufs[1:1 + max(0, self._keep - len(self._idle))]
        return bufs[0]

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer ``take`` handed out; nothing may use it afterwards."""
        if buf.size != self.max_bytes:
            return   # an oversized one: dropped
        with self._lock:
            if len(self._idle) < self._keep:
                self._idle.append(buf)

    def clear(self) -> None:
        """Drop the idle buffers (their memory goes back when the last view dies)."""
        with self._lock:
            self._idle.clear()


class BouncePool(ScratchPool):
    """Reusable aligned buffers of ``max_bytes`` each, for unaligned callers.

    ``borrow`` hands out an idle buffer or allocates a new one, so it never blocks;
    at most ``keep`` idle buffers are retained (one per I/O thread keeps a steady
    state free of allocations and page faults). Thread-safe.
    """

    @contextmanager
    def borrow(self) -> Iterator[np.ndarray]:
        """A buffer for the duration of the ``with`` block; contents are stale."""
        buf = self.take(self.max_bytes)
        try:
            yield buf
        finally:
            self.give(buf)


#: madvise advice (Linux 5.14+): fault a range in as if written, without writing it.
MADV_POPULATE_WRITE = 23
#: Buffers up to this size are faulted in before :func:`prefault` returns; larger ones on a
#: background thread, a chunk at a time (a node's 1 TiB tier takes minutes to fault in).
PREFAULT_SYNC_BYTES = 256 << 20
PREFAULT_CHUNK = 64 << 20
#: A buffer larger than this share of MemAvailable is not prefaulted.
PREFAULT_MAX_SHARE = 0.8


def memory_available() -> int | None:
    """The memory this process may still fault in, in bytes: MemAvailable from
    /proc/meminfo, or less where its cgroup's limit leaves less (a container sees the
    host's MemAvailable); None where neither can be read."""
    host: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        host = None
    room = _cgroup_headroom()
    if host is None or room is None:
        return room if host is None else host
    return min(host, room)


PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"


def _cgroup_headroom() -> int | None:
    """The cgroup memory limit less the usage (cgroup v2 ``memory.max``/``memory.current``,
    or v1 ``memory.limit_in_bytes``/``memory.usage_in_bytes``); None without a limit."""
    try:
        with open(PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":
            files = (f"{CGROUP_ROOT}{path}/memory.max", f"{CGROUP_ROOT}{path}/memory.current")
        elif "memory" in controllers.split(","):
            files = (f"{CGROUP_ROOT}/memory{path}/memory.limit_in_bytes",
                     f"{CGROUP_ROOT}/memory{path}/memory.usage_in_bytes")
        else:
            continue
        try:
            with open(files[0]) as f:
                limit = f.read().strip()
            with open(files[1]) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 62:
            continue
        return max(0, int(limit) - used)
    return None


class Prefault:
    """Faults the memory of an anonymous buffer in with ``MADV_POPULATE_WRITE``: at once up
    to :data:`PREFAULT_SYNC_BYTES`, beyond that on a daemon thread that :meth:`stop` ends
    after its current chunk. Safe beside writes to the buffer (the advice never writes);
    where the kernel lacks the advice nothing happens, and pages fault in on first touch.
    """

    def __init__(self, buf: np.ndarray, name: str) -> None:
        self._buf: np.ndarray | None = buf     # keeps the mapping alive while a chunk is faulted in
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread: threading.Thread | None = None
        available = memory_available()
        if available is not None and buf.nbytes > available * PREFAULT_MAX_SHARE:
            # Faulting in more than the machine has free would call the OOM killer, not the
            # pages: such a buffer is only usable lazily, so it stays lazy.
            log.warning("the %s buffer (%d bytes) is larger than %.0f%% of the memory available (%d bytes); not "
                        "prefaulted: its pages fault in as they are first written", name, buf.nbytes,
                        PREFAULT_MAX_SHARE * 100, available)
            self._buf = None
            self.done.set()
            return
        if buf.nbytes <= PREFAULT_SYNC_BYTES:
            self._run()
        else:
            self._thread = threading.Thread(target=self._run, name=f"tierkv-prefault-{name}", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        buf = self._buf
        assert buf is not None
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise  # a foreign call: releases the GIL
            madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            addr, size = int(buf.ctypes.data), buf.nbytes
            for off in range(0, size, PREFAULT_CHUNK):
                if self._stop.is_set():
                    return
                if madvise(addr + off, min(PREFAULT_CHUNK, size - off), MADV_POPULATE_WRITE) != 0:
                    err = ctypes.get_errno()
                    if err != errno.EINVAL:  # EINVAL: a kernel before 5.14; first touch faults instead
                        log.warning("prefaulting a %d-byte buffer stopped at byte %d: %s; the rest faults in on "
                                    "first touch", size, off, os.strerror(err))
                    return
        finally:
            self._buf = None
            self.done.set()

    def stop(self) -> None:
        """End the background thread after its current chunk, and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
