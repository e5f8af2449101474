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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import lmdb
import xxhash

from tierkv.errors import ConfigError, CorruptPageError, TierIOError, TierKVError
from tierkv.store.commits import GroupCommit, Ops
from tierkv.store.index_check import check_index_file, probe_index, was_clean
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
log = logging.getLogger(__name__)
MAP_SIZE = 1 << 36  # address space only: LMDB files grow sparsely

# What LMDB raises for a damaged file (as opposed to permissions, locks, full disks).
_CORRUPT = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError,
            lmdb.VersionMismatchError, lmdb.BadValsizeError)


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


def _decode(key: bytes, value: bytes) -> IndexRecord | None:
    try:
        return IndexRecord.unpack(key, value)
    except CorruptPageError as exc:
        log.warning("index: %s; the page is treated as a miss", exc)
        return None


class PersistentIndex:
    """LMDB-backed records for the persistent tiers of one store directory."""

    def __init__(self, store_dir: Path, tier_names: Iterable[str], *, read_only: bool = False) -> None:
        self._read_only = read_only
        path = store_dir / "index.lmdb"
        self._path = store_dir
        if read_only and not path.exists():
            raise ConfigError(f"no store index at {path}; a read-only open needs an existing store")
        self._group: GroupCommit | None = None
        #: Records the open's child walk found failing their seals; -1 where it did not count.
        self.unsealed = -1
        self._env = _open_env(path, read_only)
        try:
            self._meta = self._env.open_db(b"meta", create=not read_only)
            self._dbs = {name: self._env.open_db(name.encode(), create=not read_only) for name in tier_names}
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
        """Records of ``keys`` in one read transaction (None where absent or undecodable)."""
        out: list[IndexRecord | None] = []
        with self._env.begin(db=self._dbs[tier]) as txn:
            for key in keys:
                value = txn.get(key)
                out.append(None if value is None else _decode(key, value))
        return out

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
        """How many records a tier has (also walks the tree, so structural damage shows here)."""
        with self._env.begin(db=self._dbs[tier]) as txn:
            return sum(1 for _ in txn.cursor().iternext(keys=True, values=False))

    def clear(self, tier: str) -> None:
        """Forget every record of a tier (its data file was found foreign or corrupt)."""
        if self._group is not None:
            self._group.drop(tier)
        with self._env.begin(write=True) as txn:
            txn.drop(self._dbs[tier], delete=False)

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
            with self._env.begin(db=db, write=True) as txn:
                for key in delete:
                    txn.delete(key)
                txn.cursor().putmulti([(key, _packed(rec)) for key, rec in _pairs(put)])
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

    def _apply(self, ops: Ops) -> None:
        """One synced transaction over every tier's buffered deletes (None) and records."""
        try:
            with self._env.begin(write=True) as txn:
                for tier, by_key in ops.items():
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
               seals: bool = False) -> PersistentIndex:
    """Open the store's index and check its geometry; a structurally corrupt index is
    moved aside (``index.lmdb.corrupt-<ns>``, logged) and replaced by an empty one, so
    the store serves misses instead of failing. ConfigError on a geometry mismatch.

    ``verify`` ("always", "unclean", "never") says when a child process walks the index
    first (see :mod:`tierkv.store.index_check`); "unclean" means after a shutdown that did not
    leave the clean marker. ``seals``: the walk also counts the records that fail their
    seals (the index's ``unsealed``; -1 where nobody counted).
    """
    path = store_dir / "index.lmdb"
    walked = False  # whether a child walked every record and rehearsed the writes without harm
    unsealed = -1
    cut = check_index_file(path)  # before anything maps it: a short file faults every reader
    if cut is not None:
        if read_only:
            raise ConfigError(f"the store index at {path} is unusable: {cut}")
        quarantine_index(store_dir, cut)
    if not read_only and (path / "data.mdb").exists() and (
            verify == "always" or (verify == "unclean" and not was_clean(store_dir))):
        problem, unsealed = probe_index(path, seals=seals)
        if problem is not None:
            quarantine_index(store_dir, problem)
        walked = problem is None
        unsealed = unsealed if walked and seals else -1
    try:
        index = PersistentIndex(store_dir, tier_names, read_only=read_only)
        try:
            index.check_meta(meta, upgrade_from)
            index.store_id()
            if not walked:  # walk the tree here, so that structural damage shows now
                for name in tier_names:
                    index.count(name)
            index.unsealed = unsealed
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
        return PersistentIndex(store_dir, tier_names, read_only=False)


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
