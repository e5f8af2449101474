"""Block-addressed page tiers: pages stored as runs of 4 KiB blocks, coded where that pays.

A :class:`BlockPageTier` presents the usual page-slot :class:`~tierkv.tiers.base.Tier`
to the manager and the transfers, over an NVMe or NVMe-oF tier opened with 4 KiB
slots (its *blocks*). A page's slot is an opaque handle; the page occupies a short
list of block runs (*extents*), which the index records so a restart can claim them
back. The manager reserves worst-case room (a raw page's ``ceil(page_bytes / 4096)``
blocks) when it plans; when the pages are written, the tier codes them with the
lossless KV codec (where its :class:`~tierkv.store.coding.CodecChoice` says so) and
re-places each page in exactly the blocks its blob needs, lowest run first, so
compressed pages pack together and the tier holds more pages than its raw capacity.

A page is stored coded exactly when it takes fewer blocks than a raw page; otherwise
raw, so coded-or-raw follows from the extents and no flag is needed. A lossy page's row
(:mod:`tierkv.store.lossy_pages`: a lossy blob, ``TL``, then zeros) is stored as its
blob alone, whatever the codec choice: its blocks start ``TL`` where a coded page's
start ``TK``, and reading them back puts the zeros after it again, bit for bit. Reads move only
a page's blocks and decode them; a blob that does not decode raises
:class:`UndecodablePageError` naming the rows, after every other row is filled, so
the store serves those pages as misses and never wrong bytes (the store then checks
each page against its recorded checksum as for every persistent tier).

A freed handle stays readable until the next write into the tier, as a freed slot's
bytes do on a slot tier: a plan reads the pages it moves out of a tier before it
writes into that tier (deepest tier first). Thread-safety as for every tier. Built by
:mod:`tierkv.store.opening` for ``codec = "lossless"`` or ``"auto"``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, TypeVar

import numpy as np

from tierkv.chunks import settle
from tierkv.codec import Direction, max_encoded_bytes
from tierkv.codec.auto import PIPELINE_BYTES
from tierkv.errors import CapacityError, InputError, StoreClosedError, TierIOError
from tierkv.store.checksum import checksum_rows
from tierkv.store.coding import CodecChoice
from tierkv.tiers.aligned import ALIGN, ScratchPool, round_up
from tierkv.tiers.base import Extents, Tier
from tierkv.tiers.nvme import NvmeTier


class UndecodablePageError(TierIOError):
    """Pages whose stored blob does not decode (damaged on the medium); ``rows`` are
    their indices in the read. Every other row of the read was filled correctly."""

    def __init__(self, message: str, rows: tuple[int, ...]) -> None:
        super().__init__(message)
        self.rows = rows


T = TypeVar("T")

#: How a lossy page's blob starts (:mod:`tierkv.lossy.format`); a coded page's starts ``TK``.
LOSSY_MAGIC = b"TL"


def lossy_length(row: np.ndarray) -> int:
    """The length of the lossy blob ``row`` holds (it starts :data:`LOSSY_MAGIC`, its header
    says a payload that fits, and every byte after it is zero); 0 for any other row."""
    if row.shape[0] < 48 or row[:2].tobytes() != LOSSY_MAGIC:
        return 0
    from tierkv.errors import CorruptPageError
    from tierkv.lossy.format import HEADER_BYTES, header

    try:
        plen = header(row.tobytes())[-1]
    except CorruptPageError:
        return 0
    length = HEADER_BYTES + plen
    return length if length < row.shape[0] and not row[length:].any() else 0


def to_extents(blocks: Sequence[int]) -> Extents:
    """Block indices (in page order) as runs ``(first, count)``."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((int(b), 1))
    return tuple(runs)


def block_list(extents: Extents) -> list[int]:
    return [b for first, count in extents for b in range(first, first + count)]


#: Blocks of a coded batch's pipeline group (tierkv.codec.auto.PIPELINE_BYTES, 4 MiB):
#: large enough that the medium's transfers stay long, small enough that a few groups
#: overlap coding and moving.
_GROUP_BLOCKS = PIPELINE_BYTES // ALIGN


def _groups(counts: Sequence[int], blocks: int) -> list[tuple[int, int]]:
    """Consecutive page ranges of about ``blocks`` blocks each (at least one page each)."""
    out: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, c in enumerate(counts):
        total += c
        if total >= blocks:
            out.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(counts):
        out.append((start, len(counts)))
    return out


def extent_blocks(extents: Extents) -> int:
    return sum(count for _, count in extents)


class BlockPageTier(Tier):
    """Pages of ``page_bytes`` over the 4 KiB slots of ``blocks`` (an NVMe or NVMe-oF tier).

    ``num_pages`` is the raw capacity (what the slot layout of the same file holds); its
    ``num_pages * ceil(page_bytes / 4096)`` blocks are used, any further blocks of
    ``blocks`` are left alone. ``num_free`` counts worst-case (raw) pages that still fit.
    It is ``blocks`` addressed in pages, so it takes that tier's kind and name. Closing
    this tier closes ``blocks`` and the codec.
    """

    persistent = True
    block_addressed = True

    def __init__(self, blocks: NvmeTier, num_pages: int, page_bytes: int, choice: CodecChoice) -> None:
        if blocks.slot_bytes != ALIGN:
            raise InputError(f"a block tier needs {ALIGN}-byte blocks below it, got {blocks.slot_bytes}-byte slots")
        self.kind = blocks.kind  # the medium's kind (the copy table's key), and its name below
        slot_bytes = round_up(page_bytes)
        self.blocks_per_page = slot_bytes // ALIGN
        used = num_pages * self.blocks_per_page
        if used > blocks.num_slots:
            raise InputError(f"{num_pages} pages of {slot_bytes} bytes need {used} blocks, the tier has {blocks.num_slots}")
        super().__init__(num_pages, slot_bytes, name=blocks.name)
        self.blocks = blocks
        self.page_bytes = page_bytes
        self.choice = choice
        if used < blocks.num_slots:  # a device a little larger than whole pages: keep the rest out of use
            blocks.claim(range(used, blocks.num_slots))
        self._lock = threading.Lock()
        self._pages: dict[int, Extents] = {}
        self._retired: dict[int, Extents] = {}
        self._handles = itertools.count()
        self._views: OrderedDict[Extents, int] = OrderedDict()  # read-only openers' handles
        self._stride = round_up(max_encoded_bytes(page_bytes))
        self._io_pool: ThreadPoolExecutor | None = None   # a pipelined batch's next group's I/O
        # Coded batches' staging, packing and reading buffers, reused: a group's blobs (at
        # most a group's pages at the stride), its packed blocks, or a read group's blocks
        # (which may run a page past the group's size). Four: a write pipeline holds a
        # staging buffer and two packed ones, a read pipeline two. Allocated afresh, each
        # buffer's first touch faulted in about 4 MiB a group, a third of a coded put.
        per = max(1, _GROUP_BLOCKS // self.blocks_per_page)
        self._scratch = ScratchPool(max(per * self._stride, (_GROUP_BLOCKS + self.blocks_per_page) * ALIGN), keep=4,
                                    huge=True)

    # -- slot bookkeeping ---------------------------------------------------------------
    @property
    def available(self) -> bool:
        return not self._closed and self.blocks.available

    def codec_state(self) -> dict[str, object] | None:
        return self.choice.describe()

    @property
    def num_free(self) -> int:
        return self.blocks.num_free // self.blocks_per_page

    @property
    def stored_pages(self) -> int:
        return len(self._pages)

    @property
    def used_bytes(self) -> int:
        """Bytes of the 4 KiB blocks pages hold (coded and lossy pages fewer than raw ones)."""
        return (self.num_slots * self.blocks_per_page - self.blocks.num_free) * ALIGN

    def allocate(self, n: int, contiguous: bool = False) -> list[int]:
        """Reserve room for ``n`` raw pages (each in one run where possible); returns handles."""
        self._check_open()
        bpp = self.blocks_per_page
        with self._lock:
            if n * bpp > self.blocks.num_free:
                raise CapacityError(f"asked for {n} pages ({n * bpp} blocks), {self.blocks.num_free} blocks free")
            handles = [next(self._handles) for _ in range(n)]
            start = self.blocks.allocate_run(n * bpp)   # one run for the batch where there is one
            if start is not None:
                for i, h in enumerate(handles):
                    self._pages[h] = ((start + i * bpp, bpp),)
            else:
                self._place_each(handles, [bpp] * n)
            return handles

    def _place_each(self, handles: Sequence[int], need: Sequence[int]) -> None:
        """Blocks for each page on its own: the lowest run of its count (first fit), else
        its count of the lowest free blocks. A search for a run at least as long as the
        last one found goes on from that run's end: below it no run that long is free,
        and nothing is freed meanwhile (``_lock`` held)."""
        at = shortest = 0
        for h, k in zip(handles, need):
            start = self.blocks.allocate_run(k, at if k >= shortest else 0)
            if start is not None:
                self._pages[h] = ((start, k),)
                at, shortest = start + k, k
            else:
                self._pages[h] = to_extents(self.blocks.allocate(k))

    def free(self, slots: Sequence[int]) -> None:
        self._check_open()
        with self._lock:
            if len(set(slots)) < len(slots) or any(h not in self._pages for h in slots):
                bad = next(h for i, h in enumerate(slots) if h not in self._pages or h in slots[:i])
                raise InputError(f"page handle {bad} freed twice or never allocated")
            runs = [run for h in slots for run in self._pages[h]]
            self.blocks.free_runs(runs)   # raises with nothing freed: the handles stay
            for h in slots:
                self._retired[h] = self._pages.pop(h)

    def claim(self, slots: Sequence[int]) -> None:
        self._check_open()
        raise InputError(f"the {self.name} tier is block-addressed; claim pages with claim_extents")

    def extents(self, slot: int) -> Extents | None:
        with self._lock:
            return self._pages[slot]

    def claim_extents(self, extents: Extents) -> int:
        """Claim a page's recorded blocks (all or nothing); InputError if any is out of
        range, taken already, or the page would exceed a raw page's blocks."""
        self._check_open()
        n = extent_blocks(extents)
        if not extents or any(count <= 0 for _, count in extents) or n > self.blocks_per_page:
            raise InputError(f"extents {extents} do not describe a page of 1..{self.blocks_per_page} blocks")
        with self._lock:
            self.blocks.claim(block_list(extents))
            h = next(self._handles)
            self._pages[h] = tuple(extents)
            return h

    def view(self, extents: Extents) -> int:
        """A handle to read a page another process (the writer) recorded at ``extents``,
        without claiming its blocks: for read-only openers, which never allocate. The same
        extents give the same handle. InputError for extents that cannot be a page."""
        self._check_open()
        n = extent_blocks(extents)
        if not extents or any(c <= 0 or f < 0 or f + c > self.blocks.num_slots for f, c in extents) \
                or n > self.blocks_per_page:
            raise InputError(f"extents {extents} do not describe a page of 1..{self.blocks_per_page} blocks")
        key = tuple(extents)
        with self._lock:
            h = self._views.pop(key, None)
            if h is None:
                h = next(self._handles)
                self._pages[h] = key
                # A long-lived reader sees the writer churn through pages: keep the views
                # of at most as many pages as the tier can hold (coded pages can be as small
                # as one block, so a get's prefix never outgrows it), least recent out.
                while len(self._views) >= max(1, self.blocks.num_slots):
                    _, old = self._views.popitem(last=False)
                    del self._pages[old]
            self._views[key] = h
            return h

    def flush(self) -> None:
        self._check_open()
        self.blocks.flush()

    # -- data movement --------------------------------------------------------------------
    def _check_slots(self, slots: Sequence[int]) -> None:
        for h in slots:
            if h not in self._pages and h not in self._retired:
                raise InputError(f"page handle {h} is not allocated in the {self.name} tier")

    def _write(self, slots: Sequence[int], src: np.ndarray) -> None:
        """Writes the pages, coded where the choice says so. A coded batch of more than
        one group (about 4 MiB of raw pages) is pipelined: the next group is coded here
        while this one's blocks are written on the tier's I/O thread."""
        n, width = src.shape
        if n == 0:
            return
        self._retired.clear()  # the blocks of freed pages may be overwritten from here on
        # Lossy rows are stored as their blob; the codec codes the others (and only they
        # count in its measured ratio).
        lossy = [lossy_length(src[i]) for i in range(n)] if width == self.page_bytes else [0] * n
        plain = [i for i in range(n) if not lossy[i]]
        code = bool(width == self.page_bytes and plain
                    and self.choice.compress(src if len(plain) == n else src[plain]))
        per = max(1, _GROUP_BLOCKS // self.blocks_per_page)
        if not code or n <= per:
            self._write_group(slots, src, lossy, code)
            return
        pending: Future[None] | None = None
        held: np.ndarray | None = None   # the scratch buffer of the write in flight
        coded_bytes = page_bytes = 0
        try:
            for a in range(0, n, per):
                b = min(n, a + per)
                try:
                    blocks, packed, sizes, buf = self._prepare_group(slots[a:b], src[a:b], lossy[a:b], True)
                except CapacityError:
                    # A group that grows back may need the blocks a later one frees: the
                    # rest goes as one batch, which fits exactly when the whole batch does.
                    if pending is not None:
                        pending.result()
                        pending = None
                        self._give(held)
                    self._write_group(slots[a:], src[a:], lossy[a:], True)
                    break
                coded_bytes += sizes[0]
                page_bytes += sizes[1]
                if pending is not None:
                    pending.result()   # the previous group's write, before this one's starts
                    pending = None
                    self._give(held)
                pending, held = self._submit(self._timed_write, blocks, packed), buf
            if pending is not None:
                pending.result()
                pending = None
                self._give(held)
        finally:
            if pending is not None:   # no write outlives the call, even on an error here
                wait([pending])
        if page_bytes:
            self.choice.observe(page_bytes, coded_bytes)

    def _write_group(self, slots: Sequence[int], src: np.ndarray, lossy: list[int], code: bool) -> None:
        blocks, packed, sizes, buf = self._prepare_group(slots, src, lossy, code)
        if sizes[0]:
            self.choice.observe(sizes[1], sizes[0])
        self._timed_write(blocks, packed)
        self._give(buf)

    def _give(self, buf: np.ndarray | None) -> None:
        if buf is not None:
            self._scratch.give(buf)

    def _prepare_group(self, slots: Sequence[int], src: np.ndarray, lossy: list[int],
                       code: bool) -> tuple[list[int], np.ndarray, tuple[int, int], np.ndarray | None]:
        """Codes the pages (where ``code``), re-places each in exactly the blocks it needs
        and packs them: the blocks to write, the packed buffer, (coded bytes, page bytes)
        of the coded pages, and the scratch buffer under the packed one (None: the
        caller's rows are written as they are), to give back once written."""
        n, width = src.shape
        bpp = self.blocks_per_page
        plain = [i for i in range(n) if not lossy[i]]
        need = [min(bpp, -(-length // ALIGN)) if length else bpp for length in lossy]
        sizes: np.ndarray | None = None
        staged = staging = None
        try:
            if code and plain:
                assert self.choice.codec is not None
                sub = src if len(plain) == n else src[plain]
                staging = self._scratch.take(len(plain) * self._stride)
                staged = staging[:len(plain) * self._stride].reshape(len(plain), self._stride)
                sizes = self.choice.codec.encode_into(sub, staged)
                for j, i in enumerate(plain):
                    need[i] = min(bpp, -(-int(sizes[j]) // ALIGN))
            with self._lock:
                have = [extent_blocks(self._pages[h]) for h in slots]
            if have != need:  # coded pages shrink their reservation; a rewritten handle may grow back
                self._replace(slots, need)
            with self._lock:
                exts = [self._pages[h] for h in slots]
            blocks = [b for e in exts for b in block_list(e)]
            buf: np.ndarray | None = None
            if staged is None and not any(lossy) and width == self.slot_bytes:
                packed = src.reshape(n * bpp, ALIGN)  # raw pages of whole blocks: straight from the caller
            else:
                packed, buf = self._pack(src, staged, sizes, need, lossy, plain)
        finally:
            self._give(staging)
        coded = (int(sizes.sum()), len(plain) * width) if sizes is not None else (0, 0)
        return blocks, packed, coded, buf

    def _timed_write(self, blocks: list[int], packed: np.ndarray) -> None:
        start = time.perf_counter()
        self.blocks.write(blocks, packed)
        self.choice.meter.note(Direction.WRITE, packed.nbytes, time.perf_counter() - start)

    def _replace(self, slots: Sequence[int], need: list[int]) -> None:
        """Swap each page's worst-case reservation for exactly ``need[i]`` blocks, lowest run
        first: released first, so the batch packs into one run where the room allows."""
        with self._lock:
            held = [run for h in slots for run in self._pages[h]]
            nheld = sum(count for _, count in held)
            if sum(need) - nheld > self.blocks.num_free:
                raise CapacityError(f"rewriting {len(slots)} pages needs {sum(need)} blocks; they hold "
                                    f"{nheld} and {self.blocks.num_free} more are free")
            self.blocks.free_runs(held)
            start = self.blocks.allocate_run(sum(need))   # the batch in one run where there is one
            if start is None:
                self._place_each(slots, need)
                return
            for h, k in zip(slots, need):
                self._pages[h] = ((start, k),)
                start += k

    def _pack(self, src: np.ndarray, staged: np.ndarray | None, sizes: np.ndarray | None,
              need: list[int], lossy: list[int], plain: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """One buffer of whole blocks, page after page, and the scratch buffer it lies in;
        tails zeroed so no stale bytes (a reused buffer's) reach the medium. ``staged[j]``
        (``sizes[j]`` bytes) codes row ``plain[j]``."""
        total = sum(need) * ALIGN
        buf = self._scratch.take(total)
        packed = buf[:total]
        off = 0
        bpp = self.blocks_per_page
        coded = {i: j for j, i in enumerate(plain)}
        for i, k in enumerate(need):
            if lossy[i] and k < bpp:
                row, length = src[i], lossy[i]
            elif k < bpp:
                assert staged is not None and sizes is not None
                row, length = staged[coded[i]], int(sizes[coded[i]])
            else:
                row, length = src[i], src.shape[1]
            packed[off:off + length] = row[:length]
            packed[off + length:off + k * ALIGN] = 0
            off += k * ALIGN
        return packed.reshape(-1, ALIGN), buf

    def _read(self, slots: Sequence[int], dst: np.ndarray) -> None:
        self._read_pages(slots, dst, None)

    def _read_checksummed(self, slots: Sequence[int], dst: np.ndarray) -> list[int]:
        sums: list[int] = []
        self._read_pages(slots, dst, sums)
        return sums

    def _read_pages(self, slots: Sequence[int], dst: np.ndarray, sums: list[int] | None) -> None:
        """Reads the pages into ``dst`` (and their checksums into ``sums``, when given).

        Batches of coded pages are pipelined: groups of about 4 MiB of blocks, the next
        group read on this tier's reader thread while this one is decoded and checked
        here, so a read costs about the longer of moving the blocks and decoding them,
        not their sum. A group that does not decode is noted and the rest still read:
        UndecodablePageError names every such row once all have been read.
        """
        n, width = dst.shape
        if n == 0:
            return
        bpp = self.blocks_per_page
        with self._lock:
            exts = [self._pages.get(h) or self._retired[h] for h in slots]
        counts = [extent_blocks(e) for e in exts]
        if width == self.slot_bytes and all(c == bpp for c in counts):
            blocks = [b for e in exts for b in block_list(e)]
            self._timed_read(blocks, dst.reshape(n * bpp, ALIGN))  # raw pages of whole blocks: no staging
            if sums is not None:
                sums.extend(checksum_rows(dst))
            return
        groups = _groups(counts, _GROUP_BLOCKS)

        def fetch(g: int) -> tuple[np.ndarray, np.ndarray]:
            """Group g's blocks, and the scratch buffer they lie in."""
            a, b = groups[g]
            blocks = [blk for e in exts[a:b] for blk in block_list(e)]
            whole = self._scratch.take(len(blocks) * ALIGN)
            buf = whole[:len(blocks) * ALIGN].reshape(-1, ALIGN)
            self._timed_read(blocks, buf)
            return buf, whole

        failed: list[int] = []
        reasons: list[str] = []
        pending: Future[tuple[np.ndarray, np.ndarray]] | None = None
        try:
            for g, (a, b) in enumerate(groups):
                buf, whole = pending.result() if pending is not None else fetch(g)
                pending = self._submit(fetch, g + 1) if g + 1 < len(groups) else None
                bad, reason = self._unpack(buf, counts[a:b], dst[a:b])
                failed.extend(a + i for i in bad)
                reasons.extend([reason] if reason else [])
                if sums is not None:
                    sums.extend(checksum_rows(dst[a:b]))
                self._scratch.give(whole)   # decoded and copied out: nothing refers to it
        finally:
            if pending is not None:   # no read outlives the call, even on an error here
                wait([pending])
        if failed:
            raise UndecodablePageError(f"{self.name} tier: {len(failed)} stored pages do not decode ({reasons[0]})",
                                       tuple(failed))

    def _submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Runs ``fn`` on the thread that moves a pipelined batch's next group (reads) or
        last one (writes); StoreClosedError once the tier is closed. Where the pool takes
        no more work while the tier is open (once the main thread has returned,
        concurrent.futures refuses it: a store closed from an atexit handler) ``fn`` runs
        here, before this returns, and the batch goes unpipelined."""
        with self._lock:
            if self._closed:
                raise StoreClosedError(f"{self.name} tier is closed")
            if self._io_pool is None:
                self._io_pool = ThreadPoolExecutor(1, thread_name_prefix=f"tierkv-{self.name}-pipeline")
            try:
                return self._io_pool.submit(fn, *args)
            except RuntimeError:   # shut down: by a close on another thread, or at interpreter exit
                pass
        if self._closed:
            raise StoreClosedError(f"{self.name} tier is closed")
        done: Future[T] = Future()
        settle(done, lambda: fn(*args))
        return done

    def _unpack(self, packed: np.ndarray, counts: Sequence[int], dst: np.ndarray) -> tuple[list[int], str]:
        """Pages of ``dst`` from their blocks in ``packed``: raw ones copied, lossy blobs
        copied with zeros after them, coded ones decoded. Returns the rows that did not
        decode and the codec's reason for the first."""
        width, bpp = dst.shape[1], self.blocks_per_page
        flat = packed.reshape(-1)
        coded: list[int] = []
        blobs: list[np.ndarray] = []
        off = 0
        for i, c in enumerate(counts):
            if c < bpp and flat[off:off + 2].tobytes() == LOSSY_MAGIC:   # a lossy page's blob: then zeros
                size = min(c * ALIGN, width)
                dst[i, :size] = flat[off:off + size]
                dst[i, size:] = 0
            elif c < bpp:
                coded.append(i)
                blobs.append(flat[off:off + c * ALIGN])
            else:
                dst[i] = flat[off:off + width]
            off += c * ALIGN
        return self._decode(coded, blobs, dst) if coded else ([], "")

    def _timed_read(self, blocks: list[int], buf: np.ndarray) -> None:
        start = time.perf_counter()
        self.blocks.read(blocks, buf)
        self.choice.meter.note(Direction.READ, len(blocks) * ALIGN, time.perf_counter() - start)

    def _decode(self, coded: list[int], blobs: list[np.ndarray], dst: np.ndarray) -> tuple[list[int], str]:
        codec = self.choice.codec
        if codec is None:
            return list(coded), "the tier holds coded pages but has no codec"
        whole = dst.shape[1] == self.page_bytes and len(coded) == dst.shape[0]
        out = dst if whole else np.empty((len(coded), self.page_bytes), dtype=np.uint8)
        report = codec.decode_into(blobs, out)
        if not whole:
            width = min(dst.shape[1], self.page_bytes)
            for j, i in enumerate(coded):
                if j not in report.failed:
                    dst[i, :width] = out[j, :width]
                    dst[i, width:] = 0  # a slot-wide read: a page's padding is zeros, as raw pages store it
        return [coded[j] for j in report.failed], (report.reasons[0] if report.failed else "")

    def _close(self) -> None:
        with self._lock:
            pool, self._io_pool = self._io_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._scratch.clear()
        self.blocks.close()
        if self.choice.codec is not None:
            self.choice.codec.close()
