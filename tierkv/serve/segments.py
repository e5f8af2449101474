"""The client segments the node service maps: per connection, and bounded for the daemon.

A client registers shared-memory segments (``memfd``, sealed against shrinking) with
``SEGMENT`` and gives one back with ``UNREGISTER`` (:mod:`tierkv.serve.protocol`); a
request then names rows or tokens by segment and offset. :class:`Segments` is one
connection's table of mappings (used by its thread only); :class:`SegmentBudget` is
the daemon's bound over all of them together: a mapping holds a descriptor (Python's
mmap keeps a dup of it) and address space (a memfd may be sparse), so both are capped.
Used by :mod:`tierkv.serve.daemon`.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import resource
import struct
import threading

import numpy as np

from tierkv.errors import InputError, StoreBusyError
from tierkv.serve import protocol as P

log = logging.getLogger(__name__)

#: Bytes of segments one connection may have mapped, and all of them together: a memfd
#: may be sparse, so without a bound a client could take the daemon's address space.
MAX_CONN_SEGMENT_BYTES = 1 << 40
MAX_SEGMENT_BYTES = 32 << 40
#: Segments one connection may have registered at once (``UNREGISTER`` gives one back).
MAX_SEGMENTS = 64


class SegmentBudget:
    """How many segments, and bytes, the daemon has mapped over every connection, within
    its open-file limit and ``MAX_SEGMENT_BYTES``. Thread-safe."""

    def __init__(self, max_clients: int) -> None:
        self._lock = threading.Lock()
        self.mapped = 0
        self.mapped_bytes = 0
        self.limit = _descriptor_budget(max_clients)

    def take(self, new: bool, grow: int) -> None:
        """Account for a mapping (``new``: one more, else one replaced) of ``grow`` more
        bytes; StoreBusyError where that would pass a bound."""
        with self._lock:
            if new and self.mapped >= self.limit:
                raise StoreBusyError(f"the daemon maps {self.mapped} segments, all its open-file limit allows; "
                                     "retry later or raise the daemon's RLIMIT_NOFILE")
            if self.mapped_bytes + grow > MAX_SEGMENT_BYTES:
                raise StoreBusyError("the daemon's clients have mapped all the segment bytes it allows; retry later")
            self.mapped += new
            self.mapped_bytes += grow

    def give(self, gone: int, nbytes: int) -> None:
        """``gone`` mappings of ``nbytes`` in all were unmapped (or never made)."""
        with self._lock:
            self.mapped -= gone
            self.mapped_bytes -= nbytes


class Segments:
    """One connection's segments by id. Used by that connection's thread only."""

    def __init__(self, budget: SegmentBudget) -> None:
        self._budget = budget
        self._maps: dict[int, mmap.mmap] = {}

    def __len__(self) -> int:
        return len(self._maps)

    def register(self, body: memoryview, fds: list[int]) -> bytes:
        """``SEGMENT``: map the memfd that came with the request as segment ``seg``
        (replacing a mapping of the same id: a client's grown scratch)."""
        seg, size = _unpack(P.SEGMENT_REQ, body)
        if len(fds) != 1:
            raise P.ProtocolError(f"SEGMENT came with {len(fds)} file descriptors, not 1")
        fd = fds[0]
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise InputError("a page segment must be a memfd (sealable shared memory)") from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise InputError("a page segment must be sealed against shrinking (F_SEAL_SHRINK)")
        st = os.fstat(fd)
        if not size or st.st_size < size:
            raise InputError(f"page segment {seg}: {size} bytes declared, the memfd holds {st.st_size}")
        new = seg not in self._maps
        if new and len(self._maps) >= MAX_SEGMENTS:
            raise InputError(f"a connection may register at most {MAX_SEGMENTS} page segments; give back those "
                             "no longer used (RemoteStore.release_buffer)")
        mine = sum(len(m) for k, m in self._maps.items() if k != seg)
        if mine + size > MAX_CONN_SEGMENT_BYTES:
            raise InputError(f"a connection may map at most {MAX_CONN_SEGMENT_BYTES >> 40} TiB of segments; "
                             f"{mine} bytes are mapped and {size} more asked for")
        grow = size - (0 if new else len(self._maps[seg]))
        self._budget.take(new, grow)
        try:
            # MAP_POPULATE: the page tables are filled now, when the client registers the
            # segment, instead of by page faults during its first put or get (a 47 MB buffer
            # costs ~20 ms of faults, which its first transfer would otherwise pay). Only
            # where the client has allocated the whole segment already (its page buffers
            # are): populating a sparse memfd would allocate its holes here, letting a
            # client spend the daemon's memory.
            populate = _POPULATE if os.fstat(fd).st_blocks * 512 >= size else 0
            m = mmap.mmap(fd, size, mmap.MAP_SHARED | populate, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._budget.give(new, grow)
            raise
        old = self._maps.pop(seg, None)
        if old is not None:
            _unmap(old)
        self._maps[seg] = m
        return b""

    def unregister(self, body: memoryview) -> bytes:
        """``UNREGISTER``: unmap segment ``seg`` (nothing if this connection has none of that id)."""
        (seg,) = _unpack(P.UNREGISTER_REQ, body)
        m = self._maps.pop(seg, None)
        if m is not None:
            size = len(m)
            _unmap(m)
            self._budget.give(1, size)
        return b""

    def rows(self, seg: int, off: int, rows: int, page_bytes: int) -> np.ndarray:
        """``rows`` pages of ``page_bytes`` at ``off`` in segment ``seg``, in place."""
        m = self._get(seg, "page")
        if off + rows * page_bytes > len(m):
            raise InputError(f"{rows} pages at offset {off} run past page segment {seg} ({len(m)} bytes)")
        return np.frombuffer(m, dtype=np.uint8, count=rows * page_bytes, offset=off).reshape(rows, page_bytes)

    def words(self, seg: int, off: int, count: int) -> np.ndarray:
        """``count`` uint64 words at ``off`` in segment ``seg``, in place (a landing record
        the daemon writes as a layered get goes)."""
        m = self._get(seg, "record")
        if off % 8 or off + 8 * count > len(m):
            raise InputError(f"{count} aligned words at offset {off} run past segment {seg} ({len(m)} bytes)")
        return np.frombuffer(m, dtype=np.uint64, count=count, offset=off)

    def tokens(self, seg: int, off: int, count: int, copy: bool = True) -> np.ndarray:
        """``count`` tokens (uint32) at ``off`` in segment ``seg``, copied out, so that the
        client cannot change them while the store reads them; ``copy`` False: a read-only
        view, to be dropped before the connection's next request (which may unregister
        the segment)."""
        m = self._get(seg, "token")
        if off % 4 or off + 4 * count > len(m):
            raise InputError(f"{count} tokens at offset {off} run past segment {seg} ({len(m)} bytes)")
        view = np.frombuffer(m, dtype="<u4", count=count, offset=off)
        if copy:
            return view.copy()
        view.flags.writeable = False
        return view

    def _get(self, seg: int, what: str) -> mmap.mmap:
        m = self._maps.get(seg)
        if m is None:
            raise P.ProtocolError(f"{what} segment {seg} was not registered on this connection")
        return m

    def close(self) -> None:
        """Unmap every segment (the connection ended)."""
        maps, self._maps = self._maps, {}
        nbytes = sum(len(m) for m in maps.values())
        for m in maps.values():
            _unmap(m)
        self._budget.give(len(maps), nbytes)


def _descriptor_budget(max_clients: int) -> int:
    """How many segments the daemon may map at once: its open-file limit (raised to the
    hard limit where that is higher), less a reserve for the store, sockets and
    connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        except (ValueError, OSError):
            pass
    budget = soft - 256 - 2 * max_clients
    if budget < max_clients:
        log.warning("the open-file limit (%d) leaves room for %d client segments; raise RLIMIT_NOFILE", soft,
                    max(budget, 0))
    return max(budget, 1)


def _unpack(fmt: struct.Struct, body: memoryview) -> tuple[int, ...]:
    if len(body) < fmt.size:
        raise P.ProtocolError(f"a request of {len(body)} bytes is shorter than its {fmt.size}-byte header")
    return fmt.unpack_from(body)


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _unmap(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:  # a view still exported (a request mid-flight): freed with it
        pass
