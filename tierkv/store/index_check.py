"""Checks a store's LMDB index in a child process before the store trusts it.

LMDB trusts its own page pointers: a damaged file can make a reader fault (SIGBUS or
SIGSEGV on a page past the end of the map) or trip an assertion (abort) on a write,
rather than raise. So before the store opens an index (always by default; or only
after a shutdown that left no ``clean`` marker), a child process walks every database
and record and rehearses the store's write paths in a transaction it aborts; if the
child dies or fails, the store sets the index aside and starts empty instead of
crashing the serving engine. The child imports only ``lmdb`` (and ``xxhash`` when it
also counts the records that fail their seals: the store asks that when it may load a
clean close's index image instead of reading the records itself). Called by :func:`tierkv.store.index.open_index`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_WALK = r"""
import os
import sys
import lmdb
env = lmdb.open(sys.argv[1], readonly=False, lock=True, subdir=True, max_dbs=16, map_size=1 << 36)
with env.begin() as txn:
    names = [bytes(k) for k, _ in txn.cursor()]
dbs = [env.open_db(name, create=False) for name in names]
unsealed = 0
with env.begin() as txn:
    if sys.argv[2] == "seals":  # every record ends with xxh3-64 of its key and the rest
        from xxhash import xxh3_64_intdigest as seal
        for db in dbs:
            for key, value in txn.cursor(db=db):
                if len(value) < 8 or seal(key + value[:-8]) != int.from_bytes(value[-8:], "little"):
                    unsealed += 1
    else:
        for db in dbs:
            for _key, _value in txn.cursor(db=db):
                pass
# A damaged tree can also trip LMDB's assertions on the write paths the store takes
# (deleting records, inserting new ones), so rehearse them and throw the rehearsal away.
txn = env.begin(write=True)
try:
    for db in dbs:
        cursor = txn.cursor(db=db)
        more = cursor.first()
        while more:
            more = cursor.delete()
        for _ in range(64):
            txn.put(os.urandom(16), os.urandom(57), db=db)
finally:
    txn.abort()
print(unsealed)
"""


CLEAN_MARKER = "clean"


def probe_index(path: Path, timeout_s: float = 120.0, seals: bool = False) -> tuple[str | None, int]:
    """Walk the LMDB environment at ``path`` in a child: (None if healthy, else why not; how
    many records fail their seal, counted only if ``seals``, else 0)."""
    try:
        proc = subprocess.run([sys.executable, "-c", _WALK, str(path), "seals" if seals else "walk"],
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"walking the index took over {timeout_s:.0f} s", 0
    if proc.returncode == 0:
        out = proc.stdout.strip().splitlines()[-1:] or ["0"]
        return None, int(out[0]) if out[0].isdigit() else 0
    if proc.returncode < 0:
        return f"walking the index killed the checker with signal {-proc.returncode}", 0
    last = proc.stderr.strip().splitlines()[-1:] or ["no message"]
    return f"walking the index failed: {last[0]}", 0


def was_clean(store_dir: Path) -> bool:
    """Whether the last writer closed the store cleanly (and no writer has opened it since)."""
    return (store_dir / CLEAN_MARKER).exists()


def mark_clean(store_dir: Path, clean: bool) -> None:
    """Set or clear the clean-shutdown marker (writers only)."""
    marker = store_dir / CLEAN_MARKER
    if clean:
        marker.touch(mode=0o600)
    else:
        marker.unlink(missing_ok=True)
