"""Reopen in bulk: a persistent tier's index records read into arrays in one cursor pass.

:meth:`PersistentIndex.adopt` decodes each record into an :class:`IndexRecord`, a Python
object per page; at node scale (millions of pages) that is what reopening costs.
:func:`scan_records` walks the same LMDB database once, checks every record's length
and seal, and decodes the fixed-size records (every record a slot-addressed tier
writes) with one numpy view of their joined bytes. Records that carry block runs
(block-addressed tiers) are decoded one by one, as before. Records that fail are
deleted in the same write transaction, as ``adopt`` does; so are the records
``valid`` refuses, which the caller decides on the arrays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from itertools import islice
from dataclasses import dataclass

import lmdb
import numpy as np
import xxhash

from tierkv.errors import TierIOError
from tierkv.keys import KEY_BYTES, _native, take_keys
from tierkv.store.index import _OPERATIONAL, _RECORD, _SEAL, IndexDamaged, IndexRecord, PersistentIndex, _decode

log = logging.getLogger(__name__)

#: Records read per step: whole steps of fixed-size records are joined without a Python
#: call per record, and no more than this many objects live at once.
SCAN_CHUNK = 65536
#: A fixed-size record (no block runs): slot, nbytes, checksum, parent, has_parent, seal.
RECORD_DTYPE = np.dtype({"names": ["slot", "nbytes", "checksum", "parent", "has_parent", "seal"],
                         "formats": ["<u8", "<u4", "<u8", "V16", "u1", "<u8"],
                         "offsets": [0, 8, 12, 20, 36, 37], "itemsize": _RECORD.size + _SEAL.size})


@dataclass
class RecordArrays:
    """Fixed-size records of one tier as columns (row i is one page)."""

    keys: bytes               # n * 16 bytes
    slot: np.ndarray          # uint64
    nbytes: np.ndarray        # uint32
    checksum: np.ndarray      # uint64
    parents: bytes            # n * 16 bytes (zeros where has_parent is False)
    has_parent: np.ndarray    # bool

    def __len__(self) -> int:
        return len(self.slot)

    def concat(self, more: RecordArrays) -> RecordArrays:
        return RecordArrays(self.keys + more.keys, np.concatenate([self.slot, more.slot]),
                            np.concatenate([self.nbytes, more.nbytes]), np.concatenate([self.checksum, more.checksum]),
                            self.parents + more.parents, np.concatenate([self.has_parent, more.has_parent]))

    def take(self, keep: np.ndarray) -> RecordArrays:
        """The records where ``keep`` (a bool mask) is set."""
        return RecordArrays(take_keys(self.keys, keep), self.slot[keep], self.nbytes[keep], self.checksum[keep],
                            take_keys(self.parents, keep), self.has_parent[keep])


def _seals(keys: bytes, values: bytes | bytearray, size: int, body: int) -> np.ndarray:
    """The seal each fixed-size record should carry: xxh3-64 of its key and the first
    ``body`` bytes of its value (in C where the extension is built)."""
    if _native is not None:
        return np.frombuffer(_native.seal_records(keys, values, KEY_BYTES, size, body), dtype="<u8")
    seal = xxhash.xxh3_64_intdigest
    mv = memoryview(values)
    return np.array([seal(keys[i * KEY_BYTES:(i + 1) * KEY_BYTES] + mv[i * size:i * size + body])
                     for i in range(len(keys) // KEY_BYTES)], dtype=np.uint64)


def packed_values(arrays: RecordArrays) -> list[bytes]:
    """Each record's stored value (fixed size: no block runs), sealed, byte for byte what
    :meth:`IndexRecord.pack` gives, packed and sealed in one pass over the columns."""
    raw = packed_blob(arrays)
    size = RECORD_DTYPE.itemsize
    return [raw[i:i + size] for i in range(0, len(raw), size)]


def packed_blob(arrays: RecordArrays) -> bytes:
    """:func:`packed_values` back to back, in one bytes object."""
    n = len(arrays)
    rec = np.zeros(n, dtype=RECORD_DTYPE)
    rec["slot"] = arrays.slot
    rec["nbytes"] = arrays.nbytes
    rec["checksum"] = arrays.checksum
    rec["parent"] = np.frombuffer(arrays.parents, dtype="V16")
    rec["has_parent"] = arrays.has_parent
    rec["parent"][~np.asarray(arrays.has_parent, dtype=bool)] = bytes(KEY_BYTES)
    size = RECORD_DTYPE.itemsize
    rec["seal"] = _seals(arrays.keys, rec.tobytes(), size, size - _SEAL.size)
    return rec.tobytes()


def scan_records(index: PersistentIndex, tier: str, valid: Callable[[RecordArrays], np.ndarray],
                 valid_one: Callable[[IndexRecord], bool]) -> tuple[RecordArrays, list[IndexRecord], int]:
    """Every record of ``tier`` that is whole and valid, and how many were dropped (deleted
    in the same transaction).

    Fixed-size records come back as arrays, judged by ``valid`` (a bool mask over them,
    asked only of the whole ones); the others (with block runs) as records, each judged by
    ``valid_one`` after the arrays.
    """
    size = RECORD_DTYPE.itemsize
    body = size - _SEAL.size
    try:
        with index._env.begin(db=index._dbs[tier], write=True) as txn:
            # Streamed into flat buffers: no Python object per record outlives its step.
            keys_buf, vals_buf = bytearray(), bytearray()
            other: list[tuple[bytes, bytes]] = []
            records = txn.cursor().iternext(keys=True, values=True)
            while chunk := list(islice(records, SCAN_CHUNK)):
                ks, vs = zip(*chunk)
                if set(map(len, ks)) == {KEY_BYTES} and set(map(len, vs)) == {size}:
                    keys_buf += b"".join(ks)
                    vals_buf += b"".join(vs)
                    continue
                for k, v in chunk:
                    if len(k) == KEY_BYTES and len(v) == size:
                        keys_buf += k
                        vals_buf += v
                    else:
                        other.append((k, v))
            keys = bytes(keys_buf)
            del keys_buf
            rec = np.frombuffer(vals_buf, dtype=RECORD_DTYPE)
            seals = _seals(keys, vals_buf, size, body)
            whole = (seals == rec["seal"]) & (rec["has_parent"] <= 1)
            if not whole.all():
                log.warning("index: %d %s records fail their seal; those pages are misses",
                            int((~whole).sum()), tier)
            arrays = RecordArrays(keys, rec["slot"].copy(), rec["nbytes"].copy(),
                                  rec["checksum"].copy(), rec["parent"].tobytes(), rec["has_parent"] == 1)
            del rec
            keep = np.zeros(len(seals), dtype=bool)
            if whole.all():
                keep = np.asarray(valid(arrays), dtype=bool)
            elif whole.any():
                keep[whole] = valid(arrays.take(whole))
            bad = np.flatnonzero(~keep).tolist()
            for i in bad:
                txn.delete(keys[i * KEY_BYTES:(i + 1) * KEY_BYTES])
            kept: list[IndexRecord] = []
            dropped = len(bad)
            for k, v in other:
                one = _decode(k, v)
                if one is not None and valid_one(one):
                    kept.append(one)
                else:
                    dropped += 1
                    txn.delete(k)
    except (lmdb.Error, SystemError) as exc:
        if isinstance(exc, _OPERATIONAL):  # resources, locks, a read-only env: not the file
            raise TierIOError(f"walking the {tier} records failed: {exc}") from None
        raise IndexDamaged(f"walking the {tier} records failed: {exc}") from None
    return (arrays.take(keep) if bad else arrays), kept, dropped
