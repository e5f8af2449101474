"""A clean close's image of the slot tiers' index records, which the next open loads in
one read instead of walking LMDB record by record (a Python call per record: about
1 s per million pages).

At a clean close the writer, once its last group commit is durable, writes
``index.image``: for each slot-addressed persistent tier whose page table matches its
LMDB database record for record (the same count; every page the table holds there was
committed), the records as columns (keys, slots, lengths, checksums, parents). The
header names the index's identity and LMDB's last transaction id; a trailer hashes
the whole file. The next writer reads it before it changes anything and deletes it at
once; it is used only when the store was closed cleanly, the identity and transaction
id are still LMDB's (nothing was committed since, by anyone), the hash holds and each
tier's record count is the database's. Anything else, and the tier is walked as before:
an image can make an open faster, never different. Block-addressed (coded) tiers are
always walked: their records carry block runs. Called by :mod:`tierkv.store.api` (write)
and :mod:`tierkv.store.opening` (read).
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import numpy as np
import xxhash

from tierkv.keys import KEY_BYTES
from tierkv.store.index_scan import RecordArrays

log = logging.getLogger(__name__)

IMAGE = "index.image"
_MAGIC = b"TKVIMG01"
_HEAD = struct.Struct("<8s16sQI")      # magic, store identity, LMDB last txnid, tiers
_TIER = struct.Struct("<HQ")           # name length, records
_TRAILER = struct.Struct("<Q")         # xxh3-64 of everything before it
#: Per record: key, slot, length, checksum, parent, has_parent.
_COLUMNS = ((KEY_BYTES, None), (8, "<u8"), (4, "<u4"), (8, "<u8"), (KEY_BYTES, None), (1, "u1"))


def write_image(store_dir: Path, store_id: bytes, txnid: int, tiers: dict[str, RecordArrays]) -> None:
    """Write the image of ``tiers`` (name -> records), stamped with the index's identity and
    last transaction id; replaces any earlier image atomically. OSError on failure."""
    parts = [_HEAD.pack(_MAGIC, store_id, txnid, len(tiers))]
    for name, a in tiers.items():
        raw = name.encode()
        parts += [_TIER.pack(len(raw), len(a)), raw, a.keys, a.slot.astype("<u8").tobytes(),
                  a.nbytes.astype("<u4").tobytes(), a.checksum.astype("<u8").tobytes(), a.parents,
                  a.has_parent.astype("u1").tobytes()]
    body = b"".join(parts)
    path = store_dir / IMAGE
    tmp = path.with_name(IMAGE + ".tmp")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(body)
        f.write(_TRAILER.pack(xxhash.xxh3_64_intdigest(body)))
    os.replace(tmp, path)


def read_image(store_dir: Path, store_id: bytes, txnid: int) -> dict[str, RecordArrays]:
    """The records of the image at ``store_dir`` if it is whole and stamped with this
    identity and transaction id; else nothing (an absent image is the common case)."""
    path = store_dir / IMAGE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("cannot read %s (%s); the index is walked instead", path, exc)
        return {}
    try:
        return _parse(data, store_id, txnid)
    except ValueError as exc:
        log.info("%s is not used (%s); the index is walked instead", path, exc)
        return {}


def drop_image(store_dir: Path) -> None:
    """Delete the image (a writer does, before it commits anything)."""
    (store_dir / IMAGE).unlink(missing_ok=True)
    (store_dir / (IMAGE + ".tmp")).unlink(missing_ok=True)


def _parse(data: bytes, store_id: bytes, txnid: int) -> dict[str, RecordArrays]:
    if len(data) < _HEAD.size + _TRAILER.size:
        raise ValueError("too short")
    body = memoryview(data)[:-_TRAILER.size]
    (want,) = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
    if xxhash.xxh3_64_intdigest(body) != want:
        raise ValueError("its hash does not match: torn or damaged")
    magic, sid, stamped, ntiers = _HEAD.unpack_from(data, 0)
    if magic != _MAGIC:
        raise ValueError("not an index image of this format")
    if sid != store_id:
        raise ValueError("written for another index")
    if stamped != txnid:
        raise ValueError(f"stale: written at transaction {stamped}, the index is at {txnid}")
    out: dict[str, RecordArrays] = {}
    pos = _HEAD.size
    for _ in range(ntiers):
        nlen, n = _TIER.unpack_from(data, pos)
        pos += _TIER.size
        name = bytes(body[pos:pos + nlen]).decode()
        pos += nlen
        cols: list[bytes | np.ndarray] = []
        for width, dtype in _COLUMNS:
            end = pos + n * width
            if end > len(body):
                raise ValueError("truncated")
            cols.append(bytes(body[pos:end]) if dtype is None else np.frombuffer(body[pos:end], dtype=dtype).copy())
            pos = end
        keys, slot, nbytes, checksum, parents, has_parent = cols
        assert isinstance(keys, bytes) and isinstance(parents, bytes)
        assert isinstance(has_parent, np.ndarray)
        out[name] = RecordArrays(keys, slot, nbytes, checksum, parents, has_parent != 0)  # type: ignore[arg-type]
    if pos != len(body):
        raise ValueError("trailing bytes")
    return out
