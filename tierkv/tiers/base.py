"""The tier interface every storage tier implements, and its shared helpers.

A tier stores pages of up to ``slot_bytes`` bytes on one medium (HBM, DRAM, a file or
block device, an NVMe-oF namespace). ``allocate`` hands out *handles*, one per page
to store; ``write``/``read`` move bytes between caller buffers and the pages of those
handles; ``free`` gives them back. On a slot-addressed tier a handle is a slot index
``0 .. num_slots-1``; on a block-addressed tier (:mod:`tierkv.tiers.blocks`) it is an
opaque number. Callers address pages only by handles the tier handed out (``allocate``,
or ``claim``/``claim_extents`` when reopening a persistent tier). A tier never decides
which page goes where (that is the manager's job) and knows nothing of keys. Called by
:mod:`tierkv.store.transfer` through the copy table, and by the conformance suite in
``tests/tiers``, which every tier passes.

A tier has a ``kind`` (its medium: what the copy table dispatches on) and a ``name``
(its identity in a store: the manager, the index and the stats tell tiers apart by it;
two tiers of one kind, two NVMe drives say, have different names).

Buffers are numpy ``uint8`` arrays of shape ``(n, page_bytes)`` (C-contiguous rows), or
for writes a :class:`~tierkv.store.pages.PageList` of separate pages; ``page_bytes <= slot_bytes``.
``read`` and ``write`` can also return each row's checksum (``checksums=True``), which
the persistent tiers compute on their I/O threads. Thread-safety: ``allocate``/``free``/``claim`` are safe
from any thread; ``read``/``write`` of disjoint handles may run concurrently from any threads.
I/O is synchronous: a caller that wants it in the background runs it on its own pool.
"""

from __future__ import annotations

import abc
import enum
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, NewType, Self, SupportsIndex, overload

import numpy as np

from tierkv.store.checksum import checksum64, checksum_rows
from tierkv.errors import CapacityError, InputError, StoreClosedError
from tierkv.store.pages import PageList
from tierkv.tiers.aligned import aligned_empty


# Runs of 4 KiB blocks ``(first block, count)`` holding one page on a block-addressed tier.
Extents = tuple[tuple[int, int], ...]


class TierKind(enum.Enum):
    """Tiers from fastest to slowest; ``rank`` orders them (0 is the fastest)."""

    rank: int

    def __new__(cls, value: str, rank: int) -> TierKind:
        member = object.__new__(cls)
        member._value_ = value
        member.rank = rank
        return member

    # Members are singletons compared by identity: hash them in C too, since tier kinds
    # key the manager's per-page dictionaries (Enum's own __hash__ is Python code).
    __hash__ = object.__hash__

    HBM = ("hbm", 0)
    DRAM = ("dram", 1)
    NVME = ("nvme", 2)
    NVMEOF = ("nvmeof", 3)
    # Another node's DRAM tier, one network hop away (tierkv.tiers.peer.PeerDramTier). Never
    # a tier of this store: the pages a get loaded from peers are counted under it.
    PEER = ("peer", 4)


# A tier's identity in a store: its name. The manager, the index (one LMDB database,
# geometry and label record per name) and the stats tell tiers apart by it; the copy
# table dispatches on the kind. A tier built without a name is named after its kind,
# which is what every store written before tiers had names used, so those reopen unchanged.
TierId = NewType("TierId", str)
_TIER_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# Not a tier's name: the end of a "src->dst" pair that stands for a caller's buffers, and
# the index's database of store metadata (a tier's records would land in it).
_RESERVED_NAMES = frozenset({"caller", "meta"})


def tier_id(name: str) -> TierId:
    """``name`` as a TierId: 1-32 of ``a-z 0-9 _ -``, starting with a letter, not ``caller``
    (it names index databases, metric labels and ``src->dst`` pairs); InputError otherwise."""
    if not isinstance(name, str) or not _TIER_NAME.fullmatch(name) or name in _RESERVED_NAMES:
        raise InputError(f"a tier name is 1-32 characters of a-z, 0-9, '_' or '-', starting with a letter, "
                         f"and not {', '.join(sorted(_RESERVED_NAMES))}; got {name!r}")
    return TierId(name)


class SlotList(list):  # type: ignore[type-arg]
    """The slots an allocation handed out: a list of ints that also carries them as a
    read-only int64 array, which ``numpy.asarray`` returns without converting the list
    again (a 256-slot put converted it four times, 4.5 us each: in the DRAM tier's copy
    registration, its slot check and its copy, and the page table's slot column). Any
    change to the list through its methods drops the array, which is then converted from
    the list as a plain list's would be (a change made by ``list``'s own methods called
    unbound, ``list.sort(slots)`` or ``heapq``, is not seen: nothing here does that)."""

    __slots__ = ("_array",)

    def __init__(self, slots: np.ndarray | Iterable[int] = ()) -> None:
        if isinstance(slots, np.ndarray):
            super().__init__(slots.tolist())
            array = np.array(slots, dtype=np.int64)
            array.flags.writeable = False
            self._array: np.ndarray | None = array
        else:   # any iterable, as list() takes (dataclasses.asdict, type(slots)(...))
            super().__init__(slots)
            self._array = None

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        array = self._array
        fresh = array is None or len(array) != len(self)
        if fresh:   # as numpy converts a plain list: a float stays a float, for the checks to refuse
            array = np.array(list(self))
        assert array is not None
        cast = dtype is not None and array.dtype != dtype
        if copy is False and (fresh or cast):
            raise ValueError("SlotList: numpy asked for its slots without a copy, and that needs one")
        if cast:
            return array.astype(dtype)
        return array.copy() if copy else array

    def _changed(self) -> None:
        self._array = None

    def __setitem__(self, key: Any, value: Any) -> None:
        self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._changed()
        super().__delitem__(key)

    def __iadd__(self, other: Iterable[int]) -> Self:  # type: ignore[misc,override]
        self._changed()
        return super().__iadd__(other)

    def __imul__(self, n: SupportsIndex) -> Self:
        self._changed()
        return super().__imul__(n)

    def __reduce__(self) -> tuple[type, tuple[list[int]]]:
        return list, (list(self),)   # pickled (to another process) as the plain list it is


def _changing(name: str) -> Callable[..., object]:
    method = getattr(list, name)

    def changing(self: SlotList, *args: object, **kwargs: object) -> object:
        self._changed()
        return method(self, *args, **kwargs)

    changing.__name__ = name
    return changing


for _name in ("append", "extend", "insert", "pop", "remove", "sort", "reverse", "clear"):
    setattr(SlotList, _name, _changing(_name))


class SlotAllocator:
    """A thread-safe free map of slot indices ``0 .. num_slots-1``.

    Hands out the lowest free slots first so that file-backed tiers stay compact;
    ``contiguous=True`` asks for the lowest run of consecutive free slots instead
    (first fit), falling back to the lowest free ones when no run is long enough.
    One byte per slot; every operation is a C scan of that map (``bytearray.find``),
    so block-granular tiers with millions of slots stay cheap.
    """

    def __init__(self, num_slots: int) -> None:
        self._lock = threading.Lock()
        self._num_slots = num_slots
        self._used = bytearray(num_slots)
        self._num_free = num_slots
        self._low = 0  # no free slot below this index

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, n: int, contiguous: bool = False) -> list[int]:
        with self._lock:
            if n > self._num_free:
                raise CapacityError(f"asked for {n} slots, {self._num_free} of {self._num_slots} free")
            if n <= 0:
                return []
            low = self._low
            # Every free slot is at or above the low mark, n of them at least: where the n
            # from the mark on are all free, they are both asks' answer. (The bound holds
            # by that; checked all the same, since a slice past the end would grow the map.)
            if low + n <= self._num_slots and self._used.find(1, low, low + n) < 0:
                start = low
            else:
                start = self._used.find(bytes(n), low) if contiguous and n > 1 else -1
            if start >= 0:
                slots = SlotList(np.arange(start, start + n, dtype=np.int64))
                self._used[start:start + n] = b"\x01" * n
            else:  # the lowest free slots: scan a window from the low mark, wider until it holds n
                used = np.frombuffer(self._used, dtype=np.uint8)
                width = max(4 * n, 4096)
                while True:
                    free = np.flatnonzero(used[self._low:self._low + width] == 0)
                    if len(free) >= n or self._low + width >= self._num_slots:
                        break
                    width *= 4
                picked = free[:n] + self._low
                used[picked] = 1
                del used  # the bytearray cannot resize while a view is exported
                slots = SlotList(picked)
            self._num_free -= n
            if slots[0] == self._low:
                self._low = self._advance(self._low)
            return slots

    def allocate_run(self, n: int, at: int = 0) -> int | None:
        """Reserve the lowest run of ``n`` consecutive free slots from slot ``at`` on; its
        first slot, or None (nothing reserved) where no run is that long."""
        with self._lock:
            if n <= 0 or n > self._num_free:
                return None
            start = self._used.find(bytes(n), max(self._low, at))
            if start < 0:
                return None
            self._used[start:start + n] = b"\x01" * n
            self._num_free -= n
            if start == self._low:
                self._low = self._advance(self._low)
            return start

    def free(self, slots: Sequence[int]) -> None:
        """Free ``slots``; all or nothing: a slot out of range, free already or named
        twice raises InputError and frees none."""
        with self._lock:
            if len(slots) > 32:   # a page's blocks, an eviction's pages: checked and freed in bulk
                arr = np.asarray(slots, dtype=np.int64)
                bad = arr[(arr < 0) | (arr >= self._num_slots)]
                if len(bad):
                    self._check(int(bad[0]))
                uniq = np.unique(arr)
                if len(uniq) < len(arr):
                    srt = np.sort(arr)
                    raise InputError(f"slot {int(srt[1:][srt[1:] == srt[:-1]][0])} freed twice")
                used = np.frombuffer(self._used, dtype=np.uint8)
                try:
                    free_now = uniq[used[uniq] == 0]
                    if len(free_now):
                        raise InputError(f"slot {int(free_now[0])} freed twice")
                    used[uniq] = 0
                finally:
                    del used  # the bytearray cannot resize while a view is exported
                self._num_free += len(uniq)
                self._low = min(self._low, int(uniq[0]))
                return
            for s in slots:
                self._check(s)
                if not self._used[s]:
                    raise InputError(f"slot {s} freed twice")
            seen: set[int] = set()
            for s in slots:
                if s in seen:
                    raise InputError(f"slot {s} freed twice")
                seen.add(s)
            for s in slots:
                self._used[s] = 0
                self._num_free += 1
                if s < self._low:
                    self._low = s

    def free_runs(self, runs: Sequence[tuple[int, int]]) -> None:
        """Free the slots of ``runs`` ``(first, count)``; all or nothing, as :meth:`free`."""
        with self._lock:
            order = sorted(runs)
            end = -1
            for first, count in order:
                if count <= 0:
                    raise InputError(f"a run of slots needs a positive count, got ({first}, {count})")
                self._check(first)
                self._check(first + count - 1)
                hole = self._used.find(0, first, first + count)
                if first < end or hole >= 0:
                    raise InputError(f"slot {hole if hole >= 0 else first} freed twice")
                end = first + count
            for first, count in order:
                self._used[first:first + count] = bytes(count)
                self._num_free += count
            if order:
                self._low = min(self._low, order[0][0])

    def claim(self, slots: Sequence[int]) -> None:
        """Mark specific slots used (reopening a persistent tier)."""
        want = np.asarray(slots, dtype=np.int64)
        with self._lock:  # all or nothing: a bad claim leaves the map as it was
            bad = want[(want < 0) | (want >= self._num_slots)]
            if len(bad):
                self._check(int(bad[0]))
            used = np.frombuffer(self._used, dtype=np.uint8)
            uniq, counts = np.unique(want, return_counts=True)
            twice = uniq[(counts > 1) | (used[uniq] != 0)]
            if len(twice):
                raise InputError(f"slot {int(twice[0])} claimed twice")
            used[uniq] = 1
            del used  # the bytearray cannot resize while a view is exported
            self._num_free -= len(uniq)
            self._low = self._advance(self._low)

    def _advance(self, at: int) -> int:
        nxt = self._used.find(0, at)
        return self._num_slots if nxt < 0 else nxt

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self._num_slots:
            raise InputError(f"slot {slot} out of range [0, {self._num_slots})")


class Tier(abc.ABC):
    """One storage tier: pages of up to ``slot_bytes`` bytes, addressed by handles.

    Subclasses implement ``_read`` and ``_write`` (and may override ``flush`` and
    ``_close``). Failures raise :class:`~tierkv.errors.TierIOError`; bad input raises
    :class:`~tierkv.errors.InputError`, any use after ``close`` StoreClosedError.
    """

    kind: TierKind
    name: TierId
    persistent: bool = False
    # Slots are handles of pages stored in runs of 4 KiB blocks (tierkv.tiers.blocks).
    block_addressed: bool = False
    # The address alignment of a caller's rows that this tier reads into (and writes
    # from) in place; rows aligned less are copied through its own buffers.
    mem_align: int = 4096

    def __init__(self, num_slots: int, slot_bytes: int, *, name: str | None = None) -> None:
        """``name``: the tier's identity in a store (default: its kind's name, see TierId)."""
        if num_slots < 0 or slot_bytes <= 0:
            raise InputError(f"tier needs num_slots >= 0 and slot_bytes > 0, got {num_slots}, {slot_bytes}")
        self.name = tier_id(name) if name is not None else TierId(self.kind.value)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        try:
            self._slots = SlotAllocator(num_slots)   # a byte per slot
        except (MemoryError, OverflowError):
            self._closed = True
            raise CapacityError(f"{self.name} tier: cannot keep the free map of {num_slots:,} slots of {slot_bytes} "
                                f"bytes ({num_slots * slot_bytes:,} bytes in all) in memory; lower its "
                                "capacity_bytes") from None
        self._closed = False

    # -- slot bookkeeping -------------------------------------------------------
    @property
    def available(self) -> bool:
        """Whether the tier serves I/O now. Local tiers always do while open; a fabric
        tier is unavailable while degraded (its pages are misses, nothing lands there)."""
        return not self._closed

    def codec_state(self) -> dict[str, object] | None:
        """The tier's codec choice and its reason for ``stats()`` (block-addressed tiers:
        :meth:`tierkv.store.coding.CodecChoice.describe`); None where no codec applies."""
        return None

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    def allocate(self, n: int, contiguous: bool = False) -> list[int]:
        """Reserve ``n`` free slots, lowest first (``contiguous``: the lowest run of ``n``
        consecutive ones where there is one); raises CapacityError when fewer are free."""
        self._check_open()
        return self._slots.allocate(n, contiguous)

    def allocate_run(self, n: int, at: int = 0) -> int | None:
        """Reserve the lowest run of ``n`` consecutive free slots from slot ``at`` on: its
        first slot, or None (nothing reserved) where there is none."""
        self._check_open()
        return self._slots.allocate_run(n, at)

    def free(self, slots: Sequence[int]) -> None:
        self._check_open()
        self._slots.free(slots)

    def free_runs(self, runs: Sequence[tuple[int, int]]) -> None:
        """Free the slots of ``runs`` ``(first, count)``, all or nothing."""
        self._check_open()
        self._slots.free_runs(runs)

    def claim(self, slots: Sequence[int]) -> None:
        """Mark slots that a persistent index already owns as used."""
        self._check_open()
        self._slots.claim(slots)

    def extents(self, slot: int) -> Extents | None:
        """The 4 KiB block runs a page occupies on a block-addressed tier (recorded in the
        index so a restart can claim them back); None on slot-addressed tiers."""
        return None

    def claim_extents(self, extents: Extents) -> int:
        """Claim the blocks of a page recorded at an earlier open; returns its slot handle.
        Only block-addressed tiers (:mod:`tierkv.tiers.blocks`) support it."""
        raise InputError(f"the {self.name} tier is slot-addressed; it cannot claim block extents")

    # -- data movement ------------------------------------------------------------
    @overload
    def write(self, slots: Sequence[int], src: np.ndarray | PageList, *,
              checksums: Literal[False] = False) -> None: ...

    @overload
    def write(self, slots: Sequence[int], src: np.ndarray | PageList, *, checksums: Literal[True]) -> list[int]: ...

    @overload
    def write(self, slots: Sequence[int], src: np.ndarray | PageList, *, checksums: bool) -> list[int] | None: ...

    def write(self, slots: Sequence[int], src: np.ndarray | PageList, *, checksums: bool = False) -> list[int] | None:
        """Copy row ``i`` of ``src`` into slot ``slots[i]``.

        ``src`` is a batch, or a :class:`~tierkv.store.pages.PageList` of separate pages (DRAM and
        NVMe tiers take each page from where it is; the others stack them once).
        ``checksums``: also return the xxh3-64 of each row written; tiers that move chunks on
        several threads hash each chunk on the thread that moved it, overlapping the rest's I/O.
        """
        if isinstance(src, PageList):
            self._check_rows(slots, src)
        else:
            self._check_io(slots, src)
        if checksums:
            return self._write_checksummed(slots, src)
        if isinstance(src, PageList):
            self._write_rows(slots, src)
        else:
            self._write(slots, src)
        return None

    @overload
    def read(self, slots: Sequence[int], dst: np.ndarray, *, checksums: Literal[False] = False) -> None: ...

    @overload
    def read(self, slots: Sequence[int], dst: np.ndarray, *, checksums: Literal[True]) -> list[int]: ...

    @overload
    def read(self, slots: Sequence[int], dst: np.ndarray, *, checksums: bool) -> list[int] | None: ...

    def read(self, slots: Sequence[int], dst: np.ndarray, *, checksums: bool = False) -> list[int] | None:
        """Copy slot ``slots[i]`` into row ``i`` of ``dst`` (first ``dst.shape[1]`` bytes).

        ``checksums``: also return the xxh3-64 of each row read (what a verified read
        compares), hashed per chunk on the I/O threads where the tier has them.
        """
        self._check_io(slots, dst)
        self._check_writable(dst)
        if checksums:
            return self._read_checksummed(slots, dst)
        self._read(slots, dst)
        return None

    def reads_ranges(self, start: int, stop: int, dst: np.ndarray) -> bool:
        """Whether :meth:`read_range` can read bytes ``start .. stop-1`` of pages into
        ``dst`` (a tier that stores pages as they are, with any alignment it needs met)."""
        return False

    def read_range(self, slots: Sequence[int], dst: np.ndarray, start: int, stop: int) -> None:
        """Copy bytes ``start .. stop-1`` of slot ``slots[i]``'s page into ``dst[i, start:stop]``
        (the rest of ``dst`` is left as it is). Nothing is verified: a caller that reads a
        persistent tier in ranges checks whole pages once every range has landed."""
        self._check_io(slots, dst)
        self._check_writable(dst)
        if not 0 <= start < stop <= dst.shape[1]:
            raise InputError(f"a byte range of a page must lie in [0, {dst.shape[1]}], got {start}..{stop}")
        if not self.reads_ranges(start, stop, dst):
            raise InputError(f"the {self.name} tier cannot read bytes {start}..{stop} of its pages into this buffer "
                             "(it stores them encoded, or the range or buffer is not aligned for its I/O)")
        self._read_range(slots, dst, start, stop)

    def _read_range(self, slots: Sequence[int], dst: np.ndarray, start: int, stop: int) -> None:
        raise NotImplementedError

    def read_ranges(self, slots: Sequence[int], dst: np.ndarray, ranges: Sequence[tuple[int, int]],
                    after: Callable[[int], None]) -> None:
        """:meth:`read_range` for each of ``ranges`` in turn, calling ``after(k)`` once range
        ``k`` of every page has landed (a tier with I/O threads overlaps the ranges' reads,
        still calling ``after`` in order). The first failure is raised; ranges announced
        before it stay announced."""
        for k, (start, stop) in enumerate(ranges):
            self.read_range(slots, dst, start, stop)
            after(k)

    def flush(self) -> None:
        """Make every completed write durable (no-op for volatile tiers)."""
        self._check_open()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- for subclasses -------------------------------------------------------------
    @abc.abstractmethod
    def _write(self, slots: Sequence[int], src: np.ndarray) -> None: ...

    @abc.abstractmethod
    def _read(self, slots: Sequence[int], dst: np.ndarray) -> None: ...

    def _read_checksummed(self, slots: Sequence[int], dst: np.ndarray) -> list[int]:
        self._read(slots, dst)
        return checksum_rows(dst)

    def _write_checksummed(self, slots: Sequence[int], src: np.ndarray | PageList) -> list[int]:
        if isinstance(src, PageList):
            self._write_rows(slots, src)
            return [checksum64(row) for row in src]
        self._write(slots, src)
        return checksum_rows(src)

    def _write_rows(self, slots: Sequence[int], rows: PageList) -> None:
        """Separate pages: stacked once into an aligned batch, then ``_write``. Tiers that
        copy page by page anyway override it to take each page from where it is."""
        if not len(rows):
            return
        n, width = rows.shape
        self._write(slots, rows.stacked(aligned_empty(n * width).reshape(n, width)))

    def _close(self) -> None:
        """Release the medium; called once by ``close``."""

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.name} tier is closed")

    @staticmethod
    def _check_writable(dst: np.ndarray) -> None:
        if not dst.flags.writeable:
            raise InputError("tier read destination is a read-only buffer")

    def _check_io(self, slots: Sequence[int], buf: np.ndarray) -> None:
        self._check_open()
        if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 2:
            raise InputError(f"tier I/O buffer must be a 2-D uint8 numpy array, got {type(buf).__name__}"
                             f" {getattr(buf, 'dtype', '')} {getattr(buf, 'shape', '')}")
        if buf.shape[0] != len(slots):
            raise InputError(f"{len(slots)} slots but a buffer of {buf.shape[0]} rows")
        if buf.shape[1] > self.slot_bytes:
            raise InputError(f"rows of {buf.shape[1]} bytes exceed the slot size of {self.slot_bytes}")
        if not buf.flags.c_contiguous:
            raise InputError("tier I/O buffer must be C-contiguous")
        self._check_slots(slots)

    def _check_rows(self, slots: Sequence[int], rows: PageList) -> None:
        self._check_open()
        width = rows.shape[1]
        if len(rows) != len(slots):
            raise InputError(f"{len(slots)} slots but {len(rows)} pages")
        if width > self.slot_bytes:
            raise InputError(f"rows of {width} bytes exceed the slot size of {self.slot_bytes}")
        for i, row in enumerate(() if rows.checked else rows):
            if (not isinstance(row, np.ndarray) or row.dtype != np.uint8 or row.shape != (width,)
                    or not row.flags.c_contiguous):
                raise InputError(f"page {i} of the list must be a C-contiguous uint8 array of {width} bytes, got "
                                 f"{type(row).__name__} {getattr(row, 'dtype', '')} {getattr(row, 'shape', '')}")
        self._check_slots(slots)

    def _check_slots(self, slots: Sequence[int]) -> None:
        if len(slots) > 16:   # many: one numpy pass (a Python loop took 30 us for 256), then name the first bad
            a = np.asarray(slots)
            if a.dtype.kind in "iu" and a.ndim == 1 and (not a.size or (int(a.min()) >= 0
                                                                        and int(a.max()) < self.num_slots)):
                return
        for s in slots:
            if not isinstance(s, (int, np.integer)):   # a float would be rounded by the copies' numpy paths
                raise InputError(f"slots are whole numbers, got {s!r}")
            if not 0 <= s < self.num_slots:
                raise InputError(f"slot {s} out of range [0, {self.num_slots})")
