"""The NVMe tier: page slots in one file, allocated as it fills, or a raw block device.

Slot ``i`` lives at byte offset ``header_bytes + i * slot_bytes``, where
``slot_bytes`` is ``page_bytes`` rounded up to 4096 so that every slot can be moved
with O_DIRECT; the optional header (a multiple of 4096) lets the owner label the
medium (the store writes its identity there, to recognise a foreign file).
Every transfer is cut into chunks of consecutive slots (one ``preadv``/``pwritev``
each, at most ``max_io_bytes``), and the chunks of one call run in parallel on
``io_threads`` threads (the calling thread is one of them), which gives the device
a queue depth of ``io_threads``; ``os.preadv``/``os.pwritev`` release the GIL.
Callers whose rows are 4096-aligned are served straight from their buffer; others
go through reusable aligned bounce buffers. Persistent: the slot contents survive
a close, the free list does not (the index re-``claim``s its slots). Built by the
store's tier table; driven through the :class:`~tierkv.tiers.base.Tier` interface.

A file is created sparse at its full size (so its geometry checks stay what they were)
and its disk space is allocated as slots are first written: before a write reaches past
what is allocated, ``posix_fallocate`` reserves the room up to the highest slot it
writes and a step beyond (``RESERVE_STEP_BYTES``, or an eighth of what is allocated
already). A store with an 8 GiB tier and a few pages so uses a few MiB of disk. A full
filesystem fails that write with :class:`~tierkv.errors.TierIOError` before any byte of
it moves (a failed transfer: its pages are not stored, never stored wrong), rather
than a page cache write-back failing later. Block devices are all there from the start.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import logging
import os
import shutil
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tierkv.store.checksum import checksum64, copy_checksummed, copy_checksummed_rows
from tierkv.errors import InputError, StoreBusyError, StoreClosedError, TierIOError
from tierkv.store.pages import PageList
from tierkv.tiers.aligned import (ALIGN, BouncePool, aligned_empty, dio_alignments, is_aligned, on_huge_pages,
                                  round_up)
from tierkv.tiers.backing import open_backing, oserr
from tierkv.tiers.base import Tier, TierKind
from tierkv.tiers.uring import Ring, RingPool, available as uring_available, requested as uring_requested

logger = logging.getLogger(__name__)

# Syscall size cap. Measured on the dev VM's virtio disk (tierkv.bench.io): 512 KiB to
# 1 MiB syscalls on 4-8 threads write 256 KiB pages ~1.15x faster than 8 MiB ones and
# read as fast; with 2 MiB pages (one slot per syscall) every cap from 1 to 8 MiB ties.
DEFAULT_MAX_IO_BYTES = 1 << 20
# Chunks that go through a bounce buffer stay small whatever max_io_bytes says: the
# copy out of a buffer the device has just filled runs from cache and overlaps the
# next chunk's read (1 MiB bounce chunks read ~1.3x faster than 8 MiB ones there).
BOUNCE_CHUNK_BYTES = 1 << 20
# Linux refuses a preadv/pwritev with more than IOV_MAX (1024) buffers; a padded
# chunk takes two per slot.
_MAX_IOVECS = 1024
# Reads in flight through one io_uring ring (per transfer) when the tier reads through
# io_uring. Off by default: on the dev VM's virtio disk the ring and the pool read as fast
# as each other (and as fio), the ring on up to half the CPU; docs/benchmarks.md, "NVMe
# read path: io_uring vs thread pool (issue 20)".
URING_READ_DEPTH = 32
# A file tier allocates its disk space at least this far ahead of the highest slot
# written (or an eighth of what it has allocated, whichever is more): few fallocate
# calls as it fills, little disk for a tier that holds few pages.
RESERVE_STEP_BYTES = 16 << 20
# What fallocate answers where the filesystem cannot reserve space ahead (writes then
# allocate as they land, and a full disk fails them with ENOSPC just the same).
_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class _Op(enum.Enum):
    READ = "read"
    WRITE = "write"


@dataclass(frozen=True, slots=True)
class _Chunk:
    """Rows ``row .. row+count-1`` of a caller buffer <-> slots ``slot .. slot+count-1``."""

    row: int
    slot: int
    count: int


def _lock_backing(fd: int, path: str) -> None:
    """Hold an exclusive ``flock`` on the backing file or device for the fd's lifetime (a
    store's writer does), so that a second store naming the same path is refused rather
    than relabelling it; StoreBusyError (the fd closed) if another holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreBusyError(f"nvme tier {path} is in use by another store's writer (it holds the file's lock); "
                             "two stores cannot share a data file: give each its own [tiers.nvme] path") from None
    except OSError as e:  # a filesystem without flock: nothing to hold, as before
        logger.warning("nvme tier %s: cannot lock it (%s); nothing stops another store from opening it too",
                       path, oserr(e))


class NvmeTier(Tier):
    """Slots in a file (created 0600, allocated as slots are first written) or a block device.

    ``path`` names a regular file, which must be exactly ``header_bytes + num_slots * slot_bytes``
    long if it exists (it is created sparse at that size otherwise, unless ``create`` is
    false), or a block device of at least that size. ``o_direct`` asks for O_DIRECT;
    where the filesystem refuses it the tier logs a warning and uses buffered I/O,
    and ``direct`` tells which one is in use. ``io_threads`` is the number of
    syscalls in flight for one transfer; ``max_io_bytes`` caps one syscall. ``io_uring=True``
    (or ``TIERKV_IO_URING=1`` with the default ``None``) reads through io_uring instead, with
    ``read_depth`` reads in flight from the calling thread, where the kernel allows it;
    ``io_engine`` tells which path reads.

    ``read``/``write`` block until every byte has moved; they raise
    :class:`~tierkv.errors.TierIOError` (naming the slot, the byte offset and the
    errno text) if any syscall fails or comes up short, after the other chunks of
    the call have finished, so no I/O into the caller's buffer outlives the call.
    A write into a file first allocates its room (see the module notes); a filesystem
    without room fails it with TierIOError before any of its bytes move.
    ``exclusive``: hold an exclusive ``flock`` on the file or device while open (a store's
    writer); StoreBusyError if another open holds it.
    A write zero-fills the part of each slot past the row width. ``flush`` makes
    completed writes durable (``fdatasync``). Thread-safe as the Tier contract says:
    transfers on disjoint slots may run at once from any threads; ``close`` waits for
    the transfers in flight.
    """

    kind = TierKind.NVME
    persistent = True

    def __init__(self, path: str | os.PathLike[str], num_slots: int, page_bytes: int, *,
                 o_direct: bool = True, io_threads: int = 4, create: bool = True,
                 max_io_bytes: int = DEFAULT_MAX_IO_BYTES, header_bytes: int = 0, defer_grow: bool = False,
                 name: str | None = None, io_uring: bool | None = None, read_depth: int = URING_READ_DEPTH,
                 exclusive: bool = False) -> None:
        if page_bytes <= 0 or num_slots < 0:
            raise InputError(f"nvme tier needs page_bytes > 0 and num_slots >= 0, got {page_bytes}, {num_slots}")
        if io_threads < 1 or read_depth < 1:
            raise InputError(f"nvme tier needs io_threads >= 1 and read_depth >= 1, got {io_threads}, {read_depth}")
        if max_io_bytes < ALIGN:
            raise InputError(f"nvme tier needs max_io_bytes >= {ALIGN}, got {max_io_bytes}")
        if header_bytes < 0 or header_bytes % ALIGN:
            raise InputError(f"nvme tier header_bytes must be a non-negative multiple of {ALIGN}, got {header_bytes}")
        super().__init__(num_slots, round_up(page_bytes), name=name)
        self.path = os.fspath(path)
        self.page_bytes = page_bytes
        self.io_threads = io_threads
        self.header_bytes = header_bytes
        size = header_bytes + num_slots * self.slot_bytes
        self._fd, self.direct, short = open_backing(self.path, size, o_direct=o_direct, create=create)
        #: The memory alignment the syscalls take rows at without a bounce buffer: what the
        #: kernel reports for O_DIRECT on a local file or block device (a page's numpy array,
        #: 16 bytes past a page, goes straight to a drive that asks for 4), else a page. A
        #: fabric tier keeps a page: its namespace may come back as another device.
        self.mem_align = ALIGN if self.direct else 1
        reported = dio_alignments(self._fd) if self.direct and self.kind is TierKind.NVME else None
        if reported is not None and reported[1] > ALIGN:
            # Slots and every transfer are 4 KiB multiples: such a file would refuse each
            # one (EINVAL). As for a filesystem that refuses O_DIRECT: buffered, said once.
            logger.warning("nvme tier %s: its filesystem needs O_DIRECT offsets and lengths aligned to %d bytes, "
                           "more than the tier's %d; using buffered I/O, so reads may come from the page cache",
                           self.path, reported[1], ALIGN)
            os.close(self._fd)
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            except OSError as e:
                raise TierIOError(f"nvme tier {self.path}: cannot open: {oserr(e)}") from e
            self.direct, self.mem_align = False, 1
        elif reported is not None and reported[0] & (reported[0] - 1) == 0 and reported[0] < ALIGN:
            self.mem_align = reported[0]
        if exclusive:
            _lock_backing(self._fd, self.path)
        # Bytes from the start of the file known to have their disk space allocated; a block
        # device (and a file whose filesystem cannot reserve ahead) needs no reservations.
        self._size = size
        self._reserved = 0 if stat.S_ISREG(os.fstat(self._fd).st_mode) else size
        self._reserve_lock = threading.Lock()
        # A truncated file is grown back, but a store grows it only once its index has accepted
        # this geometry and the file proved to be one it may take (``defer_grow``; the label
        # check in tierkv.store.opening): a refused open must leave the file alone.
        self._grow: tuple[int, int] | None = (short, size) if short is not None else None
        self._chunk_slots = max(1, min(max_io_bytes // self.slot_bytes, _MAX_IOVECS // 2))
        self._bounce_slots = max(1, min(self._chunk_slots, BOUNCE_CHUNK_BYTES // self.slot_bytes))
        self._bounce = BouncePool(self._bounce_slots * self.slot_bytes, keep=io_threads, huge=True)
        # Shared tails for rows narrower than a slot: zeros padded onto writes, and a
        # sink for reads (its contents are never looked at, so sharing it is safe).
        self._zeros = aligned_empty(self.slot_bytes)
        self._sink = aligned_empty(self.slot_bytes)
        # Chunks fan out to their own executor, never to a pool the caller runs the transfer
        # on (the NVMe-oF tier's guard, say), so a task waiting on its chunks cannot starve itself.
        self._fanout = (ThreadPoolExecutor(max_workers=io_threads - 1, thread_name_prefix=f"tierkv-{self.name}-io")
                        if io_threads > 1 else None)
        self._cond = threading.Condition()
        self._inflight = 0
        # Descriptors to close once no transfer holds any: a transfer stuck in the kernel
        # keeps using its fd *number*, which must not be reused by another open meanwhile.
        self._retired_fds: list[int] = []
        # How long close() waits for transfers in flight (None: forever). A fabric tier
        # bounds it, since a syscall on a lost namespace can outlive any caller.
        self._close_wait_s: float | None = None
        self._init_reads(io_uring, read_depth)
        if not defer_grow:
            self.grow_back()

    def grow_back(self) -> None:
        """Grow a truncated backing file back to the tier's size (slots past the old end read
        as zeros, which fail their checksums: those pages become misses). No-op otherwise."""
        if self._grow is None:
            return
        have, size = self._grow
        logger.warning("nvme tier file %s is %d bytes, shorter than the tier's %d (truncated?); "
                       "growing it back: pages past byte %d become misses", self.path, have, size, have)
        try:
            os.ftruncate(self._fd, size)  # sparse: the space is allocated as slots are written
        except OSError as e:
            raise TierIOError(f"nvme tier {self.path}: cannot grow it back to {size} bytes: {oserr(e)}") from e
        self._grow = None

    def _reserve(self, fd: int, end: int) -> None:
        """Make sure the file's first ``end`` bytes have disk space, reserving a step beyond
        them; TierIOError (naming the bytes and the space free) when the filesystem has no room."""
        if end <= self._reserved:
            return
        with self._reserve_lock:
            have = self._reserved
            if end <= have:
                return
            ahead = min(self._size, round_up(max(end, have + max(RESERVE_STEP_BYTES, have // 8))))
            for target in dict.fromkeys((ahead, end)):  # short of room for the step: just this write's
                try:
                    os.posix_fallocate(fd, have, target - have)
                except OSError as e:
                    if e.errno in _NO_FALLOCATE:
                        logger.warning("nvme tier %s: the filesystem cannot reserve space ahead (%s); writes "
                                       "allocate it as they land", self.path, oserr(e))
                        self._reserved = self._size
                        return
                    if e.errno == errno.ENOSPC and target > end:
                        continue
                    free = shutil.disk_usage(os.path.dirname(os.path.abspath(self.path))).free
                    raise TierIOError(f"nvme tier {self.path}: cannot allocate bytes {have} to {end} of the file "
                                      f"for this write ({free} bytes free on its filesystem): {oserr(e)}; the "
                                      "write fails and its pages are not stored") from e
                self._reserved = target
                return

    def read_header(self) -> bytes:
        """The ``header_bytes`` reserved before slot 0 (an owner's label for the medium)."""
        self._check_open()
        buf = aligned_empty(self.header_bytes)
        with self._busy() as fd:
            try:
                done = os.preadv(fd, [buf.data], 0)
            except OSError as e:
                raise TierIOError(f"nvme tier {self.path}: reading the header failed: {oserr(e)}") from e
        if done != self.header_bytes:
            raise TierIOError(f"nvme tier {self.path}: short header read, {done} of {self.header_bytes} bytes")
        return buf.tobytes()

    def write_header(self, data: bytes) -> None:
        """Write ``data`` (zero-padded) into the header and make it durable."""
        self._check_open()
        if len(data) > self.header_bytes:
            raise InputError(f"nvme tier header holds {self.header_bytes} bytes, got {len(data)}")
        buf = aligned_empty(self.header_bytes)
        buf[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        with self._busy() as fd:
            self._reserve(fd, self.header_bytes)
            try:
                done = os.pwritev(fd, [buf.data], 0)
                os.fdatasync(fd)
            except OSError as e:
                raise TierIOError(f"nvme tier {self.path}: writing the header failed: {oserr(e)}") from e
        if done != self.header_bytes:
            raise TierIOError(f"nvme tier {self.path}: short header write, {done} of {self.header_bytes} bytes")

    def codec_state(self) -> dict[str, object] | None:
        """A tier of whole-page slots stores pages raw (``codec = "none"``)."""
        from tierkv.codec import CodecMode
        from tierkv.store.coding import CodecChoice

        return CodecChoice(CodecMode.NONE, None).describe()

    def fileno(self) -> int:
        """The backing file descriptor (for inspection; do not close it)."""
        return self._fd

    def flush(self) -> None:
        """``fdatasync`` the backing file; raises TierIOError on failure."""
        self._check_open()
        with self._busy() as fd:
            try:
                os.fdatasync(fd)
            except OSError as e:
                raise TierIOError(f"nvme tier {self.path}: fdatasync failed: {oserr(e)}") from e

    # -- Tier hooks -------------------------------------------------------------
    def _write(self, slots: Sequence[int], src: np.ndarray) -> None:
        self._transfer(_Op.WRITE, slots, src)

    def _read(self, slots: Sequence[int], dst: np.ndarray) -> None:
        if not dst.flags.writeable:
            raise InputError("nvme tier read needs a writeable destination buffer, got a read-only one")
        self._read_rows(slots, dst, None)

    def _close(self) -> None:
        with self._cond:
            idle = self._cond.wait_for(lambda: self._inflight == 0, timeout=self._close_wait_s)
            if not idle:
                logger.warning("nvme tier %s: closing with %d transfers still stuck in the kernel; their "
                               "descriptor closes when they return", self.path, self._inflight)
            fd, self._fd = self._fd, -1
            self._retire_fd(fd)
        if self._fanout is not None:
            self._fanout.shutdown(wait=idle, cancel_futures=not idle)
        self._bounce.clear()
        if self._rings is not None:
            self._rings.close()

    def _retire_fd(self, fd: int) -> None:
        """Close ``fd`` now if no transfer is in flight, else when the last one leaves.
        Call with ``_cond`` held."""
        if fd >= 0:
            self._retired_fds.append(fd)
        if self._inflight == 0:
            for old in self._retired_fds:
                os.close(old)
            self._retired_fds.clear()

    # -- transfers ----------------------------------------------------------------
    @contextlib.contextmanager
    def _busy(self) -> Iterator[int]:
        """Hold the fd open for one transfer; ``_close`` waits for every holder."""
        with self._busy_mode() as (fd, _direct, _mem_align):
            yield fd

    @contextlib.contextmanager
    def _busy_mode(self) -> Iterator[tuple[int, bool, int]]:
        """:meth:`_busy`, with the descriptor's I/O mode read together with it (``direct``,
        ``mem_align``): an NVMe-oF recovery swaps the three at once, and a transfer decides
        what goes in place by the descriptor it holds."""
        with self._cond:
            if self._fd < 0:
                raise StoreClosedError("nvme tier is closed")
            self._inflight += 1
            fd, direct, mem_align = self._fd, self.direct, self.mem_align
        try:
            yield fd, direct, mem_align
        finally:
            with self._cond:
                self._inflight -= 1
                if self._inflight == 0:
                    self._retire_fd(-1)
                    self._cond.notify_all()

    def _write_rows(self, slots: Sequence[int], rows: PageList) -> None:
        # Separate pages go to the syscalls as they are (aligned ones) or through the
        # bounce buffers a misaligned batch needs anyway, never through a stacked copy.
        self._transfer(_Op.WRITE, slots, rows)

    def _write_checksummed(self, slots: Sequence[int], src: np.ndarray | PageList) -> list[int]:
        sums = [0] * len(slots)
        self._transfer(_Op.WRITE, slots, src, sums)
        return sums

    def _read_checksummed(self, slots: Sequence[int], dst: np.ndarray) -> list[int]:
        if not dst.flags.writeable:
            raise InputError("nvme tier read needs a writeable destination buffer, got a read-only one")
        sums = [0] * len(slots)
        self._read_rows(slots, dst, sums)
        return sums

    def reads_ranges(self, start: int, stop: int, dst: np.ndarray) -> bool:
        # Pages lie in the file as they are; O_DIRECT needs the range and the rows aligned.
        # Local files only: a fabric tier's reads carry deadlines this path does not.
        if self.kind is not TierKind.NVME:
            return False
        if not self.direct:
            return True
        return (start % ALIGN == 0 and stop % ALIGN == 0 and dst.shape[1] % ALIGN == 0
                and is_aligned(dst, self.mem_align))

    def _read_range(self, slots: Sequence[int], dst: np.ndarray, start: int, stop: int) -> None:
        self._pread_ranges(slots, dst, [(start, stop)], lambda k: None)

    def read_ranges(self, slots: Sequence[int], dst: np.ndarray, ranges: Sequence[tuple[int, int]],
                    after: Callable[[int], None]) -> None:
        """All ranges' reads queued at once, range 0 of every page first, so that the device
        always has ``io_threads`` reads in flight; ``after(k)`` on the calling thread, in
        order, as soon as range ``k`` of every page has landed (the calling thread also
        reads while it waits)."""
        self._check_io(slots, dst)
        self._check_writable(dst)
        for start, stop in ranges:
            if not 0 <= start < stop <= dst.shape[1] or not self.reads_ranges(start, stop, dst):
                raise InputError(f"the {self.name} tier cannot read bytes {start}..{stop} of its pages into this "
                                 "buffer (out of the row, or not aligned for O_DIRECT)")
        self._pread_ranges(slots, dst, ranges, after)

    def _pread_ranges(self, slots: Sequence[int], dst: np.ndarray, ranges: Sequence[tuple[int, int]],
                      after: Callable[[int], None]) -> None:
        """:meth:`read_ranges` once its arguments are checked: one read per page per range
        (the ranges of consecutive slots are not adjacent in the file)."""
        n = len(slots)
        todo = deque((k, row, int(slot)) for k in range(len(ranges)) for row, slot in enumerate(slots))
        left = [n] * len(ranges)
        errors: list[BaseException] = []
        cond = threading.Condition()
        with self._busy() as fd:
            def one() -> bool:
                """Read the next queued range of a page; False when none is left (or one failed)."""
                with cond:
                    if errors or not todo:
                        return False
                    k, row, slot = todo.popleft()
                start, stop = ranges[k]
                offset = self.header_bytes + slot * self.slot_bytes + start
                try:
                    done = os.preadv(fd, [dst[row, start:stop].data], offset)
                    if done != stop - start:
                        raise TierIOError(f"nvme tier {self.path}: short read of slot {slot}: {done} of "
                                          f"{stop - start} bytes at offset {offset} (file or device shorter than "
                                          "the tier?)")
                except OSError as e:
                    err: BaseException = TierIOError(f"nvme tier {self.path}: read of bytes {start}..{stop} of slot "
                                                     f"{slot} (offset {offset}) failed: {oserr(e)}")
                except BaseException as e:  # noqa: BLE001 - raised by the caller
                    err = e
                else:
                    with cond:
                        left[k] -= 1
                        cond.notify_all()
                    return True
                with cond:
                    errors.append(err)
                    cond.notify_all()
                return False

            def drain() -> None:
                while one():
                    pass

            helpers = min(self.io_threads, n * len(ranges)) - 1
            futures = self._helpers(drain, helpers)
            try:
                k = 0
                while k < len(ranges):
                    with cond:
                        ready = not errors and left[k] == 0
                    if ready:
                        after(k)
                        k += 1
                    elif not one():   # nothing left to read here: wait for the helpers' reads
                        with cond:
                            if errors:
                                break
                            cond.wait_for(lambda: bool(errors) or left[k] == 0, timeout=1.0)
            finally:
                with cond:
                    if not errors and any(left):
                        errors.append(TierIOError(f"nvme tier {self.path}: a ranged read stopped early"))
                    todo.clear()
                for f in futures:
                    f.result()
        if errors:
            raise errors[0]

    # -- reads through io_uring ----------------------------------------------------------
    def _init_reads(self, io_uring: bool | None, read_depth: int) -> None:
        """Set up the read path: io_uring rings where asked for and working here, else the pool.

        ``io_uring=None`` follows ``TIERKV_IO_URING=1`` on a local NVMe tier (a fabric tier's
        deadlines and fault tests are built on the pool's syscalls, so it needs ``True``)."""
        self.read_depth = read_depth
        wanted = uring_requested() and self.kind is TierKind.NVME if io_uring is None else io_uring
        self._rings = RingPool(read_depth) if wanted and uring_available() else None
        if self._rings is not None:  # a bounce buffer kept per read in flight on a ring
            self._bounce = BouncePool(self._bounce_slots * self.slot_bytes, keep=max(self.io_threads, read_depth),
                                      huge=True)

    @property
    def io_engine(self) -> str:
        """How this tier reads: ``"io_uring"`` or ``"threads"`` (writes always use the pool)."""
        return "threads" if self._rings is None else "io_uring"

    def _read_rows(self, slots: Sequence[int], dst: np.ndarray, sums: list[int] | None) -> None:
        """Read ``slots`` into ``dst`` through an io_uring ring, or the thread pool without one."""
        if self._rings is None or len(slots) == 0 or dst.shape[1] == 0:
            self._transfer(_Op.READ, slots, dst, sums)
            return
        # Nested so that on an exception the ring is drained (closed) before the bounce
        # buffers its reads may still be filling go back to the pool, and before the fd.
        with self._busy_mode() as (fd, direct, mem_align), contextlib.ExitStack() as stack, \
                self._rings.borrow() as ring:
            in_place = self._serves_in_place(dst, direct, mem_align, sums is not None)
            chunks = self._plan(slots, self._chunk_slots if in_place else self._bounce_slots)
            self._ring_read(ring, fd, chunks, dst, in_place, sums, stack)

    def _ring_read(self, ring: Ring, fd: int, chunks: list[_Chunk], dst: np.ndarray, in_place: bool,
                   sums: list[int] | None, stack: contextlib.ExitStack) -> None:
        """Keep up to ``ring.entries`` chunks in flight; hash (and copy out of the bounce buffer)
        the chunks that landed while the next ones are in flight. Once no read of the call is
        in flight any more, raises the failure of the first row that failed (completions come
        in any order)."""
        todo = deque(enumerate(chunks))
        staged: dict[int, np.ndarray] = {}   # chunk -> its bounce buffer, while in flight
        spare: list[np.ndarray] = []         # this call's bounce buffers not in use
        landed: list[_Chunk] = []
        errors: list[tuple[TierIOError, int]] = []  # with the failed chunk's first row
        width = dst.shape[1]
        while True:
            while todo and not errors and ring.inflight < ring.entries:
                tag, chunk = todo.popleft()
                offset = self.header_bytes + chunk.slot * self.slot_bytes
                if in_place:
                    iov = self._iovecs(_Op.READ, dst[chunk.row:chunk.row + chunk.count])
                else:
                    staged[tag] = spare.pop() if spare else stack.enter_context(self._bounce.borrow())
                    iov = [staged[tag][:chunk.count * self.slot_bytes].data]
                ring.readv(fd, offset, iov, tag)
            ring.submit()
            if sums is not None:  # the device is busy with the next chunks meanwhile
                for chunk in landed:
                    rows = dst[chunk.row:chunk.row + chunk.count]
                    sums[chunk.row:chunk.row + chunk.count] = [checksum64(row) for row in rows]
            landed.clear()
            if ring.inflight == 0:
                break
            for tag, result in ring.wait(1):
                chunk = chunks[tag]
                bounce = staged.pop(tag, None)
                if result != chunk.count * self.slot_bytes:
                    errors.append((self._read_failed(chunk, result), chunk.row))
                elif bounce is not None:
                    rows = bounce[:chunk.count * self.slot_bytes].reshape(chunk.count, self.slot_bytes)
                    if sums is not None:  # copied and hashed in one pass: not hashed again below
                        sums[chunk.row:chunk.row + chunk.count] = copy_checksummed(
                            dst[chunk.row:chunk.row + chunk.count], rows[:, :width])
                    else:
                        dst[chunk.row:chunk.row + chunk.count] = rows[:, :width]
                if bounce is not None:
                    spare.append(bounce)
                elif not errors:
                    landed.append(chunk)
        if errors:
            raise min(errors, key=lambda failed: failed[1])[0]

    def _read_failed(self, chunk: _Chunk, result: int) -> TierIOError:
        """The error for a ring read of ``chunk`` that returned ``result`` (bytes, or -errno)."""
        offset = self.header_bytes + chunk.slot * self.slot_bytes
        length = chunk.count * self.slot_bytes
        if result < 0:
            return TierIOError(f"nvme tier {self.path}: read of slot {chunk.slot} ({chunk.count} slots, {length} "
                               f"bytes at offset {offset}) failed: [Errno {-result}] {os.strerror(-result)}")
        bad = chunk.slot + result // self.slot_bytes
        return TierIOError(f"nvme tier {self.path}: short read at slot {bad} (offset {offset + result}): {result}"
                           f" of {length} bytes from offset {offset} (file or device shorter than the tier?)")

    def _transfer(self, op: _Op, slots: Sequence[int], buf: np.ndarray | PageList,
                  sums: list[int] | None = None) -> None:
        """Move every chunk of one call, in parallel, and raise the first failure.

        ``sums``: filled with each row's checksum, by the thread that moved it (after the
        read, or after the write so that the syscall goes out first)."""
        if len(slots) == 0 or buf.shape[1] == 0:
            if sums is not None:  # empty rows still have a checksum, as every tier says
                sums[:] = [checksum64(buf[i]) for i in range(len(slots))]
            return
        errors: list[BaseException] = []
        with self._busy_mode() as (fd, direct, mem_align):
            in_place = self._serves_in_place(buf, direct, mem_align, sums is not None)
            chunks = deque(self._plan(slots, self._chunk_slots if in_place else self._bounce_slots))
            if op is _Op.WRITE:
                self._reserve(fd, self.header_bytes + (max(slots) + 1) * self.slot_bytes)

            def drain() -> None:
                # Workers pull chunks until none are left, or stop early once one failed.
                while not errors:
                    try:
                        chunk = chunks.popleft()
                    except IndexError:
                        return
                    try:
                        self._move(op, fd, chunk, buf, in_place, sums)
                    except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller
                        errors.append(e)

            helpers = min(self.io_threads, len(chunks)) - 1
            futures = self._helpers(drain, helpers)
            drain()  # the calling thread is one of the io_threads
            for f in futures:
                f.result()
        if errors:
            raise errors[0]

    def _helpers(self, drain: Callable[[], None], count: int) -> list[Future[None]]:
        """Up to ``count`` pool threads running ``drain``: fewer where the pool takes no more
        work (once the main thread has returned, concurrent.futures refuses it, so a store
        closed from an atexit handler or a late thread would fail to write its pages back);
        the calling thread drains what they would have."""
        futures: list[Future[None]] = []
        for _ in range(count if self._fanout is not None else 0):
            try:
                futures.append(self._fanout.submit(drain))  # type: ignore[union-attr]
            except RuntimeError:
                break
        return futures

    def _plan(self, slots: Sequence[int], max_slots: int) -> list[_Chunk]:
        """Cut ``slots`` into runs of consecutive slots, each at most ``max_slots`` (one syscall).

        A batch is also cut into at least ``io_threads`` chunks where it has that many
        slots, so that one big run still keeps every thread busy.
        """
        n = len(slots)
        per_chunk = max(1, min(max_slots, -(-n // self.io_threads)))
        chunks: list[_Chunk] = []
        start = 0
        while start < n:
            end = start + 1
            while end < n and end - start < per_chunk and slots[end] == slots[end - 1] + 1:
                end += 1
            chunks.append(_Chunk(start, int(slots[start]), end - start))
            start = end
        return chunks

    @staticmethod
    def _serves_in_place(buf: np.ndarray | PageList, direct: bool, mem_align: int, checksummed: bool) -> bool:
        """Whether the syscalls on a descriptor of this mode (``direct``, ``mem_align``) use
        the caller's rows without a bounce buffer.

        ``checksummed`` (every transfer of the store's): only rows known to lie on huge
        pages are moved in place (a tier's own, ``PageList.checked`` and not
        ``scattered``; rows in :func:`~tierkv.tiers.aligned.aligned_empty`'s huge
        buffers, as the store's own read rows are). Other rows go through the tier's
        huge-page bounce buffers even where they are aligned: the copy in or out is the
        hash's pass over the pages anyway (:func:`~tierkv.store.checksum.copy_checksummed`),
        and a direct transfer of rows on 4 KiB pages ran at the speed their physical
        layout allowed (docs/benchmarks.md, "Verified transfers through the bounce
        buffers")."""
        if not direct:
            return True
        if buf.shape[1] % ALIGN:
            return False
        if isinstance(buf, PageList):
            if buf.scattered or (checksummed and not buf.checked and not all(on_huge_pages(r) for r in buf)):
                return False
            return buf.aligned or all(is_aligned(row, mem_align) for row in buf)
        return is_aligned(buf, mem_align) and (not checksummed or on_huge_pages(buf))

    def _move(self, op: _Op, fd: int, chunk: _Chunk, buf: np.ndarray | PageList, in_place: bool,
              sums: list[int] | None = None) -> None:
        rows = buf[chunk.row:chunk.row + chunk.count]
        width = buf.shape[1]
        if in_place:
            self._syscall(op, fd, chunk, self._iovecs(op, rows))
            if sums is not None:
                sums[chunk.row:chunk.row + chunk.count] = [checksum64(row) for row in rows]
            return
        with self._bounce.borrow() as bounce:
            staged = bounce[:chunk.count * self.slot_bytes].reshape(chunk.count, self.slot_bytes)
            if op is _Op.WRITE:
                if isinstance(rows, PageList):
                    if sums is not None:   # copied and hashed in one pass
                        sums[chunk.row:chunk.row + chunk.count] = copy_checksummed_rows(staged[:, :width], list(rows))
                    else:
                        rows.stacked(staged[:, :width])
                elif sums is not None:
                    sums[chunk.row:chunk.row + chunk.count] = copy_checksummed(staged[:, :width], rows)
                else:
                    staged[:, :width] = rows
                # The bounce buffer holds another page's bytes; never leak them to disk.
                staged[:, width:] = 0
            self._syscall(op, fd, chunk, [staged.reshape(-1).data])
            if op is _Op.READ:
                assert isinstance(rows, np.ndarray)  # reads always land in a batch
                if sums is not None:
                    sums[chunk.row:chunk.row + chunk.count] = copy_checksummed(rows, staged[:, :width])
                else:
                    rows[...] = staged[:, :width]

    def _iovecs(self, op: _Op, rows: np.ndarray | PageList) -> list[memoryview]:
        """The caller's rows as syscall buffers, each padded out to a whole slot."""
        width = rows.shape[1]
        if width == self.slot_bytes:
            return [row.data for row in rows] if isinstance(rows, PageList) else [rows.reshape(-1).data]
        tail = (self._zeros if op is _Op.WRITE else self._sink)[:self.slot_bytes - width].data
        iov: list[memoryview] = []
        for row in rows:
            iov += (row.data, tail)
        return iov

    def _syscall(self, op: _Op, fd: int, chunk: _Chunk, iov: list[memoryview]) -> None:
        offset = self.header_bytes + chunk.slot * self.slot_bytes
        length = chunk.count * self.slot_bytes
        try:
            done = os.pwritev(fd, iov, offset) if op is _Op.WRITE else os.preadv(fd, iov, offset)
        except OSError as e:
            raise TierIOError(f"nvme tier {self.path}: {op.value} of slot {chunk.slot}"
                              f" ({chunk.count} slots, {length} bytes at offset {offset}) failed: {oserr(e)}") from e
        if done != length:
            bad = chunk.slot + done // self.slot_bytes
            raise TierIOError(f"nvme tier {self.path}: short {op.value} at slot {bad} (offset {offset + done}):"
                              f" {done} of {length} bytes from offset {offset} (file or device shorter than the tier?)")
