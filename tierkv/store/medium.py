"""What is on a tier's medium before a store writes to it: the tierkv label, and the checks
that tell a store's own file or namespace from data that is not a store's.

A store labels the first :data:`LABEL_BYTES` of its data file or namespace. Before it
writes that label on a medium that does not carry its own, :func:`examine` says what is
there: a tierkv label (whose), the marker ``tierkv format`` leaves, nothing (a missing
path, an empty file, a blank medium), or foreign data (signatures found by ``blkid -p``
where it is installed and by our own magic checks, or non-zero bytes). A regular file is
blank when every byte its filesystem holds as data reads as zeros (a sparse file the store
made is all holes); a block device when its first :data:`SCAN_BYTES` and its last
:data:`TAIL_BYTES` read as zeros (a device cannot say which of its blocks hold data).
:func:`format_medium` erases what stops a store from taking a medium and marks it.

Called by :mod:`tierkv.store.opening` (every writer's open of a file or namespace tier)
and by ``tierkv format`` (:mod:`tierkv.cli.format`). Imports only the standard library.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import json
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass

from tierkv.errors import ConfigError, StoreBusyError

# The NVMe data file starts with a 4 KiB label: magic + the store's 16-byte identity,
# then a JSON owner record ({"host", "path", "data_bytes"}) ended by a NUL. Labels
# written before the owner record have zeros there; a writer adds it at its next open.
LABEL_BYTES = 4096
LABEL_MAGIC = b"tierkv-data-v2\n\0"
ID_BYTES = 16
#: What ``tierkv format`` writes at offset 0: any store may take this medium.
FORMAT_MAGIC = b"tierkv-blank-v1\n"
#: Bytes of a medium read for non-zero data: a device's first ones, a file's data extents
#: (a file with more data than this, all zeros so far, is not called blank).
SCAN_BYTES = 8 << 20
#: A device's last bytes read as well (backup GPT, md 0.90/1.0 and ZFS labels live there);
#: ``format_medium`` zeroes this much at each end.
TAIL_BYTES = 1 << 20
_CHUNK = 1 << 20
_BLKID_TIMEOUT_S = 20.0
_SBIN = "/usr/sbin:/sbin"  # where blkid lives when PATH (a user's, a service's) lacks it

# (offset, bytes, name): signatures we look for ourselves, with or without blkid.
_MAGIC = (
    (0, b"XFSB", "xfs superblock"),
    (0, b"LUKS\xba\xbe", "LUKS header"),
    (3, b"NTFS    ", "NTFS boot sector"),
    (510, b"\x55\xaa", "MBR boot signature"),
    (512, b"EFI PART", "GPT header"),
    (4096, b"EFI PART", "GPT header (4 KiB sectors)"),
    (512, b"LABELONE", "LVM2 physical volume label"),
    (1080, b"\x53\xef", "ext2/3/4 superblock"),
    (0, b"\xfc\x4e\x2b\xa9", "md RAID superblock (1.1)"),
    (4096, b"\xfc\x4e\x2b\xa9", "md RAID superblock (1.2)"),
    (4086, b"SWAPSPACE2", "swap"),
    (65526, b"SWAPSPACE2", "swap (64 KiB pages)"),
    (65536 + 64, b"_BHRfS_M", "btrfs superblock"),
)


class Contents(enum.Enum):
    """What a medium holds, as far as a store taking it goes."""

    MISSING = "missing"        # no such path: a store creates the file
    EMPTY = "empty"            # a 0-byte file
    BLANK = "blank"            # no signature, zeros wherever looked
    FORMATTED = "formatted"    # marked by tierkv format
    TIERKV = "tierkv"          # a tierkv store's label (this store's or another's)
    FOREIGN = "foreign"        # anything else: a store takes it only where allowed

    @property
    def takeable(self) -> bool:
        """Whether any store may label a medium holding this without being told to."""
        return self in (Contents.MISSING, Contents.EMPTY, Contents.BLANK, Contents.FORMATTED)


@dataclass(frozen=True)
class Medium:
    """What :func:`examine` found at ``path``. ``head``: its first LABEL_BYTES (zero-padded);
    ``signatures``: what blkid and our magic checks name; ``blkid``: "found", "none",
    "not installed" or why it failed; ``nonzero``: whether non-zero bytes were read (None:
    more data than :data:`SCAN_BYTES`, all zeros as far as read; not scanned media carry a label)."""

    path: str
    kind: str                  # "missing", "regular file", "block device", "directory", "other"
    size_bytes: int
    head: bytes
    contents: Contents
    signatures: tuple[str, ...] = ()
    blkid: str = "not run"
    nonzero: bool | None = False

    def owner(self) -> dict[str, object] | None:
        """The tierkv label's identity (hex) and owner record; None without a label."""
        if self.contents is not Contents.TIERKV:
            return None
        return {"identity": self.head[len(LABEL_MAGIC):len(LABEL_MAGIC) + ID_BYTES].hex(), **owner_record(self.head)}

    def describe(self) -> str:
        """What is there, in a few words: ``a regular file of 2345 bytes: non-zero bytes, no signature``."""
        what = f"a {self.kind} of {self.size_bytes} bytes" if self.kind != "missing" else "nothing"
        if self.contents is Contents.TIERKV:
            who = self.owner() or {}
            at = f"{who.get('path')} on host {who.get('host')}" if "path" in who else "an unnamed owner"
            return f"{what}: the label of tierkv store {who.get('identity')} at {at}"
        if self.contents is not Contents.FOREIGN:
            return f"{what}: {self.contents.value}"
        sigs = f"signatures {', '.join(self.signatures)}" if self.signatures else "no known signature"
        data = {True: "non-zero bytes", False: "zeros where read",
                None: f"more than {SCAN_BYTES >> 20} MiB of data"}[self.nonzero]
        return f"{what}: {data}, {sigs}"

    def as_json(self) -> dict[str, object]:
        return {"path": self.path, "kind": self.kind, "size_bytes": self.size_bytes,
                "contents": self.contents.value, "store_may_take": self.contents.takeable,
                "signatures": list(self.signatures), "blkid": self.blkid, "nonzero": self.nonzero,
                "tierkv_label": self.owner()}


def owner_record(head: bytes) -> dict[str, object]:
    """The owner record of a tierkv label; {} where there is none (an older label)."""
    body = head[len(LABEL_MAGIC) + ID_BYTES:LABEL_BYTES].split(b"\0", 1)[0]
    try:
        rec = json.loads(body) if body else {}
    except ValueError:  # UnicodeDecodeError included
        return {}
    return rec if isinstance(rec, dict) else {}


def label_data_bytes(head: bytes) -> int | None:
    """The data bytes the store that labelled this header uses (None: no tierkv label, or
    one written before labels recorded it). Sizes an NVMe-oF tier whose namespace grew."""
    if not head.startswith(LABEL_MAGIC):
        return None
    size = owner_record(head).get("data_bytes")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def examine(path: str | os.PathLike[str], *, blkid: bool = True) -> Medium:
    """What is at ``path`` (read only; follows symlinks). ``blkid`` False skips ``blkid -p``
    (our own checks still run). A labelled or marked medium is not scanned further.
    Raises ConfigError naming the path when it cannot be read."""
    where = os.fspath(path)
    try:
        st = os.stat(where)
    except FileNotFoundError:
        return Medium(where, "missing", 0, bytes(LABEL_BYTES), Contents.MISSING)
    except OSError as e:
        raise ConfigError(f"cannot look at {where}: {e.strerror}") from None
    kind = ("regular file" if stat.S_ISREG(st.st_mode) else "block device" if stat.S_ISBLK(st.st_mode)
            else "directory" if stat.S_ISDIR(st.st_mode) else "other")
    if kind in ("directory", "other"):
        return Medium(where, kind, 0, bytes(LABEL_BYTES), Contents.FOREIGN, nonzero=None)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"cannot open {where} to see what it holds: {e.strerror}") from None
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        head = os.pread(fd, LABEL_BYTES, 0).ljust(LABEL_BYTES, b"\0")
        if size == 0:
            return Medium(where, kind, 0, head, Contents.EMPTY)
        if head.startswith(LABEL_MAGIC):
            return Medium(where, kind, size, head, Contents.TIERKV, nonzero=True)
        if head.startswith(FORMAT_MAGIC):
            return Medium(where, kind, size, head, Contents.FORMATTED, nonzero=True)
        start = os.pread(fd, min(size, SCAN_BYTES), 0)
        tail = os.pread(fd, min(size, TAIL_BYTES), size - min(size, TAIL_BYTES))
        signatures = _magic(start, tail)
        nonzero = _file_nonzero(fd, size) if kind == "regular file" else not (_zeros(start) and _zeros(tail))
    except OSError as e:
        raise ConfigError(f"cannot read {where} to see what it holds: {e.strerror}") from None
    finally:
        os.close(fd)
    found, ran = _blkid(where) if blkid else ((), "not run")
    signatures = tuple(dict.fromkeys(found + signatures))
    contents = Contents.FOREIGN if signatures or nonzero is not False else Contents.BLANK
    return Medium(where, kind, size, head, contents, signatures, ran, nonzero)


def _zeros(buf: bytes) -> bool:
    return buf.count(0) == len(buf)


def _magic(start: bytes, tail: bytes) -> tuple[str, ...]:
    """Names of the signatures in ``start`` (a medium's first bytes) and ``tail`` (its last)."""
    found = [name for at, magic, name in _MAGIC if start[at:at + len(magic)] == magic]
    for at in (512, 4096):  # a backup GPT header sits in the last sector
        if len(tail) >= at and tail[len(tail) - at:len(tail) - at + 8] == b"EFI PART":
            found.append("backup GPT header")
    return tuple(dict.fromkeys(found))


def _file_nonzero(fd: int, size: int) -> bool | None:
    """Whether a regular file holds a non-zero byte in the data its filesystem keeps (holes
    read as zeros); None when it holds more than SCAN_BYTES of data, all zeros so far."""
    pos, scanned = 0, 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
            end = os.lseek(fd, start, os.SEEK_HOLE)
        except OSError as e:
            if e.errno == errno.ENXIO:        # no data past pos
                return False
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            start, end = pos, size            # no hole support: every byte is data
        while start < end:
            if scanned >= SCAN_BYTES:
                return None
            n = min(end - start, _CHUNK, SCAN_BYTES - scanned)
            buf = os.pread(fd, n, start)
            if not buf:
                return False
            if not _zeros(buf):
                return True
            start += len(buf)
            scanned += len(buf)
        pos = end
    return False


def _blkid(path: str) -> tuple[tuple[str, ...], str]:
    """Signatures ``blkid -p`` finds (``TYPE=ext4 USAGE=filesystem``), and how it went."""
    exe = shutil.which("blkid") or shutil.which("blkid", path=_SBIN)
    if exe is None:
        return (), "not installed"
    try:
        proc = subprocess.run([exe, "-p", "-o", "export", os.path.abspath(path)], capture_output=True, text=True,
                              timeout=_BLKID_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return (), f"failed: {e}"
    if proc.returncode == 2:
        return (), "none"
    if proc.returncode == 8:
        return ("blkid: several signatures (ambivalent)",), "found"
    if proc.returncode != 0:
        return (), f"failed (exit {proc.returncode}): {' '.join(proc.stderr.split())[:200]}"
    keys = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    named = " ".join(f"{k}={keys[k]}" for k in ("TYPE", "PTTYPE", "USAGE", "LABEL") if k in keys)
    return (f"blkid: {named or 'a signature'}",), "found"


def format_medium(path: str | os.PathLike[str]) -> tuple[tuple[int, int], ...]:
    """Erase what stops a store from taking ``path`` and mark it: zero its first and last
    TAIL_BYTES (where the signatures blkid and :func:`examine` know of live), then write
    :data:`FORMAT_MAGIC` at offset 0 and sync. Returns the ``(offset, bytes)`` ranges zeroed.

    A file keeps its size and the rest of its bytes. Takes a non-empty regular file or block
    device (ConfigError otherwise); StoreBusyError for a device that is mounted or held
    exclusively, or a file whose store's writer holds its lock; on an I/O error, OSError.
    """
    found = examine(path, blkid=False)
    if found.kind not in ("regular file", "block device") or found.size_bytes == 0:
        raise ConfigError(f"tierkv format takes a non-empty regular file or a block device; {found.path} is "
                          f"{found.describe()}")
    block = found.kind == "block device"
    try:
        fd = os.open(found.path, os.O_WRONLY | os.O_CLOEXEC | (os.O_EXCL if block else 0))
    except OSError as e:
        if e.errno == errno.EBUSY:
            raise StoreBusyError(f"{found.path} is in use (mounted, or held by another program); "
                                 "not formatting it") from None
        raise
    try:
        if not block:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreBusyError(f"{found.path} is in use by a tierkv store's writer; close it first") from None
        size = found.size_bytes
        tail_at = max(min(size, TAIL_BYTES), size - TAIL_BYTES)
        spans = ((0, min(size, TAIL_BYTES)),) + (((tail_at, size - tail_at),) if size > tail_at else ())
        for at, n in spans:
            for off in range(at, at + n, _CHUNK):
                os.pwrite(fd, bytes(min(_CHUNK, at + n - off)), off)
        if size >= len(FORMAT_MAGIC):  # a shorter file is left all zeros: blank
            os.pwrite(fd, FORMAT_MAGIC, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return spans
