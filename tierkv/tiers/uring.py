"""io_uring rings for the NVMe tier's reads: whether they work here, and a pool of them.

The rings come from the optional C extension ``tierkv.tiers._uring`` (raw syscalls, no
liburing). One ring keeps up to ``entries`` reads in flight from a single thread, where
the thread pool needs a thread per read in flight; see ``docs/benchmarks.md``, "NVMe read
path: io_uring vs thread pool (issue 20)", for what that buys. :func:`available` is false
where the extension is not built, where the kernel or a seccomp filter refuses
``io_uring_setup``, or where the environment sets ``TIERKV_IO_URING=0``; the tier then
reads with its thread pool. The tier reads through a ring only when asked to (its
``io_uring=True``, or ``TIERKV_IO_URING=1``): on the disk measured so far it reads no faster
than the pool, only on less CPU. Used by :mod:`tierkv.tiers.nvme`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

logger = logging.getLogger(__name__)

#: ``1``: NVMe tiers built without an ``io_uring`` argument read through io_uring (where it
#: works); ``0``: none does, whatever its argument says.
ENV_SWITCH = "TIERKV_IO_URING"


class Ring(Protocol):
    """What ``tierkv.tiers._uring.Ring`` offers (its module notes have the details)."""

    @property
    def entries(self) -> int: ...
    @property
    def inflight(self) -> int: ...
    def readv(self, fd: int, offset: int, buffers: Sequence[memoryview], tag: int) -> None: ...
    def submit(self) -> None: ...
    def wait(self, n: int = 1) -> list[tuple[int, int]]: ...
    def close(self) -> None: ...


def _new_ring(entries: int) -> Ring:
    from tierkv.tiers._uring import Ring as _Ring  # type: ignore[import-not-found,unused-ignore]

    ring: Ring = _Ring(entries)
    return ring


@functools.cache
def _probe() -> str | None:
    """None where a ring can be set up here, else why not."""
    try:
        _new_ring(2).close()
    except ImportError:
        return "the tierkv.tiers._uring extension is not built"
    except OSError as e:
        return f"io_uring_setup failed: {e}"
    return None


def requested() -> bool:
    """Whether the environment asks tiers that were given no ``io_uring`` argument to use it."""
    return os.environ.get(ENV_SWITCH, "") == "1"


def available() -> bool:
    """Whether the NVMe tier can read through io_uring here (logs why not, once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    why = _probe()
    if why is not None:
        _warn_once(why)
    return why is None


@functools.cache
def _warn_once(why: str) -> None:
    logger.info("io_uring unavailable (%s): the NVMe tier reads with its thread pool", why)


class RingPool:
    """Idle rings of ``entries`` each, lent one per transfer; thread-safe.

    ``borrow`` hands out an idle ring or sets up a new one. A ring comes back to the pool
    when its transfer ends normally; after an exception, or once the pool is closed, it is
    closed instead (``close`` on a ring first waits for its reads still in flight, so no
    kernel write into a caller's buffer outlives the transfer).
    """

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._idle: list[Ring] = []
        self._lock = threading.Lock()
        self._closed = False

    @contextmanager
    def borrow(self) -> Iterator[Ring]:
        with self._lock:
            ring = self._idle.pop() if self._idle else None
        if ring is None:
            ring = _new_ring(self.entries)
        try:
            yield ring
        except BaseException:
            ring.close()
            raise
        with self._lock:
            if not self._closed:
                self._idle.append(ring)
                return
        ring.close()

    def close(self) -> None:
        """Close the idle rings; rings out on loan close when they come back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for ring in idle:
            ring.close()
