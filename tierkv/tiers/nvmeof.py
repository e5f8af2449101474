"""The NVMe-oF tier: the NVMe tier's slots on a namespace reached over a fabric, plus its lifecycle.

A fabric namespace can vanish under a running store (target down, port removed,
namespace disabled, link lost), and a syscall on a lost namespace can block for as long
as the kernel keeps retrying. So this tier wraps every transfer of
:class:`~tierkv.tiers.nvme.NvmeTier` in a deadline and keeps a state:

- **available**: transfers run; a monitor thread polls the link (controller state in
  sysfs, through a :class:`NamespaceLink`) every ``monitor_interval_s``.
- **degraded**: entered on an I/O error, a transfer past ``io_timeout_s``, or a link
  that is no longer live. Every transfer fails at once with
  :class:`~tierkv.errors.TierUnavailableError`; the manager then treats the tier as
  absent (its pages are misses, nothing is placed there) but keeps its index, since the
  pages are still on the target. The monitor reattaches the link (reconnecting where the
  kernel has given up), reopens the block device if its name changed, and reads the
  label the store wrote at open: only the same label brings the tier back.

Never wrong data, never a hang: reads land in a private buffer and are copied to the
caller only when they complete in time (a late completion cannot touch the caller's
memory); the slots of a write that timed out are held back from reuse until the
stuck syscall returns, so a late write cannot clobber a page stored after recovery;
and every page read is checked against its checksum by the store anyway.

Built by :mod:`tierkv.store.opening` from ``[tiers.nvmeof]``; the link comes from
:mod:`tierkv.tiers.fabric` (``nvmeof`` host code) or is a fixed device path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from tierkv.chunks import settle
from tierkv.errors import InputError, StoreClosedError, TierIOError, TierUnavailableError
from tierkv.store.pages import PageList
from tierkv.tiers.aligned import ALIGN, aligned_empty
from tierkv.tiers.base import TierKind
from tierkv.tiers.backing import open_backing
from tierkv.tiers.nvme import DEFAULT_MAX_IO_BYTES, NvmeTier

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class LinkStatus:
    """What the link looks like now: the namespace's block device (None when none is
    attached), whether its controller is live, and a human-readable detail."""

    device: str | None
    live: bool
    detail: str


class NamespaceLink(Protocol):
    """How the tier gets and watches its namespace. ``attach`` connects if needed and
    returns the block device path (raising TierIOError when it cannot); ``status`` is a
    cheap poll (sysfs reads); ``reattach`` is one recovery attempt, returning the device
    path once the namespace is back or None; ``close`` releases what the link set up."""

    def attach(self) -> str: ...

    def status(self) -> LinkStatus: ...

    def reattach(self) -> str | None: ...

    def close(self) -> None: ...


class StaticLink:
    """A namespace (or any block device or file) that something else connected: the
    link is live while the path exists. Used for ``device = "/dev/..."`` without
    fabric parameters, and by tests on a plain file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def attach(self) -> str:
        if not os.path.exists(self.path):
            raise TierIOError(f"nvmeof tier: device {self.path} does not exist (namespace not connected?)")
        return self.path

    def status(self) -> LinkStatus:
        there = os.path.exists(self.path)
        return LinkStatus(self.path if there else None, there, "present" if there else f"{self.path} is gone")

    def reattach(self) -> str | None:
        return self.path if os.path.exists(self.path) else None

    def close(self) -> None:
        pass


class NvmeofTier(NvmeTier):
    """NVMe tier slots on a fabric namespace, with deadlines, degradation and recovery.

    ``link`` supplies the device (see :class:`NamespaceLink`); it is attached here and
    closed with the tier. ``io_timeout_s`` bounds every transfer, flush and probe;
    ``monitor_interval_s`` is the poll period of the link and of recovery attempts.
    The device must already hold ``header_bytes + num_slots * slot_bytes`` bytes.
    Thread-safety as for every tier; state changes are atomic under one lock.
    """

    kind = TierKind.NVMEOF
    persistent = True

    def __init__(self, link: NamespaceLink, num_slots: int, page_bytes: int, *,
                 io_timeout_s: float = 5.0, monitor_interval_s: float = 1.0, o_direct: bool = True,
                 io_threads: int = 4, max_io_bytes: int = DEFAULT_MAX_IO_BYTES, header_bytes: int = 0,
                 name: str | None = None) -> None:
        if not io_timeout_s > 0 or not monitor_interval_s > 0:
            raise InputError(f"nvmeof tier needs io_timeout_s > 0 and monitor_interval_s > 0, "
                             f"got {io_timeout_s}, {monitor_interval_s}")
        self._link = link
        path = link.attach()
        try:
            super().__init__(path, num_slots, page_bytes, o_direct=o_direct, io_threads=io_threads,
                             create=False, max_io_bytes=max_io_bytes, header_bytes=header_bytes, name=name)
        except BaseException:
            link.close()
            raise
        self.io_timeout_s = io_timeout_s
        self.monitor_interval_s = monitor_interval_s
        self._close_wait_s = io_timeout_s
        self._o_direct = o_direct
        self._state = threading.Lock()
        self._up = True
        self.reason = ""
        self.degraded_since: float | None = None
        self.degradations = 0
        self.recoveries = 0
        self._identity: bytes | None = None
        self._held: set[int] = set()          # slots of timed-out writes still in the kernel
        self._deferred: set[int] = set()      # of those, the ones the owner has freed since
        self._lifecycle = threading.Lock()  # orders a device swap against close
        # Guarded calls run here so the caller can stop waiting; threads stuck in the
        # kernel stay stuck, but no caller waits on them past io_timeout_s.
        self._guard = ThreadPoolExecutor(max_workers=max(4, 2 * io_threads), thread_name_prefix="tierkv-nvmeof")
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="tierkv-nvmeof-monitor", daemon=True)
        self._monitor.start()

    # -- state -------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._up and not self._closed

    def state(self) -> dict[str, object]:
        """The tier's health for stats and logs: state, reason, since, counts, device."""
        return {"state": "available" if self.available else ("closed" if self._closed else "degraded"),
                "reason": self.reason, "degraded_since": self.degraded_since, "device": self.path,
                "degradations": self.degradations, "recoveries": self.recoveries}

    def expect_header(self, data: bytes) -> None:
        """The label the owner wrote (or found) at open; recovery requires the same label."""
        self._identity = data

    def degrade(self, reason: str) -> None:
        """Stop serving I/O until the monitor has proven the namespace is back."""
        with self._state:
            if not self._up:
                return
            self._up = False
            self.reason = reason
            self.degraded_since = time.monotonic()
            self.degradations += 1
        log.warning("nvmeof tier %s degraded: %s; its pages are misses until it recovers", self.path, reason)

    def _recovered(self) -> None:
        with self._state:
            self._up = True
            since = self.degraded_since
            self.reason = ""
            self.degraded_since = None
            self.recoveries += 1
        log.warning("nvmeof tier %s recovered after %.1f s", self.path, time.monotonic() - (since or 0.0))

    # -- slots ---------------------------------------------------------------------------
    def free(self, slots: Sequence[int]) -> None:
        with self._state:
            later = [s for s in slots if s in self._held]
            self._deferred.update(later)
        super().free([s for s in slots if s not in later])

    def _release(self, slots: Sequence[int]) -> None:
        """A timed-out write has finally returned: its slots may be reused."""
        with self._state:
            self._held.difference_update(slots)
            ready = [s for s in slots if s in self._deferred]
            self._deferred.difference_update(ready)
        if ready and not self._closed:
            super().free(ready)

    # -- guarded I/O -----------------------------------------------------------------------
    def _closing(self) -> bool:
        return self._closed

    def _guarded(self, what: str, fn: Callable[[], T], hold: Sequence[int] = ()) -> T:
        """Run ``fn`` with the deadline; a failure or timeout degrades the tier."""
        if not self._up:
            raise TierUnavailableError(f"nvmeof tier {self.path} is degraded ({self.reason}); {what} refused")

        def run() -> T:
            # Queued behind stuck workers, the call may start after its caller gave up or
            # the tier degraded: it must not touch the device then.
            if not self._up:
                raise TierUnavailableError(f"nvmeof tier {self.path} degraded before the {what} started")
            return fn()

        fut = _start(self._guard, run, self._closing)
        try:
            return fut.result(timeout=self.io_timeout_s)
        except FutureTimeout:
            fut.cancel()  # still queued: it never runs
            if hold:
                with self._state:
                    self._held.update(hold)
                held = list(hold)
                fut.add_done_callback(lambda _f: self._release(held))
            msg = f"{what} did not complete within {self.io_timeout_s} s"
            self.degrade(msg)
            raise TierUnavailableError(f"nvmeof tier {self.path}: {msg}") from None
        except TierIOError as exc:
            self.degrade(str(exc))
            raise TierUnavailableError(str(exc)) from exc

    def _read(self, slots: Sequence[int], dst: np.ndarray) -> None:
        n, width = len(slots), dst.shape[1]
        scratch = aligned_empty(max(1, n * width))[:n * width].reshape(n, width)
        read = super()._read
        self._guarded(f"read of {n} slots", lambda: read(slots, scratch))
        dst[...] = scratch

    def _read_checksummed(self, slots: Sequence[int], dst: np.ndarray) -> list[int]:
        n, width = len(slots), dst.shape[1]
        scratch = aligned_empty(max(1, n * width))[:n * width].reshape(n, width)
        read = super()._read_checksummed
        sums = self._guarded(f"read of {n} slots", lambda: read(slots, scratch))
        dst[...] = scratch
        return sums

    def _write_checksummed(self, slots: Sequence[int], src: np.ndarray | PageList) -> list[int]:
        write = super()._write_checksummed
        return self._guarded(f"write of {len(slots)} slots", lambda: write(slots, src), hold=list(slots))

    def _write(self, slots: Sequence[int], src: np.ndarray) -> None:
        write = super()._write
        self._guarded(f"write of {len(slots)} slots", lambda: write(slots, src), hold=list(slots))

    def _write_rows(self, slots: Sequence[int], rows: PageList) -> None:
        write = super()._write_rows
        self._guarded(f"write of {len(slots)} slots", lambda: write(slots, rows), hold=list(slots))

    def flush(self) -> None:
        self._check_open()
        sync = super().flush
        self._guarded("flush", sync)

    # -- the monitor -----------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.monitor_interval_s):
            try:
                if self._up:
                    st = self._link.status()
                    if not st.live:
                        self.degrade(st.detail)
                else:
                    self._try_recover()
            except Exception as exc:  # noqa: BLE001 - the monitor must outlive any one failure
                log.warning("nvmeof tier %s: monitor step failed: %s", self.path, exc)

    def _try_recover(self) -> None:
        device = self._link.reattach()
        if device is None:
            return
        # Open the device afresh even under the same name (a namespace that was removed
        # and rescanned is a new block device behind the old node; the old descriptor only
        # fails), read the label on the new descriptor with the deadline, and only then
        # swap it in: nothing is ever written to a namespace before its label is checked.
        size = self.header_bytes + self.num_slots * self.slot_bytes
        fd, direct, _short = open_backing(device, size, o_direct=self._o_direct, create=False)
        header = self._probe(fd)
        if header is None:
            return  # _probe closes fd (now, or when its stuck read returns)
        if self._identity is not None and not header.startswith(self._identity):
            os.close(fd)
            log.error("nvmeof tier %s: the namespace that came back carries another label; staying degraded",
                      device)
            return
        with self._lifecycle:
            if self._closed:
                os.close(fd)
                return
            with self._cond:
                old, self._fd = self._fd, fd
                self._retire_fd(old)  # closed once no stuck transfer holds its number
                # The new descriptor's own mode: a device that now takes O_DIRECT (or now
                # refuses it) is moved by its rules (a transfer reads the mode together
                # with the descriptor it holds: _busy_mode).
                if direct != self.direct:
                    log.warning("nvmeof tier %s: the namespace came back %s", device,
                                "taking O_DIRECT" if direct else "refusing O_DIRECT: buffered I/O")
                self.direct, self.mem_align = direct, ALIGN if direct else 1
            if device != self.path:
                log.warning("nvmeof tier: namespace moved from %s to %s", self.path, device)
            self.path = device
        self._recovered()

    def _probe(self, fd: int) -> bytes | None:
        """The header read from ``fd`` within the deadline; None (and ``fd`` closed) otherwise."""
        if self.header_bytes == 0:
            return b""
        buf = aligned_empty(self.header_bytes)

        def read() -> bytes | None:
            try:
                done = os.preadv(fd, [buf.data], 0)
            except OSError:
                return None
            return buf.tobytes() if done == self.header_bytes else None

        fut = _start(self._guard, read, self._closing)
        try:
            header = fut.result(timeout=self.io_timeout_s)
        except FutureTimeout:
            if not fut.cancel():
                fut.add_done_callback(lambda _f: os.close(fd))
            else:
                os.close(fd)
            return None
        if header is None:
            os.close(fd)
        return header

    def _close(self) -> None:
        self._stop.set()
        if self._monitor.is_alive() and threading.current_thread() is not self._monitor:
            self._monitor.join(timeout=self.io_timeout_s + self.monitor_interval_s + 1)
        with self._lifecycle:  # a recovery in progress finishes or sees the tier closed
            super()._close()
        self._guard.shutdown(wait=False, cancel_futures=True)
        self._link.close()


def _start(pool: ThreadPoolExecutor, fn: Callable[[], T], closed: Callable[[], bool]) -> Future[T]:
    """``fn`` running on a thread of ``pool``, as a future the caller can wait on with a
    deadline. Where the pool takes no more work (once the main thread has returned,
    concurrent.futures refuses it: a store closed from an atexit handler writing its pages
    down) on a thread of its own instead, or, where no thread can be started either, here,
    before this returns (without the deadline); StoreClosedError where the pool was shut
    down by the tier's close (``closed()``)."""
    try:
        return pool.submit(fn)
    except RuntimeError:
        if closed():
            raise StoreClosedError("nvmeof tier is closed") from None
    fut: Future[T] = Future()

    def run() -> None:
        if fut.set_running_or_notify_cancel():
            settle(fut, fn)

    try:
        threading.Thread(target=run, name="tierkv-nvmeof-late", daemon=True).start()
    except RuntimeError:
        run()
    return fut
