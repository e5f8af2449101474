"""The persistent page index: LMDB records of the pages on persistent tiers.

One LMDB environment per store directory (``index.lmdb``), with a ``meta`` database
(store identity, layout and tier geometry) and one database per persistent tier
mapping a 16-byte page key to its slot, stored length, xxh3-64 checksum and parent
key. A tier's database, its geometry (``<name>_slots``) and its label record
(``labelled:<name>``) are named after the tier's name, which is its kind's name
(``nvme``, ``nvmeof``) unless it was given another: exactly what every store wrote
before tiers had names apart from their kinds, so those reopen unchanged. The manager
writes a record only *after* the page's data is written and flushed, in one
transaction with the deletes of the pages it evicted. A crash before
that commit can leave an evicted page's record pointing at a slot that already holds
newer bytes; the record's checksum then fails on the first read and the page is a
miss. So every record either points at the durable bytes of its key or is caught.
Readers in other processes open the same environment read-only.

With group commit (``[store] durability = "window"``, :meth:`PersistentIndex.group_commit`)
the manager's commits are buffered and applied once per window by
:mod:`tierkv.store.commits`: the data of every tier with new records is synced
first, then one synced transaction writes them, so the same holds; a crash loses the
records of the open window (misses), never more. Readers see only committed windows.

Thread-safety: LMDB transactions are serialized by the caller (the store lock), except
group commits, which run on their own thread (LMDB serializes write transactions);
read-only handles may be used from any thread.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import lmdb
import xxhash

from tierkv.errors import ConfigError, CorruptPageError, TierIOError, TierKVError
from tierkv.store.commits import GroupCommit, Ops
from tierkv.store.index_check import check_index_file, probe_index, was_clean
from tierkv.store.resident import dont_need, mapped_at
from tierkv.keys import KEY_BYTES, PageKey
from tierkv.tiers.aligned import MAX_PAGE_BLOCKS

_RECORD = struct.Struct("<QIQ16sB")  # slot, nbytes, checksum, parent, has_parent
# Block-addressed tiers append the page's block runs: a count, then (first block, blocks) each.
_EXTENT_COUNT = struct.Struct("<H")
_EXTENT = struct.Struct("<QI")
#: The most block runs a record can name (its count field).
MAX_EXTENTS = MAX_PAGE_BLOCKS
_SEAL = struct.Struct("<Q")  # xxh3-64 of key + record: catches bytes flipped in the LMDB file
_NO_PARENT = bytes(KEY_BYTES)
#: The database of derived pages' origins (``:`` is in no tier's name, so no tier's database).
ORIGINS_DB = b"derived:origins"
#: A slot tier's runs (:mod:`tierkv.store.index_runs`) live in the database ``<tier>:runs``.
RUNS_SUFFIX = ":runs"
_RUN_MAGIC = b"TKR1"
_RUN_HEAD = struct.Struct("<4sII")    # magic, deletes, records
_RUN_ID = struct.Struct(">Q")         # a run's key: its id, big-endian (runs sort by id)
#: One record in a run: the value a per-key record has (slot .. has_parent, seal).
RECORD_BYTES = _RECORD.size + _SEAL.size
log = logging.getLogger(__name__)
MAP_SIZE = 1 << 36  # address space only: LMDB files grow sparsely

# What LMDB raises for a damaged file (as opposed to permissions, locks, full disks).
_CORRUPT = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError,
            lmdb.VersionMismatchError, lmdb.BadValsizeError)


#: A writer hands its mapping of the index file back to the kernel each time this many
#: bytes of runs were written (see PersistentIndex.release_map): what stays resident of
#: the file between releases. 16 MiB was about 9 of the 138 resident bytes a page at 1M
#: pages; a release (one madvise over the mapping) takes about 15 us over 1M pages' 64 MB file.
RELEASE_BYTES = 4 << 20


class IndexDamaged(Exception):
    """The index file is damaged (internal: open_index moves it aside)."""


# Errors that say nothing about the file's contents: never a reason to set an index aside.
_OPERATIONAL = (lmdb.MapFullError, lmdb.ReadersFullError, lmdb.LockError, lmdb.ReadonlyError, lmdb.DiskError,
                lmdb.MemoryError, lmdb.TlsFullError)


def _damaged(exc: lmdb.Error) -> bool:
    # A flipped version field comes back as a plain lmdb.Error ("data format vN is not supported").
    return isinstance(exc, _CORRUPT) or "format" in str(exc)

# LMDB allows one environment per file per process: share it, counting handles and
# remembering whether it was opened read-only.
_ENVS: dict[str, tuple[lmdb.Environment, int, bool]] = {}
_ENVS_LOCK = threading.Lock()


def _open_env(path: Path, read_only: bool) -> lmdb.Environment:
    key = str(path.resolve())
    with _ENVS_LOCK:
        if key in _ENVS:
            env, count, env_read_only = _ENVS[key]
            if env_read_only and not read_only:
                # The read-only environment cannot take writes, and a second one on the
                # same file in this process would break LMDB's locks.
                raise ConfigError(f"the store index at {path} is open read-only in this process "
                                  f"({count} handle(s)); close the read-only Store before opening "
                                  f"a writer, or open the writer first")
            _ENVS[key] = (env, count + 1, env_read_only)
            return env
        old_umask = os.umask(0o077)  # index files are 0600: they name every cached prefix
        try:
            env = lmdb.open(key, map_size=MAP_SIZE, max_dbs=16, subdir=True, readonly=read_only,
                            lock=True, sync=True, metasync=True, create=not read_only)
        except lmdb.Error as exc:
            if _damaged(exc):
                raise IndexDamaged(str(exc)) from None
            raise ConfigError(f"cannot open the store index at {path}: {exc}") from None
        finally:
            os.umask(old_umask)
        _ENVS[key] = (env, 1, read_only)
        return env


def _close_env(env: lmdb.Environment) -> None:
    with _ENVS_LOCK:
        for key, (held, count, env_read_only) in list(_ENVS.items()):
            if held is env:
                if count > 1:
                    _ENVS[key] = (held, count - 1, env_read_only)
                else:
                    del _ENVS[key]
                    env.close()
                return


@dataclass(frozen=True)
class IndexRecord:
    """Where one page's durable bytes live on a persistent tier."""

    key: PageKey
    slot: int
    nbytes: int
    checksum: int
    parent: PageKey | None
    # Block runs (first 4 KiB block, count) on a block-addressed tier; () on slot tiers,
    # whose records stay byte for byte what format 2 wrote.
    extents: tuple[tuple[int, int], ...] = ()

    def pack(self) -> bytes:
        parent = self.parent if self.parent is not None else _NO_PARENT
        body = _RECORD.pack(self.slot, self.nbytes, self.checksum, parent, self.parent is not None)
        if self.extents:
            body += _EXTENT_COUNT.pack(len(self.extents)) + b"".join(_EXTENT.pack(f, c) for f, c in self.extents)
        return body + _SEAL.pack(xxhash.xxh3_64_intdigest(self.key + body))

    @classmethod
    def unpack(cls, key: bytes, value: bytes) -> IndexRecord:
        """Decode a stored record; raises CorruptPageError if its length or seal is wrong."""
        key, value = bytes(key), bytes(value)
        base = _RECORD.size + _SEAL.size
        extra = len(value) - base
        n_ext = -1
        if extra >= _EXTENT_COUNT.size:
            (n_ext,) = _EXTENT_COUNT.unpack_from(value, _RECORD.size)
        if len(key) != KEY_BYTES or not (extra == 0 or (
                0 < n_ext <= MAX_EXTENTS and extra == _EXTENT_COUNT.size + n_ext * _EXTENT.size)):
            raise CorruptPageError(f"index record of {len(key)}+{len(value)} bytes, "
                                   f"expected {KEY_BYTES}+{base} (+ extents)")
        body = value[:-_SEAL.size]
        (seal,) = _SEAL.unpack(value[-_SEAL.size:])
        if seal != xxhash.xxh3_64_intdigest(key + body):
            raise CorruptPageError(f"index record of page {key.hex()} fails its seal")
        slot, nbytes, checksum, parent, has_parent = _RECORD.unpack_from(body)
        extents = tuple(_EXTENT.unpack_from(body, _RECORD.size + _EXTENT_COUNT.size + i * _EXTENT.size)
                        for i in range(max(n_ext, 0))) if extra else ()
        return cls(PageKey(bytes(key)), slot, nbytes, checksum, PageKey(parent) if has_parent else None,
                   extents)


@dataclass(frozen=True)
class PackedRecords:
    """Records already packed: each key's stored value, byte for byte what
    :meth:`IndexRecord.pack` gives (``tierkv.store.index_scan.packed_values`` packs a
    batch in one pass). :meth:`PersistentIndex.commit` takes them as it takes records."""

    keys: list[PageKey]
    values: list[bytes]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values):
            raise ValueError(f"{len(self.keys)} keys for {len(self.values)} packed records")

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[IndexRecord]:
        """The records, decoded (checks and tests; the index writes the values as they are)."""
        return (IndexRecord.unpack(k, v) for k, v in zip(self.keys, self.values))


Records = Iterable[IndexRecord] | PackedRecords


def _pairs(put: Records) -> Iterable[tuple[PageKey, IndexRecord | bytes]]:
    """(key, record or packed value) of each record of ``put``."""
    return zip(put.keys, put.values) if isinstance(put, PackedRecords) else ((rec.key, rec) for rec in put)


def _packed(value: object) -> bytes:
    """A buffered record's stored value."""
    if isinstance(value, bytes):
        return value
    assert isinstance(value, IndexRecord)
    return value.pack()


def run_key(run: int) -> bytes:
    return _RUN_ID.pack(run)


def run_id(key: bytes) -> int:
    """A run's id from its key (a key of another length, which only damage makes, is read
    as its first 8 bytes, padded: never an exception)."""
    return int.from_bytes(bytes(key)[:_RUN_ID.size].ljust(_RUN_ID.size, b"\0"), "big")


def run_events(value: bytes) -> int:
    """How many deletes and records a stored run claims (0 if it is too short to say)."""
    if len(value) < _RUN_HEAD.size:
        return 0
    _, nd, nr = _RUN_HEAD.unpack_from(value)
    return int(nd) + int(nr)


def pack_run(run: int, deletes: Iterable[bytes], keys: Iterable[bytes], values: Iterable[bytes]) -> bytes:
    """The stored value of run ``run`` (see :mod:`tierkv.store.index_runs`): its deleted
    keys, then its records (each key's packed value, as :meth:`IndexRecord.pack` gives
    for a slot tier), sealed."""
    dels = b"".join(deletes)
    kblob = b"".join(keys)
    vblob = b"".join(values)
    nd, nr = len(dels) // KEY_BYTES, len(kblob) // KEY_BYTES
    if len(dels) % KEY_BYTES or len(kblob) % KEY_BYTES or len(vblob) != nr * RECORD_BYTES:
        raise ValueError(f"a run of {len(dels)} bytes of deletes, {len(kblob)} of keys and {len(vblob)} of "
                         f"records: expected 16-byte keys and {RECORD_BYTES}-byte records, one per key")
    body = _RUN_HEAD.pack(_RUN_MAGIC, nd, nr) + dels + kblob + vblob
    return body + _SEAL.pack(xxhash.xxh3_64_intdigest(_RUN_ID.pack(run) + body))


def _runs_error(tier: str, exc: BaseException) -> TierKVError | IndexDamaged:
    """What reading a tier's runs failing with ``exc`` is: TierIOError for resources and
    locks, IndexDamaged for anything else LMDB says (a damaged file)."""
    if isinstance(exc, _OPERATIONAL):
        return TierIOError(f"reading the {tier} runs failed: {exc}")
    return IndexDamaged(f"reading the {tier} runs failed: {exc}")


def _decode(key: bytes, value: bytes) -> IndexRecord | None:
    try:
        return IndexRecord.unpack(key, value)
    except CorruptPageError as exc:
        log.warning("index: %s; the page is treated as a miss", exc)
        return None


class PersistentIndex:
    """LMDB-backed records for the persistent tiers of one store directory."""

    def __init__(self, store_dir: Path, tier_names: Iterable[str], *, read_only: bool = False,
                 runs: Iterable[str] = ()) -> None:
        self._read_only = read_only
        tier_names = list(tier_names)
        path = store_dir / "index.lmdb"
        self._path = store_dir
        if read_only and not path.exists():
            raise ConfigError(f"no store index at {path}; a read-only open needs an existing store")
        self._group: GroupCommit | None = None
        self._env = _open_env(path, read_only)
        try:
            self._meta = self._env.open_db(b"meta", create=not read_only)
            self._dbs = {name: self._env.open_db(name.encode(), create=not read_only) for name in tier_names}
            # Slot tiers' runs (tierkv.store.index_runs); a reader of an index written
            # before there were any reads the per-key records.
            # A tier written as runs before and configured otherwise now (a block tier) has
            # its runs opened too, to be carried into per-key records.
            self._as_runs = set(runs)
            if not self._as_runs <= set(self._dbs):
                raise ValueError(f"runs for {sorted(self._as_runs - set(self._dbs))}, not among the index's "
                                 f"tiers {tier_names}")
            self._runs: dict[str, lmdb._Database] = {}
            for name in tier_names:
                try:
                    self._runs[name] = self._env.open_db((name + RUNS_SUFFIX).encode(),
                                                         create=name in self._as_runs and not read_only)
                except lmdb.NotFoundError:
                    pass
            self._events = dict.fromkeys(self._runs, 0)   # entries the runs hold (compaction's measure)
            self._appended = dict.fromkeys(self._runs, 0)  # of them, appended by commits since compaction looked
            self._map_addr: int | None = None              # where this process maps data.mdb (0: unknown)
            self._unreleased = 0                           # bytes of runs committed since release_map
            self._views: dict[str, object] = {}           # a reader's RunsView per tier
            # Derived pages' origins (tierkv.store.derived); a reader of an index written
            # before there were any finds none.
            try:
                self._origins: lmdb._Database | None = self._env.open_db(ORIGINS_DB, create=not read_only)
            except lmdb.NotFoundError:
                self._origins = None
        except BaseException:
            _close_env(self._env)  # a damaged env must not stay cached for the next open
            raise

    def check_meta(self, meta: dict[str, object], upgrade_from: Iterable[int] = ()) -> None:
        """Record ``meta`` on first open; afterwards require that it matches.

        A store whose stored format is in ``upgrade_from`` and whose geometry is
        otherwise the same is taken as it is (its records read unchanged) and, by the
        writer, marked with the current format. Both meta records carry a seal, so a
        damaged one (IndexDamaged) is told apart from a store opened with other
        settings (ConfigError naming the differences).
        """
        blob = json.dumps(meta, sort_keys=True).encode()
        stored = self._meta_get(b"store")
        if stored is None:
            if self._read_only:
                raise ConfigError("the store index has no metadata; it was never opened for writing")
            self._meta_put(b"store", blob)
            return
        if stored != blob:
            old = json.loads(stored)
            diff = {k: (old.get(k), meta.get(k)) for k in sorted(set(old) | set(meta)) if old.get(k) != meta.get(k)}
            if set(diff) == {"format"} and old.get("format") in set(upgrade_from):
                log.info("store index format %s read as format %s", old.get("format"), meta.get("format"))
                if not self._read_only:
                    self._meta_put(b"store", blob)
                return
            if "format" in diff:
                raise ConfigError(
                    f"the store at {self._path} is in format {old.get('format')}; this tierkv reads format "
                    f"{meta.get('format')}" + (f" (and {', '.join(map(str, upgrade_from))})" if upgrade_from else "")
                    + ". It is a cache: remove the directory, or open it with the tierkv that wrote it")
            raise ConfigError(
                "the store was created with a different geometry; differing settings (stored, configured): "
                f"{diff}. Open it with the settings it was created with, or use another store path"
            )

    def _meta_get(self, name: bytes) -> bytes | None:
        with self._env.begin(db=self._meta) as txn:
            value = txn.get(name)
        if value is None:
            return None
        value = bytes(value)
        body, seal = value[:-_SEAL.size], value[-_SEAL.size:]
        if len(value) < _SEAL.size or _SEAL.unpack(seal)[0] != xxhash.xxh3_64_intdigest(name + body):
            raise IndexDamaged(f"the index's {name.decode()} record fails its seal")
        return body

    def _meta_put(self, name: bytes, body: bytes) -> None:
        with self._env.begin(db=self._meta, write=True) as txn:
            txn.put(name, body + _SEAL.pack(xxhash.xxh3_64_intdigest(name + body)))

    def store_id(self) -> bytes:
        """This store's random 16-byte identity, made on first open (it labels the data files)."""
        sid = self._meta_get(b"id")
        if sid is None:
            if self._read_only:
                raise ConfigError("the store index has no identity; it was never opened for writing")
            sid = os.urandom(16)
            self._meta_put(b"id", sid)
        if len(sid) != 16:
            raise IndexDamaged(f"the store identity is {len(sid)} bytes, expected 16")
        return sid

    def has_labelled(self, tier: str) -> bool:
        """Whether this index has ever put its label on (or found it on) ``tier``'s medium."""
        return self._meta_get(b"labelled:" + tier.encode()) is not None

    def mark_labelled(self, tier: str) -> None:
        """Record that ``tier``'s medium carries this index's label (once; idempotent)."""
        if not self.has_labelled(tier):
            self._meta_put(b"labelled:" + tier.encode(), b"1")

    def get_many(self, tier: str, keys: Iterable[PageKey]) -> list[IndexRecord | None]:
        """Records of ``keys`` in one read transaction (None where absent or undecodable).
        A tier kept as runs answers from the runs committed so far (replayed since the
        last call: :class:`tierkv.store.index_runs.RunsView`)."""
        if tier in self._as_runs and tier not in self._runs:   # a writer may have carried records into runs
            with _ENVS_LOCK:   # LMDB: no two database opens at once in one process
                try:
                    self._runs[tier] = self._env.open_db((tier + RUNS_SUFFIX).encode(), create=False)
                except lmdb.NotFoundError:
                    pass
        if tier in self._runs:
            from tierkv.store.index_runs import view_records  # index_runs builds on this module
            keys = list(keys)
            got = view_records(self, tier, keys)
            if got is not None:
                return got
        out: list[IndexRecord | None] = []
        with self._env.begin(db=self._dbs[tier]) as txn:
            for key in keys:
                value = txn.get(key)
                out.append(None if value is None else _decode(key, value))
        return out

    # -- runs (tierkv.store.index_runs) -------------------------------------------------------
    def is_runs(self, tier: str) -> bool:
        """Whether ``tier``'s commits are written as runs."""
        return tier in self._as_runs

    def has_runs(self, tier: str) -> bool:
        """Whether ``tier`` has any run committed."""
        db = self._runs.get(tier)
        if db is None:
            return False
        with self._env.begin(db=db) as txn:
            return bool(txn.cursor().first())

    def release_map(self) -> None:
        """Hand this process's mapping of the index file's pages back to the kernel
        (``madvise(MADV_DONTNEED)``: they stay in the page cache, and LMDB faults back in
        what it reads next). LMDB leaves every page a commit wrote mapped in the writer, so
        without this the runs, written once and read only at the next open, stayed
        resident in the process: the index's whole size (about 64 bytes a page). A no-op
        where ``madvise`` or ``/proc/self/maps`` is not available
        (:mod:`tierkv.store.resident`)."""
        self._unreleased = 0
        if self._map_addr is None:
            self._map_addr = mapped_at((self._path / "index.lmdb" / "data.mdb").resolve()) or 0
        if self._map_addr:
            dont_need(self._map_addr, self.file_bytes())

    def _maybe_release(self) -> None:
        """After a commit: release the mapping once RELEASE_BYTES of runs were written since."""
        if self._unreleased >= RELEASE_BYTES:
            self.release_map()

    def appended(self, tier: str, *, reset: bool = False) -> int:
        """Entries appended to ``tier``'s runs by commits since the last reset."""
        got = self._appended.get(tier, 0)
        if reset:
            self._appended[tier] = 0
        return got

    def events(self, tier: str) -> int:
        """The deletes and records ``tier``'s runs hold, live or not (what compaction measures)."""
        return self._events.get(tier, 0)

    def read_runs(self, tier: str, *, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        """Stored runs of ``tier`` (key, value), oldest first; with ``limit``, stopping after
        the run that brings their entries to it. Sets the tier's entry count when it reads
        them all."""
        db = self._runs[tier]
        out: list[tuple[bytes, bytes]] = []
        total = 0
        try:
            with self._env.begin(db=db) as txn:
                cursor = txn.cursor()
                for key, value in cursor.iternext() if cursor.first() else ():
                    out.append((bytes(key), bytes(value)))
                    total += run_events(value)
                    if limit is not None and total >= limit:
                        break
        except (lmdb.Error, SystemError) as exc:
            raise _runs_error(tier, exc) from None
        if limit is None:
            self._events[tier] = total
        return out

    def runs_since(self, tier: str, first: bytes, after: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        """In one read transaction: the key of ``tier``'s oldest run, and the runs after
        the key ``after`` if the oldest is still ``first``, else every run (a compaction
        removed runs since). For a reader's :class:`~tierkv.store.index_runs.RunsView`."""
        try:
            with self._env.begin(db=self._runs[tier]) as txn:
                cursor = txn.cursor()
                if not cursor.first():
                    return b"", []
                oldest = bytes(cursor.key())
                if oldest == first and after:
                    more = cursor.set_range(after)
                    if more and bytes(cursor.key()) == after:
                        more = cursor.next()
                    if not more:
                        return oldest, []
                return oldest, [(bytes(k), bytes(v)) for k, v in cursor.iternext()]
        except lmdb.Error as exc:
            raise TierIOError(f"reading the {tier} runs failed: {exc}") from None

    def rewrite_runs(self, tier: str, through: bytes, keys: bytes, values: bytes, *, events: int,
                     drop_records: bool = False) -> None:
        """Replace ``tier``'s runs up to the key ``through`` (which held ``events`` entries) by
        runs of the records ``keys``/``values`` (blobs), appended: durable when it returns
        (never grouped: call :meth:`sync` first). ``drop_records``: also forget the tier's
        per-key records (an older format's, just carried into runs). Large rewrites take
        one transaction per :data:`~tierkv.store.index_runs.COMPACT_CHUNK` records, the
        deletes in the last: a crash between them leaves the new runs as well as the old,
        which replay to the same pages. With no records, an empty run takes the next id, so
        that ids are never reused (a reader's view relies on it). TierIOError on failure."""
        from tierkv.store.index_runs import COMPACT_CHUNK
        if self._read_only:
            raise ConfigError("a read-only index commits nothing")
        db = self._runs[tier]
        n = len(keys) // KEY_BYTES
        steps = list(range(0, n, COMPACT_CHUNK)) or [0]
        fresh = b""   # the first new run's key: the runs before it are the old ones
        try:
            for i, at in enumerate(steps):
                added = nbytes = 0
                with self._env.begin(write=True) as txn:
                    end = min(n, at + COMPACT_CHUNK)
                    last = i == len(steps) - 1
                    if end > at or (last and not fresh):
                        key, added, nbytes = self._append_run(
                            txn, tier, [], [keys[at * KEY_BYTES:end * KEY_BYTES]],
                            [values[at * RECORD_BYTES:end * RECORD_BYTES]])
                        fresh = fresh or key
                    if last:
                        cursor = txn.cursor(db=db)
                        more = cursor.first()
                        while more and bytes(cursor.key()) <= through and bytes(cursor.key()) < fresh:
                            more = cursor.delete()
                        if drop_records:
                            txn.drop(self._dbs[tier], delete=False)
                self._counted(tier, added, nbytes, commit=False)
            self._events[tier] = max(0, self._events.get(tier, 0) - events)
        except lmdb.Error as exc:
            raise TierIOError(f"rewriting the {tier} runs failed: {exc}") from None
        self.release_map()   # it read the old runs, and wrote the new ones

    def newest_run(self, tier: str) -> bytes:
        """The key of ``tier``'s newest run (b"" if none)."""
        try:
            with self._env.begin(db=self._runs[tier]) as txn:
                cursor = txn.cursor()
                return bytes(cursor.key()) if cursor.last() else b""
        except (lmdb.Error, SystemError) as exc:
            raise _runs_error(tier, exc) from None

    def count_events(self, tier: str) -> int:
        """Recount the entries ``tier``'s runs hold from their headers (only each run's first
        bytes are read), and keep the count (compaction's measure)."""
        total = 0
        try:
            with self._env.begin(db=self._runs[tier], buffers=True) as txn:
                for _, value in txn.cursor():
                    total += run_events(bytes(value[:_RUN_HEAD.size]))
        except (lmdb.Error, SystemError) as exc:
            raise _runs_error(tier, exc) from None
        self._events[tier] = total
        self.release_map()
        return total

    def runs_to_records(self, tier: str, keys: bytes, values: bytes) -> None:
        """Carry a tier's runs into per-key records (it was a slot tier and is a block tier
        now): ``keys``/``values`` (blobs) are its live records, put one per key, then its
        runs are dropped; one transaction per :data:`~tierkv.store.index_runs.COMPACT_CHUNK`
        records (a crash between them leaves the runs, read again next time). TierIOError."""
        from tierkv.store.index_runs import COMPACT_CHUNK
        n = len(keys) // KEY_BYTES
        steps = list(range(0, n, COMPACT_CHUNK)) or [0]
        try:
            for i, at in enumerate(steps):
                with self._env.begin(write=True) as txn:
                    end = min(n, at + COMPACT_CHUNK)
                    txn.cursor(db=self._dbs[tier]).putmulti(
                        [(keys[j * KEY_BYTES:(j + 1) * KEY_BYTES], values[j * RECORD_BYTES:(j + 1) * RECORD_BYTES])
                         for j in range(at, end)])
                    if i == len(steps) - 1:
                        txn.drop(self._runs[tier], delete=False)
            self._events[tier] = 0
        except lmdb.Error as exc:
            raise TierIOError(f"carrying the {tier} runs into records failed: {exc}") from None

    def _append_run(self, txn: lmdb.Transaction, tier: str, deletes: Sequence[bytes], keys: Sequence[bytes],
                    values: Sequence[bytes]) -> tuple[bytes, int, int]:
        """Append one run (its id the last one's plus one) in ``txn``; returns its key, its
        entries and its bytes, for :meth:`_counted` once the transaction is committed."""
        cursor = txn.cursor(db=self._runs[tier])
        rid = run_id(bytes(cursor.key())) + 1 if cursor.last() else 0
        value = pack_run(rid, deletes, keys, values)
        key = run_key(rid)
        cursor.put(key, value, append=True)
        return key, run_events(value), len(value)

    def _counted(self, tier: str, events: int, nbytes: int, *, commit: bool = True) -> None:
        """Count a committed run: its entries (and, for a commit's, as appended since
        compaction looked) and its bytes (for :meth:`release_map`). Never for a run whose
        transaction failed: a retried commit would count it twice."""
        self._unreleased += nbytes
        self._events[tier] = self._events.get(tier, 0) + events
        if commit:
            self._appended[tier] = self._appended.get(tier, 0) + events

    def entries(self, tier: str) -> int:
        """How many records a tier has, from LMDB's own count (no walk)."""
        with self._env.begin(db=self._dbs[tier]) as txn:
            return int(txn.stat(self._dbs[tier])["entries"])

    def file_bytes(self) -> int:
        """Bytes of the index file in use (its pages up to the last one written; LMDB keeps
        freed pages for reuse, so this never shrinks)."""
        return (int(self._env.info()["last_pgno"]) + 1) * int(self._env.stat()["psize"])

    def last_txnid(self) -> int:
        """The id of LMDB's last committed write transaction: any commit changes it."""
        return int(self._env.info()["last_txnid"])

    def count(self, tier: str) -> int:
        """How many per-key records and runs a tier has (also walks the trees, so structural
        damage shows here)."""
        with self._env.begin() as txn:
            return sum(sum(1 for _ in txn.cursor(db=db).iternext(keys=True, values=False))
                       for db in (self._dbs[tier], self._runs.get(tier)) if db is not None)

    def clear(self, tier: str) -> None:
        """Forget every record of a tier (its data file was found foreign or corrupt)."""
        if self._group is not None:
            self._group.drop(tier)
        with self._env.begin(write=True) as txn:
            txn.drop(self._dbs[tier], delete=False)
            if tier in self._runs:
                cursor = txn.cursor(db=self._runs[tier])
                rid = run_id(bytes(cursor.key())) if cursor.last() else -1
                txn.drop(self._runs[tier], delete=False)
                if rid >= 0:   # ids are never reused: an empty run keeps the next one
                    txn.put(run_key(rid + 1), pack_run(rid + 1, [], [], []), db=self._runs[tier])
        if tier in self._runs:
            self._events[tier] = 0

    def commit(self, tier: str, put: Records = (), delete: Iterable[PageKey] = ()) -> None:
        """Apply deletions then insertions (records, or :class:`PackedRecords`); TierIOError on failure.

        Without group commit this is one durable transaction, done when it returns. With
        it (:meth:`group_commit`) the operations are buffered and become durable with the
        window they fall in (the tier's data is synced first): :meth:`sync` is the
        barrier, and an earlier window's failure is raised there, not here.
        """
        if self._group is not None:
            self._group.add(tier, _pairs(put), delete)
            return
        db = self._dbs[tier]
        try:
            ran: tuple[bytes, int, int] | None = None
            with self._env.begin(db=db, write=True) as txn:
                if tier in self._as_runs:
                    pairs = list(_pairs(put))
                    deletes = list(delete)
                    if pairs or deletes:
                        ran = self._append_run(txn, tier, deletes, [k for k, _ in pairs],
                                               [_packed(r) for _, r in pairs])
                else:
                    for key in delete:
                        txn.delete(key)
                    txn.cursor().putmulti([(key, _packed(rec)) for key, rec in _pairs(put)])
            if ran is not None:
                self._counted(tier, ran[1], ran[2])
            self._maybe_release()
        except lmdb.Error as exc:
            raise TierIOError(f"store index commit for the {tier} tier failed: {exc}") from None

    def group_commit(self, syncs: Mapping[str, Callable[[], None]], *, window_s: float, max_pages: int) -> None:
        """Buffer every :meth:`commit` from now on: one data sync (``syncs[tier]``, each tier's
        ``flush``) and one LMDB transaction per window (see :mod:`tierkv.store.commits`)."""
        if self._read_only:
            raise ConfigError("a read-only index commits nothing")
        if self._group is None:
            self._group = GroupCommit(self._apply, syncs, window_s=window_s, max_pages=max_pages)

    @property
    def deferred(self) -> bool:
        """Whether commits are grouped (the transfers then leave the data sync to the window)."""
        return self._group is not None

    @property
    def group(self) -> GroupCommit | None:
        return self._group

    def sync(self) -> None:
        """Make every commit made before this call durable (a no-op without group commit);
        TierIOError if that, or a window since the last ``sync``, failed."""
        if self._group is not None:
            self._group.sync()

    def drain(self, tier: str | None = None) -> bool:
        """Make every commit made before this call durable if possible (a no-op without group
        commit); whether it did (of ``tier`` only, if given). Raises nothing: a failure
        stays for :meth:`sync`."""
        return self._group.drain(tier) if self._group is not None else True

    def _apply(self, ops: Ops) -> None:
        """One synced transaction over every tier's buffered deletes (None) and records."""
        ran: list[tuple[str, int, int]] = []
        try:
            with self._env.begin(write=True) as txn:
                for tier, by_key in ops.items():
                    if tier in self._as_runs:
                        if by_key:
                            _, events, nbytes = self._append_run(
                                txn, tier, [k for k, r in by_key.items() if r is None],
                                [k for k, r in by_key.items() if r is not None],
                                [_packed(r) for r in by_key.values() if r is not None])
                            ran.append((tier, events, nbytes))
                        continue
                    db = self._dbs[tier]
                    put: list[tuple[PageKey, bytes]] = []
                    for key, rec in by_key.items():
                        if rec is None:
                            txn.delete(key, db=db)
                        else:
                            put.append((key, _packed(rec)))
                    txn.cursor(db=db).putmulti(put)
        except lmdb.Error as exc:
            raise TierIOError(f"store index group commit ({', '.join(ops)}) failed: {exc}") from None
        for tier, events, nbytes in ran:
            self._counted(tier, events, nbytes)
        self._maybe_release()

    # -- derived pages' origins (tierkv.store.derived) ----------------------------------------
    def origins(self, keys: Iterable[bytes] | None = None) -> list[tuple[bytes, bytes]]:
        """Sealed origin records (key, value), of ``keys`` (those there are) or every one;
        [] where the index has no such database (a reader of an older index)."""
        if self._origins is None:
            return []
        try:
            with self._env.begin(db=self._origins) as txn:
                if keys is None:
                    return [(bytes(k), bytes(v)) for k, v in txn.cursor()]
                return [(bytes(k), bytes(v)) for k in keys if (v := txn.get(k)) is not None]
        except lmdb.Error as exc:
            raise TierIOError(f"reading derived pages' origins failed: {exc}") from None

    def clear_origins(self) -> None:
        """Forget every origin record (the database could not be read)."""
        if self._origins is not None and not self._read_only:
            try:
                with self._env.begin(write=True) as txn:
                    txn.drop(self._origins, delete=False)
            except lmdb.Error as exc:
                raise TierIOError(f"clearing derived pages' origins failed: {exc}") from None

    def write_origins(self, put: Iterable[tuple[bytes, bytes]] = (), delete: Iterable[bytes] = ()) -> None:
        """One durable transaction of origin records (never grouped: a splice's origins are
        committed before its pages, whose records may wait for a window); TierIOError."""
        if self._origins is None or self._read_only:
            raise ConfigError("a read-only index records no origins")
        try:
            with self._env.begin(db=self._origins, write=True) as txn:
                for key in delete:
                    txn.delete(key)
                for key, value in put:
                    txn.put(key, value)
        except lmdb.Error as exc:
            raise TierIOError(f"recording derived pages' origins failed: {exc}") from None

    def adopt(self, tier: str, valid: Callable[[IndexRecord], bool]) -> tuple[list[IndexRecord], int]:
        """Every record of a tier that decodes and passes ``valid``; the rest are deleted
        in the same transaction. Returns (records kept, records dropped)."""
        kept: list[IndexRecord] = []
        dropped = 0
        try:
            with self._env.begin(db=self._dbs[tier], write=True) as txn:
                cursor = txn.cursor()
                more = cursor.first()
                while more:
                    rec = _decode(cursor.key(), cursor.value())
                    if rec is not None and valid(rec):
                        kept.append(rec)
                        more = cursor.next()
                    else:
                        dropped += 1
                        more = cursor.delete()  # moves to the next record
        except (lmdb.Error, SystemError) as exc:
            if isinstance(exc, _OPERATIONAL):  # resources, locks, a read-only env: not the file
                raise TierIOError(f"walking the {tier} records failed: {exc}") from None
            # A damaged B-tree can fail mid-walk (py-lmdb then surfaces SystemError too).
            raise IndexDamaged(f"walking the {tier} records failed: {exc}") from None
        return kept, dropped

    def close(self) -> None:
        """Apply buffered commits (logged if that fails: those pages are misses after a
        restart) and release the environment. Call :meth:`sync` first to see failures."""
        try:
            if self._group is not None:
                group, self._group = self._group, None
                try:
                    group.close()
                except TierKVError as exc:
                    log.warning("index: the last group commit failed at close: %s", exc)
        finally:
            _close_env(self._env)


def open_index(store_dir: Path, tier_names: list[str], meta: dict[str, object], *,
               read_only: bool, verify: str = "always", upgrade_from: Iterable[int] = (),
               runs: Iterable[str] = ()) -> PersistentIndex:
    """Open the store's index and check its geometry; a structurally corrupt index is
    moved aside (``index.lmdb.corrupt-<ns>``, logged) and replaced by an empty one, so
    the store serves misses instead of failing. ConfigError on a geometry mismatch.

    ``verify`` ("always", "unclean", "never") says when a child process walks the index
    first (see :mod:`tierkv.store.index_check`); "unclean" means after a shutdown that did not
    leave the clean marker. ``runs``: the tiers whose commits are written as runs
    (:mod:`tierkv.store.index_runs`: the slot tiers).
    """
    runs = list(runs)
    path = store_dir / "index.lmdb"
    walked = False  # whether a child walked every record and rehearsed the writes without harm
    cut = check_index_file(path)  # before anything maps it: a short file faults every reader
    if cut is not None:
        if read_only:
            raise ConfigError(f"the store index at {path} is unusable: {cut}")
        quarantine_index(store_dir, cut)
    if not read_only and (path / "data.mdb").exists() and (
            verify == "always" or (verify == "unclean" and not was_clean(store_dir))):
        problem, _ = probe_index(path)
        if problem is not None:
            quarantine_index(store_dir, problem)
        walked = problem is None
    try:
        index = PersistentIndex(store_dir, tier_names, read_only=read_only, runs=runs)
        try:
            index.check_meta(meta, upgrade_from)
            index.store_id()
            if not walked:  # walk the tree here, so that structural damage shows now
                for name in tier_names:
                    index.count(name)
        except BaseException:
            index.close()
            raise
        return index
    except (lmdb.Error, SystemError, IndexDamaged) as exc:
        if not is_damage(exc):
            raise ConfigError(f"cannot use the store index at {store_dir / 'index.lmdb'}: {exc}") from None
        if read_only:
            raise ConfigError(f"the store index at {store_dir / 'index.lmdb'} is unreadable: {exc}") from None
        quarantine_index(store_dir, str(exc))
        return PersistentIndex(store_dir, tier_names, read_only=False, runs=runs)


def is_damage(exc: BaseException) -> bool:
    """Whether an exception raised while reading an opened index means the file is damaged.

    Once the environment is open, LMDB reports a damaged B-tree in many ways (corrupted
    page, page not found, a transaction gone bad, even SystemError from the binding),
    so every LMDB failure counts except those about resources and locks.
    """
    if isinstance(exc, IndexDamaged):
        return True
    if isinstance(exc, lmdb.Error):
        return not isinstance(exc, _OPERATIONAL)
    return isinstance(exc, SystemError)


def quarantine_index(store_dir: Path, reason: str) -> Path:
    """Move a corrupt index out of the way (kept for inspection); returns its new path."""
    path = store_dir / "index.lmdb"
    aside = store_dir / f"index.lmdb.corrupt-{time.time_ns()}"
    log.error("store index %s is corrupt (%s); moved to %s, every cached page becomes a miss", path, reason, aside)
    os.rename(path, aside)
    return aside
