"""Checks a store's LMDB index in a child process before the store trusts it.

LMDB trusts its own page pointers: a damaged file can make a reader fault (SIGBUS or
SIGSEGV on a page past the end of the map) or trip an assertion (abort) on a write,
rather than raise. So before the store opens an index (always by default; or only
after a shutdown that left no ``clean`` marker), a child process walks every database
and record and rehearses the store's write paths in a transaction it aborts (with two
CPUs, children share that work at once: :func:`probe_index`); if a child dies or fails,
the store sets the index aside and starts empty instead of crashing the serving engine.
A child imports only ``lmdb`` (and ``xxhash`` when it also counts the records that fail
their seals: ``probe_index(seals=True)``, a diagnostic; the store reads and checks the
records itself when it opens). Called by :func:`tierkv.store.index.open_index`.
"""

from __future__ import annotations

import errno
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

from tierkv.errors import ConfigError

_WALK = r"""
import os
import sys
import lmdb
# The jobs: "walk" or "seals" (read every record; seals: and check it), each optionally of
# the keys below MID ("walk:lo") or from it ("walk:hi"), and "rehearse".
MID = b"\x80"   # page keys are hashes: half of them on each side
jobs = dict(j.partition(":")[::2] for j in sys.argv[2].split(","))
# A reader opens the environment read-only, so that opening its databases does not wait
# for a sibling's write rehearsal.
env = lmdb.open(sys.argv[1], readonly="rehearse" not in jobs, lock=True, subdir=True, max_dbs=16, map_size=1 << 36)
with env.begin() as txn:
    names = [bytes(k) for k, _ in txn.cursor()]
dbs = [env.open_db(name, create=False) for name in names]
unsealed = 0
read = "seals" if "seals" in jobs else "walk" if "walk" in jobs else None
if read is not None:
    half = jobs[read]
    if read == "seals":   # every record ends with xxh3-64 of its key and the rest
        from xxhash import xxh3_64_intdigest as seal
    with env.begin() as txn:
        for db in dbs:
            cursor = txn.cursor(db=db)
            more = cursor.set_range(MID) if half == "hi" else cursor.first()
            for key, value in cursor.iternext() if more else ():
                if half == "lo" and key >= MID:
                    break
                if read == "seals" and (len(value) < 8 or seal(key + value[:-8]) != int.from_bytes(value[-8:], "little")):
                    unsealed += 1
# A damaged tree can also trip LMDB's assertions on the write paths the store takes
# (deleting records, inserting new ones), so rehearse them and throw the rehearsal away.
if "rehearse" in jobs:
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
#: The child walk's deadline grows by a second per this many bytes of index: it walks
#: about 70 MB/s here with seals checked (about 100 bytes a record), so this is 7x slack.
PROBE_BYTES_PER_S = 10e6

# LMDB's meta pages (the first two pages of data.mdb): a 16-byte page header, then the
# meta: magic, version, address, map size, two 48-byte database records (the first one's
# pad field holds the page size), the last page in use and the transaction id.
_META = struct.Struct("<II8xQ")           # magic, version, (address), map size; at byte 16
_PSIZE_AT, _LAST_AT = 40, 136
_LMDB_MAGIC = 0xBEEFC0DE


def check_index_file(path: Path) -> str | None:
    """Whether ``path/data.mdb`` is as long as its own meta pages say: a file cut short
    makes LMDB fault (SIGBUS) on its first read past the end, in every process that maps
    it, readers included. None if so, or if there is no file or it is not LMDB's (LMDB
    reports that itself); else why not. Reads the two meta pages only."""
    mdb = path / "data.mdb"
    try:
        with open(mdb, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = f.read(4096)
            if len(first) < _LAST_AT + 16:
                return f"data.mdb is {size} bytes: shorter than LMDB's header"
            magic, _version, _mapsize = _META.unpack_from(first, 16)
            if magic != _LMDB_MAGIC:
                return None
            (psize,) = struct.unpack_from("<I", first, _PSIZE_AT)
            if not 512 <= psize <= 1 << 16 or psize & (psize - 1):
                return None
            f.seek(psize)
            second = f.read(_LAST_AT + 16)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.EIO:  # the medium fails under it: LMDB would fault on it too
            return f"cannot read data.mdb: {exc}"
        # Permissions, descriptors, memory: nothing says the file is damaged, so it must
        # not be set aside (its pages would be lost); the open fails with the reason.
        raise ConfigError(f"cannot read the store index {mdb}: {exc}") from None
    metas = [struct.unpack_from("<QQ", page, _LAST_AT) for page in (first, second)
             if len(page) >= _LAST_AT + 16 and struct.unpack_from("<I", page, 16)[0] == _LMDB_MAGIC]
    if len(metas) < 2:
        return f"data.mdb is {size} bytes: its second meta page is missing"
    last_pg, _txnid = max(metas, key=lambda m: m[1])
    need = (last_pg + 1) * psize
    if size < need:
        return f"data.mdb is {size} bytes, but its header says it holds {last_pg + 1} pages ({need} bytes): truncated"
    return None


def probe_index(path: Path, timeout_s: float | None = None, seals: bool = False) -> tuple[str | None, int]:
    """Walk the LMDB environment at ``path`` in children: (None if healthy, else why not; how
    many records fail their seal, counted only if ``seals``, else 0). ``timeout_s``: by
    default 120 s plus a second per :data:`PROBE_BYTES_PER_S` of data.mdb, so that a large
    healthy index is never taken for a hung walk (and set aside)."""
    if timeout_s is None:
        try:
            size = (path / "data.mdb").stat().st_size
        except OSError:
            size = 0
        timeout_s = 120.0 + size / PROBE_BYTES_PER_S
    walk = "seals" if seals else "walk"
    # With two CPUs, children share the work at once (LMDB lets readers and a writer work
    # side by side): the write rehearsal, and the read (checking seals, twice the
    # rehearsal's time: in two children, each half of the keys); the check takes about the
    # longest of them instead of their sum (a million pages: 0.8 -> 0.55 s, with seals 1.5
    # -> 1.0, docs/benchmarks.md). With one CPU, a single child does all.
    if _cpus() < 2:
        modes = [f"{walk},rehearse"]
    else:
        modes = ["seals:lo", "seals:hi", "rehearse"] if seals else ["walk", "rehearse"]
    deadline = time.monotonic() + timeout_s
    procs = [subprocess.Popen([sys.executable, "-c", _WALK, str(path), m], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for m in modes]
    unsealed, why = 0, None
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return f"walking the index took over {timeout_s:.0f} s", 0
            if proc.returncode == 0:
                last = out.strip().splitlines()[-1:] or ["0"]
                unsealed += int(last[0]) if last[0].isdigit() else 0
            elif why is None:
                if proc.returncode < 0:
                    why = f"walking the index killed the checker with signal {-proc.returncode}"
                else:
                    why = f"walking the index failed: {(err.strip().splitlines()[-1:] or ['no message'])[0]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return (why, 0) if why is not None else (None, unsealed)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def was_clean(store_dir: Path) -> bool:
    """Whether the last writer closed the store cleanly (and no writer has opened it since)."""
    return (store_dir / CLEAN_MARKER).is_file()


def mark_clean(store_dir: Path, clean: bool) -> None:
    """Set or clear the clean-shutdown marker (writers only); ConfigError if something
    other than a file sits where the marker goes."""
    marker = store_dir / CLEAN_MARKER
    if marker.is_dir() and not marker.is_symlink():
        raise ConfigError(f"{marker} is a directory; the store keeps its clean-shutdown marker file there: "
                          "remove it")
    if clean:
        marker.touch(mode=0o600)
    else:
        marker.unlink(missing_ok=True)
