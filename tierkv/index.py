"""The persistent page index: LMDB records of the pages on persistent tiers.

One LMDB environment per store directory (``index.lmdb``), with a ``meta`` database
(store identity, layout and tier geometry) and one database per persistent tier
mapping a 16-byte page key to its slot, stored length, xxh3-64 checksum and parent
key. The manager writes a record only *after* the page's data is written and
flushed, in one transaction with the deletes of the pages it evicted. A crash before
that commit can leave an evicted page's record pointing at a slot that already holds
newer bytes; the record's checksum then fails on the first read and the page is a
miss. So every record either points at the durable bytes of its key or is caught.
Readers in other processes open the same environment read-only.

Thread-safety: LMDB transactions are serialized by the caller (the store lock);
read-only handles may be used from any thread.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb

from tierkv.errors import ConfigError, CorruptPageError
from tierkv.keys import KEY_BYTES, PageKey

_RECORD = struct.Struct("<QIQ16sB")  # slot, nbytes, checksum, parent, has_parent
_NO_PARENT = bytes(KEY_BYTES)
MAP_SIZE = 1 << 36  # address space only: LMDB files grow sparsely

# LMDB allows one environment per file per process: share it, counting handles.
_ENVS: dict[str, tuple[lmdb.Environment, int]] = {}
_ENVS_LOCK = threading.Lock()


def _open_env(path: Path, read_only: bool) -> lmdb.Environment:
    key = str(path.resolve())
    with _ENVS_LOCK:
        if key in _ENVS:
            env, count = _ENVS[key]
            _ENVS[key] = (env, count + 1)
            return env
        old_umask = os.umask(0o077)  # index files are 0600: they name every cached prefix
        try:
            env = lmdb.open(key, map_size=MAP_SIZE, max_dbs=8, subdir=True, readonly=read_only,
                            lock=True, sync=True, metasync=True, create=not read_only)
        except lmdb.Error as exc:
            raise ConfigError(f"cannot open the store index at {path}: {exc}") from None
        finally:
            os.umask(old_umask)
        _ENVS[key] = (env, 1)
        return env


def _close_env(env: lmdb.Environment) -> None:
    with _ENVS_LOCK:
        for key, (held, count) in list(_ENVS.items()):
            if held is env:
                if count > 1:
                    _ENVS[key] = (held, count - 1)
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

    def pack(self) -> bytes:
        parent = self.parent if self.parent is not None else _NO_PARENT
        return _RECORD.pack(self.slot, self.nbytes, self.checksum, parent, self.parent is not None)

    @classmethod
    def unpack(cls, key: bytes, value: bytes) -> IndexRecord:
        if len(key) != KEY_BYTES or len(value) != _RECORD.size:
            raise CorruptPageError(f"index record of {len(key)}+{len(value)} bytes, expected {KEY_BYTES}+{_RECORD.size}")
        slot, nbytes, checksum, parent, has_parent = _RECORD.unpack(value)
        return cls(PageKey(bytes(key)), slot, nbytes, checksum, PageKey(parent) if has_parent else None)


class PersistentIndex:
    """LMDB-backed records for the persistent tiers of one store directory."""

    def __init__(self, store_dir: Path, tier_names: Iterable[str], *, read_only: bool = False) -> None:
        self._read_only = read_only
        path = store_dir / "index.lmdb"
        if read_only and not path.exists():
            raise ConfigError(f"no store index at {path}; a read-only open needs an existing store")
        self._env = _open_env(path, read_only)
        self._meta = self._env.open_db(b"meta", create=not read_only)
        self._dbs = {name: self._env.open_db(name.encode(), create=not read_only) for name in tier_names}

    def check_meta(self, meta: dict[str, object]) -> None:
        """Record ``meta`` on first open; afterwards require that it matches."""
        blob = json.dumps(meta, sort_keys=True).encode()
        with self._env.begin(db=self._meta, write=not self._read_only) as txn:
            stored = txn.get(b"store")
            if stored is None:
                if self._read_only:
                    raise ConfigError("the store index has no metadata; it was never opened for writing")
                txn.put(b"store", blob)
                return
        if stored != blob:
            old = json.loads(stored)
            diff = {k: (old.get(k), meta.get(k)) for k in sorted(set(old) | set(meta)) if old.get(k) != meta.get(k)}
            raise ConfigError(
                "the store was created with a different geometry; differing settings (stored, configured): "
                f"{diff}. Open it with the settings it was created with, or use another store path"
            )

    def records(self, tier: str) -> Iterator[IndexRecord]:
        with self._env.begin(db=self._dbs[tier]) as txn:
            for key, value in txn.cursor():
                yield IndexRecord.unpack(key, value)

    def get(self, tier: str, key: PageKey) -> IndexRecord | None:
        with self._env.begin(db=self._dbs[tier]) as txn:
            value = txn.get(key)
        return None if value is None else IndexRecord.unpack(key, value)

    def get_many(self, tier: str, keys: Iterable[PageKey]) -> list[IndexRecord | None]:
        """Records of ``keys`` in one read transaction (None where absent)."""
        out: list[IndexRecord | None] = []
        with self._env.begin(db=self._dbs[tier]) as txn:
            for key in keys:
                value = txn.get(key)
                out.append(None if value is None else IndexRecord.unpack(key, value))
        return out

    def commit(self, tier: str, put: Iterable[IndexRecord] = (), delete: Iterable[PageKey] = ()) -> None:
        """Apply deletions then insertions in one durable transaction."""
        db = self._dbs[tier]
        with self._env.begin(db=db, write=True) as txn:
            for key in delete:
                txn.delete(key)
            for rec in put:
                txn.put(rec.key, rec.pack())

    def close(self) -> None:
        _close_env(self._env)
