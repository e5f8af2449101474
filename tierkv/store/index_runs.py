"""The index of a slot-addressed persistent tier as *runs*: one LMDB record per commit.

Format 3 kept one LMDB record per page, keyed by the page's key. Keys are hashes, so
every insert landed on a random leaf of the B-tree: 2.5-3 us a record, a 4 KiB page
dirtied per record, and the whole tree (about 130 bytes a page) resident in every
process that used it. At node scale (tens of millions of pages) that was most of the
store's memory and of its put cost. The pages of a slot tier are held in memory by the
page table anyway (``tierkv.store.table``); the index only has to let a restart rebuild
that, and let a read-only process find what the writer committed. So each commit (one
batch, or one group-commit window) is written as one record, appended:

- key: the run's id, 8 bytes big-endian (ids grow with every commit: appends);
- value: ``b"TKR1"``, the number of deletes and of records (u32 each), the deleted
  keys (16 bytes each), the records' keys (16 bytes each), the records (each the
  45-byte value format 3 stored per key: slot, length, checksum, parent, has-parent,
  its seal), then the seal of the run: xxh3-64 of the run's key and everything before
  it, as every other record of the index ends.

Within a run deletes come before records, as in a per-key commit. Replaying the runs
in id order gives the tier's pages: a record is live when nothing later names its key
(a delete, or another record) and no later record names its slot (the slot was reused:
its bytes are another page's). A crash between a slot's reuse and the commit naming
the new page leaves the old record live and its checksum failing: a miss, never wrong
bytes, as before.

Garbage (records deleted or superseded, and the deletes themselves) stays in the runs
until *compaction* (:meth:`tierkv.store.manager.BlockManager` drives it): when a tier's
runs hold more than ``2 * live + COMPACT_MIN`` entries, the oldest runs (about
``COMPACT_CHUNK`` entries) are read, their records the page table still holds at the
same slot with the same checksum are written as one new run, and the old runs are
deleted, in one durable transaction after every buffered commit is durable; again,
up to the run that was newest when it began, while the runs are over the bound. Since
compaction takes the oldest runs, no record older than theirs remains, so their
deletes can go.

A damaged run (its seal fails, or its lengths do) cannot say what it deleted, so
every run up to it, and the per-key records of an older format, are dropped: those
pages are misses, and nothing that run deleted comes back.

Run ids are never reused (a rewrite that keeps nothing leaves an empty run with the
next id): a reader takes a new oldest id for a compaction. Read-only processes keep a
:class:`RunsView`: columns replayed at once, plus the runs committed since they last
looked, applied one by one (replayed afresh after a compaction removed runs).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import xxhash

from tierkv.keys import KEY_BYTES, PageKey
from tierkv.store.index import (_RUN_HEAD, _RUN_ID, _RUN_MAGIC, _SEAL, RECORD_BYTES, RELEASE_BYTES, IndexRecord,
                                PersistentIndex, run_events)
from tierkv.store.index_scan import RECORD_DTYPE, RecordArrays
from tierkv.store.resident import trim_heap

log = logging.getLogger(__name__)

#: Compaction starts once a tier's runs hold more than 2 * live + this many entries.
COMPACT_MIN = 65536
#: About this many entries (records and deletes) are read per compaction: the new run
#: and the transaction's dirty pages stay bounded (LMDB keeps a transaction's dirty
#: pages in memory, and refuses more than about 512 MiB of them).
COMPACT_CHUNK = 262144


#: A reader that replays this many runs at once gives the freed heap back afterwards.
_TRIM_RUNS = 256


@dataclass
class Run:
    """One decoded run: its key (its id, big-endian), the keys it deleted (a blob), its
    records' keys (a blob) and records (RECORD_DTYPE)."""

    key: bytes
    deletes: bytes
    keys: bytes
    records: np.ndarray

    @property
    def events(self) -> int:
        return len(self.deletes) // KEY_BYTES + len(self.records)


def unpack_run(key: bytes, value: bytes | memoryview) -> Run | None:
    """Decode a stored run; None if it is damaged (length, magic or seal wrong)."""
    value = bytes(value)
    key = bytes(key)
    if len(key) != _RUN_ID.size or len(value) < _RUN_HEAD.size + _SEAL.size:
        return None
    magic, nd, np_ = _RUN_HEAD.unpack_from(value)
    if magic != _RUN_MAGIC or len(value) != _RUN_HEAD.size + nd * KEY_BYTES + np_ * (KEY_BYTES + RECORD_BYTES) + _SEAL.size:
        return None
    (seal,) = _SEAL.unpack_from(value, len(value) - _SEAL.size)
    if seal != xxhash.xxh3_64_intdigest(key + value[:-_SEAL.size]):
        return None
    at = _RUN_HEAD.size
    dels = value[at:at + nd * KEY_BYTES]
    at += nd * KEY_BYTES
    keys = value[at:at + np_ * KEY_BYTES]
    at += np_ * KEY_BYTES
    recs = np.frombuffer(value, dtype=RECORD_DTYPE, count=np_, offset=at)
    return Run(key, dels, keys, recs)


def _arrays(keys: bytes, recs: np.ndarray) -> RecordArrays:
    return RecordArrays(keys, recs["slot"].astype(np.uint64), recs["nbytes"].astype(np.uint32),
                        recs["checksum"].astype(np.uint64), recs["parent"].tobytes(), recs["has_parent"] == 1)


def _last_of_groups(sorted_a: np.ndarray, sorted_b: np.ndarray | None = None) -> np.ndarray:
    """Bool mask over sorted values: the last element of each run of equal values."""
    n = len(sorted_a)
    last = np.ones(n, dtype=bool)
    if n > 1:
        same = sorted_a[1:] == sorted_a[:-1]
        if sorted_b is not None:
            same &= sorted_b[1:] == sorted_b[:-1]
        last[:-1] = ~same
    return last


def replay(runs: list[Run], older: RecordArrays | None = None) -> RecordArrays:
    """The live records of ``runs`` (in id order), ``older`` (per-key records of an older
    format) counting as earlier than every run: each record whose key nothing later
    names and whose slot no later record names. Vectorized: two stable sorts."""
    key_parts: list[bytes] = []
    is_put: list[np.ndarray] = []
    if older is not None and len(older):
        key_parts.append(older.keys)
        is_put.append(np.ones(len(older), dtype=bool))
    for run in runs:
        key_parts += [run.deletes, run.keys]
        is_put += [np.zeros(len(run.deletes) // KEY_BYTES, dtype=bool), np.ones(len(run.records), dtype=bool)]
    with_records = [run for run in runs if len(run.records)]
    ran = _arrays(b"".join(r.keys for r in with_records),
                  np.concatenate([r.records for r in with_records])) if with_records else None
    puts = older.concat(ran) if older is not None and ran is not None else older if ran is None else ran
    if puts is None or not len(puts):
        return RecordArrays(b"", np.zeros(0, np.uint64), np.zeros(0, np.uint32), np.zeros(0, np.uint64), b"",
                            np.zeros(0, dtype=bool))
    events = np.frombuffer(b"".join(key_parts), dtype="<u8").reshape(-1, 2)
    put_event = np.flatnonzero(np.concatenate(is_put))
    # The last event of each key (stable sorts keep event order among equal keys).
    order = np.lexsort((events[:, 1], events[:, 0]))
    last = np.zeros(len(events), dtype=bool)
    last[order[_last_of_groups(events[order, 0], events[order, 1])]] = True
    live = last[put_event]
    # The last record of each slot.
    by_slot = np.argsort(puts.slot, kind="stable")
    newest = np.zeros(len(puts), dtype=bool)
    newest[by_slot[_last_of_groups(puts.slot[by_slot])]] = True
    live &= newest
    return puts if live.all() else puts.take(live)


class RunsView:
    """A read-only process's view of one tier's runs: key -> (slot, length, checksum,
    parent). A *base* of columns sorted by key, replayed from every run at once
    (:func:`replay`, vectorized; about 60 bytes a page), and a *delta* dict of what the
    runs committed since changed (:meth:`add`, one run at a time); once the delta passes a
    quarter of the base, or runs it had read are gone (a compaction removed them), the
    view is replayed afresh (:func:`view_records`). Not thread-safe: callers hold the
    store's lock (``Store._lead_from_index``)."""

    def __init__(self) -> None:
        self.first = b""       # the key of the oldest run when the view was (re)built
        self.last = b""        # the key of the last run applied
        self._hi = np.zeros(0, dtype=np.uint64)     # the base, sorted by key (hi, lo)
        self._lo = np.zeros(0, dtype=np.uint64)
        self._base = _arrays(b"", np.zeros(0, dtype=RECORD_DTYPE))
        self._alive = np.zeros(0, dtype=bool)
        self._slot_order = np.zeros(0, dtype=np.intp)   # base rows by slot
        self._delta: dict[bytes, tuple[int, int, int, bytes | None] | None] = {}
        self._slots: dict[int, bytes] = {}   # the delta's records: slot -> key

    def rebuild(self, runs: list[tuple[bytes, bytes]], first: bytes, last: bytes) -> None:
        """The base replayed from ``runs`` (every run, oldest first), the delta empty. A run
        that fails its seal drops itself and every run before it, as an open does."""
        live = replay(decode_runs(runs)[0])
        pairs = np.frombuffer(live.keys, dtype="<u8").reshape(-1, 2)
        order = np.lexsort((pairs[:, 1], pairs[:, 0]))
        self._hi, self._lo = pairs[order, 0].copy(), pairs[order, 1].copy()
        self._base = RecordArrays(b"", live.slot[order], live.nbytes[order], live.checksum[order],
                                  np.frombuffer(live.parents, dtype="V16")[order].tobytes(), live.has_parent[order])
        self._alive = np.ones(len(order), dtype=bool)
        self._slot_order = np.argsort(self._base.slot, kind="stable")
        self._delta.clear()
        self._slots.clear()
        self.first, self.last = first, last

    @property
    def stale(self) -> bool:
        """Whether the delta has grown past a quarter of the base (time to replay afresh)."""
        return len(self._delta) > max(4096, len(self._hi) // 4)

    def _base_rows(self, keys: bytes) -> np.ndarray:
        """Rows of the base holding ``keys`` (a blob), -1 where none."""
        if not keys or not len(self._hi):
            return np.full(len(keys) // KEY_BYTES, -1, dtype=np.intp)
        pairs = np.frombuffer(keys, dtype="<u8").reshape(-1, 2)
        n = len(self._hi)
        at = np.searchsorted(self._hi, pairs[:, 0])
        here = np.minimum(at, n - 1)
        same_hi = (at < n) & (self._hi[here] == pairs[:, 0])
        found = same_hi & (self._lo[here] == pairs[:, 1])
        out = np.where(found, here, -1)
        for i in np.flatnonzero(same_hi & ~found).tolist():   # rare: high halves equal, adjacent
            j = int(here[i]) + 1
            while j < n and self._hi[j] == pairs[i, 0]:
                if self._lo[j] == pairs[i, 1]:
                    out[i] = j
                    break
                j += 1
        return out

    def _drop_base_slots(self, slots: np.ndarray) -> None:
        if not len(self._slot_order):
            return
        # sorter=: no gather of the whole base per run (3 ms a run at 1M pages)
        lo = np.searchsorted(self._base.slot, slots, side="left", sorter=self._slot_order)
        hi = np.searchsorted(self._base.slot, slots, side="right", sorter=self._slot_order)
        for a, b in zip(lo.tolist(), hi.tolist()):
            self._alive[self._slot_order[a:b]] = False

    def add(self, run: Run | None, key: bytes) -> None:
        """Apply one run (None: a damaged one, which drops everything read before it)."""
        self.last = key
        if run is None:
            log.warning("index: a run of a tier fails its seal; the pages recorded up to it are misses")
            self._alive[:] = False
            self._delta.clear()
            self._slots.clear()
            return
        rows = self._base_rows(run.deletes + run.keys)
        self._alive[rows[rows >= 0]] = False             # deleted, or superseded by the delta
        recs = run.records
        self._drop_base_slots(recs["slot"].astype(np.uint64))   # slots reused
        for i in range(0, len(run.deletes), KEY_BYTES):
            dead = run.deletes[i:i + KEY_BYTES]
            gone = self._delta.get(dead)
            if gone is not None and self._slots.get(gone[0]) == dead:
                del self._slots[gone[0]]
            self._delta[dead] = None
        for i, (slot, nbytes, checksum, parent, has) in enumerate(zip(
                recs["slot"].tolist(), recs["nbytes"].tolist(), recs["checksum"].tolist(),
                recs["parent"].tolist(), recs["has_parent"].tolist())):
            page = run.keys[i * KEY_BYTES:(i + 1) * KEY_BYTES]
            before = self._delta.get(page)
            if before is not None and self._slots.get(before[0]) == page:
                del self._slots[before[0]]
            other = self._slots.get(slot)
            if other is not None and other != page:
                self._delta[other] = None
            self._delta[page] = (slot, nbytes, checksum, bytes(parent) if has == 1 else None)
            self._slots[slot] = page

    def get(self, key: bytes) -> tuple[int, int, int, bytes | None] | None:
        return self.get_many([bytes(key)])[0]

    def get_many(self, keys: list[bytes]) -> list[tuple[int, int, int, bytes | None] | None]:
        """:meth:`get` of each key, the base searched for all of them at once."""
        rows = self._base_rows(b"".join(keys)).tolist()
        b, alive, delta = self._base, self._alive, self._delta
        out: list[tuple[int, int, int, bytes | None] | None] = []
        for key, row in zip(keys, rows):
            if key in delta:
                out.append(delta[key])
            elif row < 0 or not alive[row]:
                out.append(None)
            else:
                parent = b.parents[row * KEY_BYTES:(row + 1) * KEY_BYTES] if b.has_parent[row] else None
                out.append((int(b.slot[row]), int(b.nbytes[row]), int(b.checksum[row]), parent))
        return out

    def __len__(self) -> int:
        return int(self._alive.sum()) + sum(v is not None for v in self._delta.values())

    def nbytes(self) -> int:
        """What the base's columns take (the delta is a dict, bounded by a quarter of it)."""
        b = self._base
        return (self._hi.nbytes + self._lo.nbytes + b.slot.nbytes + b.nbytes.nbytes + b.checksum.nbytes
                + len(b.parents) + b.has_parent.nbytes + self._alive.nbytes + self._slot_order.nbytes)


def decode_runs(raw: list[tuple[bytes, bytes]], tier: str = "a tier's") -> tuple[list[Run], bytes, int]:
    """Stored runs (key, value), oldest first, decoded; the key of the last damaged one
    (b"" if none), and how many records the runs up to it claimed. A damaged run drops
    itself and every run before it (see the module's docstring), logged."""
    runs: list[Run] = []
    damaged, lost = b"", 0
    for key, value in raw:
        run = unpack_run(key, value) if len(key) == _RUN_ID.size else None
        if run is None:
            lost += sum(len(r.records) for r in runs) + max(0, run_events(value))
            runs.clear()
            damaged = key
        else:
            runs.append(run)
    if damaged:
        log.warning("%s index: a run fails its seal; it and every earlier one are dropped (%d records): "
                    "those pages are misses", tier, lost)
    return runs, damaged, lost


def load_runs(index: PersistentIndex, tier: str) -> tuple[list[Run], bytes, int]:
    """:func:`decode_runs` of every run of ``tier``."""
    return decode_runs(index.read_runs(tier), tier)


def view_records(index: PersistentIndex, tier: str, keys: Iterable[bytes]) -> list[IndexRecord | None] | None:
    """A reader's records of ``keys`` from ``tier``'s runs (its view brought up to date
    first, in the same read transaction that finds whether there are any); None if the
    tier has no run (its records are per key: an older format's, or a block tier's)."""
    view = index._views.get(tier)
    if not isinstance(view, RunsView):
        view = index._views[tier] = RunsView()
    oldest, runs = index.runs_since(tier, view.first if not view.stale else b"", view.last)
    if not oldest:
        del index._views[tier]   # runs gone (carried into per-key records): a view would be stale
        return None
    read, many = sum(len(v) for _, v in runs), len(runs) >= _TRIM_RUNS
    if oldest != view.first or view.stale or not view.last:   # every run: replayed at once
        view.rebuild(runs, oldest, runs[-1][0] if runs else b"")
    else:
        for key, value in runs:
            view.add(unpack_run(key, value) if len(key) == _RUN_ID.size else None, key)
    del runs
    if read >= RELEASE_BYTES:
        index.release_map()
    if many:   # the runs' bytes, freed: below malloc's mmap threshold, kept resident otherwise
        trim_heap()
    return _records_of(view, keys)


def _records_of(view: RunsView, keys: Iterable[bytes]) -> list[IndexRecord | None]:
    wanted = [bytes(k) for k in keys]
    return [None if got is None else
            IndexRecord(PageKey(key), got[0], got[1], got[2], None if got[3] is None else PageKey(got[3]))
            for key, got in zip(wanted, view.get_many(wanted))]


def live_records(index: PersistentIndex, tier: str) -> RecordArrays:
    """The live records of ``tier``'s runs (replayed; damaged runs dropped as an open
    drops them): what a writer opening the index now would adopt, before it checks them
    against the tier. For checks and tools; changes nothing."""
    return replay(load_runs(index, tier)[0])
