"""The host-DRAM tier: one preallocated buffer of page slots.

The buffer is allocated once at open (pinned through torch when CUDA is present, so
HBM copies can be asynchronous) and every transfer is a single gather or scatter
copy. Volatile: its contents do not survive a close.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import mmap
import os
import sys
import threading
from collections.abc import Sequence

import numpy as np

from tierkv.errors import CapacityError, InputError
from tierkv.store.pages import PageList
from tierkv.tiers import parallel_copy
from tierkv.tiers.aligned import Prefault
from tierkv.tiers.hugepages import HUGE_MODES, advise_huge, shmem_huge_pages
from tierkv.tiers.base import Tier, TierKind
from tierkv.units import format_size

try:  # streamed page copies; optional so that a machine without a compiler still works
    from tierkv.tiers import _copy  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised where the extension is absent
    _copy = None


def _nvidia_driver() -> bool:
    """Whether an NVIDIA driver is loaded (checked without importing torch)."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))


def _memory_and_swap() -> int:
    """Bytes of RAM plus swap on this machine."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("SwapTotal:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(total)


def _shared_buffer(nbytes: int) -> tuple[np.ndarray, int]:
    """A zeroed, page-aligned host buffer in a memfd (shared memory, as an anonymous mmap
    is anyway), and the memfd: a ``tierkv serve`` daemon lends its pages to clients that
    map it (:meth:`DramTier.lend_fd`). ENOMEM up front for more than the machine's memory
    and swap (as the kernel refuses such an anonymous mapping; a memfd would take it and
    fail page by page later)."""
    if nbytes > _memory_and_swap():
        raise OSError(errno.ENOMEM, f"more than this machine's memory and swap ({format_size(_memory_and_swap())})")
    fd = os.memfd_create("tierkv-dram", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    advise_huge(m)   # before the first touch: huge pages where the kernel allows them
    return np.frombuffer(m, dtype=np.uint8), fd


def _host_buffer(nbytes: int) -> tuple[np.ndarray, bool, int]:
    """A zeroed host buffer: page-locked when a CUDA device is present, else in a memfd
    (:func:`_shared_buffer`); whether it is page-locked (resident from the start), and the
    memfd (-1 for page-locked memory, which is not shared).

    torch is imported only where it can matter (already imported by the caller, or an
    NVIDIA driver present): it takes seconds to import, and minutes in emulated guests.
    """
    torch = sys.modules.get("torch")
    if torch is None and _nvidia_driver():
        try:
            import torch
        except ImportError:  # pragma: no cover - torch is a dependency
            torch = None
    if torch is not None and torch.cuda.is_available():
        return torch.zeros(nbytes, dtype=torch.uint8).pin_memory().numpy(), True, -1
    buf, fd = _shared_buffer(nbytes)   # 4 KiB-aligned rows go to O_DIRECT without a bounce
    return buf, False, fd


# Below this row size numpy's gather/scatter beats a Python loop of slice copies; above
# it the slice copies (memcpy per run) win by 2-3x, since np.take copies element-wise.
_SMALL_ROW = 16384
# Rows of at least _STREAM_WRITE bytes are written in with streaming stores
# (tierkv.tiers._copy): 1.5-1.7x memcpy's per-page speed from 16 KiB to 2 MiB on the
# project's VM, 1.75x at 4 KiB into slots not in the cache (docs/benchmarks.md). Rows of
# at least _STREAM_ROW are read out so too where the batch is larger than a core's cache
# would keep for its reader anyway. One consecutive run of _ONE_COPY bytes or more is
# left to memcpy, which streams so large a copy itself (as fast, or a little faster;
# measured to 128 MiB).
_STREAM_WRITE = 4096
_STREAM_ROW = 16384
_STREAM_READ = 4 << 20
_ONE_COPY = 64 << 20
class DramTier(Tier):
    """Slots in one host buffer of ``num_slots * slot_bytes`` bytes. ``prefault``: fault the
    buffer's memory in now (a large one on a background thread), not page by page as puts
    first touch it."""

    kind = TierKind.DRAM
    persistent = False

    def __init__(self, num_slots: int, slot_bytes: int, *, name: str | None = None, prefault: bool = False,
                 copy_threads: int | None = None) -> None:
        if copy_threads is not None and (isinstance(copy_threads, bool) or not isinstance(copy_threads, int)
                                         or copy_threads < 1):
            raise InputError(f"dram tier needs copy_threads >= 1 (or None: {parallel_copy.default_copy_threads()} here), "
                             f"got {copy_threads!r}")
        super().__init__(num_slots, slot_bytes, name=name)
        #: Threads a batch of 16 MiB or more is copied on (the caller's among them).
        self.copy_threads = copy_threads if copy_threads is not None else parallel_copy.default_copy_threads()
        self._prefault: Prefault | None = None
        self._copy_lock = threading.Lock()
        self._copies: dict[int, np.ndarray] = {}   # running copies: token -> the slots they use
        self._busy = np.zeros(num_slots, np.int32)   # slot -> running copies that use it
        self._nbusy = 0                              # running copies
        self._held: set[int] = set()                 # freed while busy: reusable once not
        # Copy (and lend) tokens start at random: a borrower holding a token of a former
        # tier (a restarted daemon's) never names one of this tier's lends by chance.
        self._next_copy = int.from_bytes(os.urandom(8), "little") >> 2
        self._fd = -1
        #: This buffer's identity, for a borrower that must not read a former one's rows.
        self.lend_id = int.from_bytes(os.urandom(8), "little") >> 1
        try:
            buf, pinned, self._fd = _host_buffer(num_slots * slot_bytes)
            self._buf = buf.reshape(num_slots, slot_bytes)
        except (MemoryError, OSError, RuntimeError) as exc:  # mmap ENOMEM; torch's pinning fails as RuntimeError
            self._closed = True
            raise CapacityError(f"dram tier: cannot allocate {format_size(num_slots * slot_bytes)} "
                                f"({num_slots} slots of {slot_bytes} bytes): {exc}; lower [tiers.dram] "
                                "capacity_bytes") from None
        #: False for a memfd the kernel gives no huge pages (``shmem_enabled``): NVMe tiers
        #: then move its rows through their own huge-page buffers (PageList.scattered), a
        #: direct write from scattered 4 KiB pages being slower. True where it gets them, and
        #: for page-locked memory (a CUDA host's), whose layout is the driver's: in place.
        self.huge_pages = pinned or shmem_huge_pages() in HUGE_MODES
        if prefault and not pinned:
            self._prefault = Prefault(buf, self.name)

    # -- copies outside the store's lock ------------------------------------------------
    # The store copies large batches into and out of this tier without holding its lock
    # (tierkv.store.api), so that threads and processes served by one store copy at once.
    # A slot such a copy uses may be freed meanwhile (its page evicted, dropped or
    # forgotten): it is held back from reuse until every copy using it has ended, so a
    # copy always sees the bytes of the page it was planned for and never lands on
    # another page's.
    def begin_copy(self, slots: Sequence[int]) -> int:
        """Register a copy of ``slots`` about to run without the store's lock (call it with
        the lock still held); returns its token for :meth:`end_copy`."""
        used = np.asarray(slots, np.int64)
        if len(used) and (used.min() < 0 or used.max() >= self.num_slots):
            self._check_slots(used.tolist())   # names the slot out of range
        with self._copy_lock:
            token = self._next_copy
            self._next_copy += 1
            self._copies[token] = used
            _count(self._busy, used, 1)
            self._nbusy += 1
            return token

    def lent(self, token: int) -> bool:
        """Whether the copy ``token`` is still running (a lend not ended)."""
        with self._copy_lock:
            return token in self._copies

    def end_copy(self, token: int) -> None:
        """The copy ``token`` is done: its slots that were freed meanwhile become free."""
        with self._copy_lock:
            used = self._copies.pop(token)
            _count(self._busy, used, -1)
            self._nbusy -= 1
            release: list[int] = []
            if self._held:
                for slot in np.unique(used[self._busy[used] <= 0]).tolist():
                    if slot in self._held:
                        self._held.discard(slot)
                        release.append(slot)
        if release and not self._closed:
            super().free(release)

    def free(self, slots: Sequence[int]) -> None:
        with self._copy_lock:
            if self._nbusy:
                self._check_slots(slots)
                taken = self._busy[np.asarray(slots, np.int64)] > 0
                if taken.any():
                    self._held.update(s for s, t in zip(slots, taken.tolist()) if t)
                    slots = [s for s, t in zip(slots, taken.tolist()) if not t]
        if slots:
            super().free(slots)

    @property
    def held_back(self) -> int:
        """Slots freed but not reusable yet: copies still running use them."""
        with self._copy_lock:
            return len(self._held)

    @property
    def buffer(self) -> np.ndarray:
        """The whole slot buffer, ``[num_slots, slot_bytes]`` (pinned when CUDA is present), for
        copy-table entries that move pages to or from this tier without staging."""
        self._check_open()
        return self._buf

    def view(self, slot: int) -> np.ndarray:
        """A zero-copy view of one slot (for transfers that read in place)."""
        return self._buf[slot]

    def _write(self, slots: Sequence[int], src: np.ndarray) -> None:
        parallel_copy.in_chunks(len(slots), src.shape[1], lambda a, b: self._write_serial(slots[a:b], src[a:b]),
                                self.copy_threads, slots)

    def _write_rows(self, slots: Sequence[int], rows: PageList) -> None:
        parallel_copy.in_chunks(len(slots), rows.shape[1],
                                lambda a, b: self._write_rows_serial(slots[a:b], rows[a:b]), self.copy_threads, slots)

    def _read(self, slots: Sequence[int], dst: np.ndarray) -> None:
        parallel_copy.in_chunks(len(slots), dst.shape[1], lambda a, b: self._read_serial(slots[a:b], dst[a:b]),
                                self.copy_threads)

    def _write_serial(self, slots: Sequence[int], src: np.ndarray) -> None:
        width = src.shape[1]
        if (width >= _STREAM_WRITE and src.flags.c_contiguous and not self._one_copy(slots, width)
                and self._stream(slots, src, width)):
            return
        runs = _runs(slots)
        if len(runs) > 4 and width == self.slot_bytes and width < _SMALL_ROW:
            self._buf[np.asarray(slots)] = src  # small rows: one scatter loop in C beats slice copies
            return
        for run_start, run_slot, run_len in runs:
            self._buf[run_slot:run_slot + run_len, :width] = src[run_start:run_start + run_len]

    def _write_rows_serial(self, slots: Sequence[int], rows: PageList) -> None:
        width = rows.shape[1]
        if width >= _STREAM_WRITE and self._stream(slots, list(rows), width):
            return
        for slot, row in zip(slots, rows):  # one copy per page, straight from the caller's page
            self._buf[slot, :width] = row

    def _one_copy(self, slots: Sequence[int], width: int) -> bool:
        """Whether the copy is one contiguous run that memcpy streams by itself (_ONE_COPY);
        rows narrower than a slot are not contiguous in the buffer. Sized first: the
        slots are walked only for a copy that large."""
        return width == self.slot_bytes and len(slots) * width >= _ONE_COPY and len(_runs(slots)) == 1

    def _stream(self, slots: Sequence[int], rows: list[np.ndarray] | np.ndarray, width: int) -> bool:
        """Rows (a list, or a C-contiguous batch) written into their slots with streaming
        stores (a page put is not read again soon: its lines need not be read into the
        cache first); False, nothing written, where the extension is not built or a row
        is not contiguous."""
        if _copy is None:
            return False
        try:
            if isinstance(rows, np.ndarray):
                _copy.scatter_block(self._buf, self.slot_bytes, np.asarray(slots, np.int64), rows,
                                    rows.strides[0] if rows.shape[0] > 1 else width, width)
            else:
                _copy.scatter_rows(self._buf, self.slot_bytes, np.asarray(slots, np.int64), rows, width)
        except (BufferError, ValueError):
            return False
        return True

    def _read_serial(self, slots: Sequence[int], dst: np.ndarray) -> None:
        width = dst.shape[1]
        if (_copy is not None and width >= _STREAM_ROW and len(slots) * width >= _STREAM_READ
                and dst.flags.c_contiguous and not self._one_copy(slots, width)):
            _copy.gather_rows(self._buf, self.slot_bytes, np.asarray(slots, np.int64), dst, width, width)
            return
        runs = _runs(slots)
        if len(runs) > 4 and width == self.slot_bytes and width < _SMALL_ROW:
            np.take(self._buf, np.asarray(slots), axis=0, out=dst)  # small rows: one gather loop in C
            return
        for run_start, run_slot, run_len in runs:
            dst[run_start:run_start + run_len] = self._buf[run_slot:run_slot + run_len, :width]

    def reads_ranges(self, start: int, stop: int, dst: np.ndarray) -> bool:
        return True

    def _read_range(self, slots: Sequence[int], dst: np.ndarray, start: int, stop: int) -> None:
        for run_start, run_slot, run_len in _runs(slots):
            dst[run_start:run_start + run_len, start:stop] = self._buf[run_slot:run_slot + run_len, start:stop]

    def lend_fd(self) -> int:
        """The memfd holding the slot buffer (row ``slot`` at ``slot * slot_bytes``), for a
        reader in another process that maps it and copies pages it was lent
        (``Store.lend``); -1 when the buffer is page-locked memory, which is not shared."""
        self._check_open()
        return self._fd

    def _close(self) -> None:
        if self._prefault is not None:
            self._prefault.stop()
        del self._buf
        if self._fd >= 0:
            os.close(self._fd)   # the mapping stays while views of it do
            self._fd = -1


def _count(counts: np.ndarray, slots: np.ndarray, by: int) -> None:
    """``counts[slots] += by`` counting a slot named twice twice: a plain indexed add where
    the slots ascend (so are distinct: a copy's slots nearly always are), ``np.add.at``
    (40 us for 256 slots here) otherwise."""
    if len(slots) < 2 or bool((slots[1:] > slots[:-1]).all()):
        counts[slots] += by
    else:
        np.add.at(counts, slots, by)


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split slots into runs of consecutive indices: (row, first slot, length).

    Consecutive slots (the common case after a fresh allocation) copy as one block.
    Many slots are split by numpy (a Python loop took 60 us for 256).
    """
    n = len(slots)
    if n > 32:
        a = np.asarray(slots, np.int64)
        starts = np.flatnonzero(np.diff(a) != 1) + 1
        firsts = np.concatenate(([0], starts))
        lengths = np.diff(np.concatenate((firsts, [n])))
        return list(zip(firsts.tolist(), a[firsts].tolist(), lengths.tolist()))
    runs: list[tuple[int, int, int]] = []
    start = 0
    while start < n:
        end = start + 1
        while end < n and slots[end] == slots[end - 1] + 1:
            end += 1
        runs.append((start, slots[start], end - start))
        start = end
    return runs
