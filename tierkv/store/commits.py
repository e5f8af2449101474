"""Group commit: many batches' index records made durable by one data sync and one LMDB commit.

With ``[store] durability = "window"`` the persistent index (:mod:`tierkv.store.index`)
does not commit each batch's records when the manager publishes them: it hands them to
a :class:`GroupCommit`, which keeps the last operation per key (a record, or a delete) of
every tier and applies them together, once per *window*:

1. ``fdatasync`` every persistent tier that received records in the window (their bytes
   were written, completely, before the manager published them, so before they were
   buffered here, so before this sync);
2. then one synced LMDB write transaction with every tier's buffered deletes and records.

A window closes ``window_s`` after its first operation, or as soon as it holds
``max_pages`` operations, on a background thread (``tierkv-commit``); :meth:`sync` (the
store's ``flush()`` and ``close()``) closes one at once and returns when it is durable.
While a window is applied the next one fills; writers that find it holding
``BACKLOG_WINDOWS`` times ``max_pages`` wait in :meth:`throttle` (the store calls it
after a put, outside its lock) until the window in progress is done, so that a disk
slower than the puts bounds the next window (what a crash can lose, and the LMDB
transaction's dirty pages, which LMDB keeps allocated for reuse) instead of letting it
grow without end.

What a crash loses is the records of the open window (and of one being applied): those
pages are misses after a restart, their slots free. Never wrong bytes: a record reaches
LMDB only after its bytes were synced, and an older record whose slot was reused in the
window still fails its checksum, exactly as with per-batch commits.

Failures: if a tier's ``fdatasync`` fails, the window's records for that tier are turned
into deletes (after a failed fsync the kernel may have dropped the bytes and reports the
error only once, so a retry could claim durability for bytes that are gone). A degraded
tier (TierUnavailableError: an NVMe-oF tier refuses the sync without attempting it)
keeps its records waiting for a window after it recovers, as put mode keeps what it
had committed; its deletes are applied. If the
LMDB transaction fails, every operation of the window goes back into the buffer (behind
newer operations on the same keys) for the next one: its data was synced, so the records
are still true. :meth:`sync` raises a dropped window's error once, and a retried one's
while its operations still wait, so a barrier never claims pages that are not durable.

Thread-safety: every method may be called from any thread. ``add`` holds a short lock;
windows are applied one at a time (``sync`` waits for the one in progress).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from tierkv.errors import TierIOError, TierKVError, TierUnavailableError
from tierkv.keys import PageKey

log = logging.getLogger(__name__)

#: A window this many times ``max_pages`` makes writers wait for the one being applied.
BACKLOG_WINDOWS = 2

# What one window holds: per tier, per key, the last record (any object: the index's
# IndexRecord) or None for a delete.
Ops = dict[str, dict[PageKey, object | None]]
#: Applies one window's operations in one durable transaction; raises TierIOError.
Apply = Callable[[Ops], None]


class GroupCommit:
    """Buffers index operations and applies them, after a data sync, once per window.

    ``syncs`` maps each tier name to its data sync (``Tier.flush``: raises TierIOError);
    ``apply`` writes a window's operations in one durable LMDB transaction.
    """

    def __init__(self, apply: Apply, syncs: Mapping[str, Callable[[], None]], *,
                 window_s: float, max_pages: int) -> None:
        self._apply = apply
        self._syncs = dict(syncs)
        self.window_s = window_s
        self.max_pages = max_pages
        self._cond = threading.Condition()           # guards the fields below
        self._ops: Ops = {}
        self._count = 0
        self._opened = 0.0                           # monotonic time of the open window's first op
        self._stopping = False
        self._lost: TierIOError | None = None        # a window whose records were dropped, until raised
        self._retrying: TierIOError | None = None    # the last window's error, while its operations wait
        self._hold_until = 0.0                       # after a failed window the thread waits a window
        self._apply_lock = threading.Lock()          # one window applied at a time
        self._applying = False                       # a window is being synced and applied
        self.windows = 0                             # windows applied (for tests and benchmarks)
        self._thread = threading.Thread(target=self._run, name="tierkv-commit", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Operations buffered and not yet durable."""
        with self._cond:
            return self._count

    def add(self, tier: str, put: Iterable[tuple[PageKey, object]], delete: Iterable[PageKey]) -> None:
        """Buffer one batch: its deletes, then its records (a key deleted and stored again keeps
        its new record). Never raises for an earlier window's failure: :meth:`sync` does."""
        with self._cond:
            if self._stopping:
                raise TierKVError("the index's group commit is closed")
            ops = self._ops.setdefault(tier, {})
            before = len(ops)
            for key in delete:
                ops[key] = None
            for key, rec in put:
                ops[key] = rec
            opened = not self._count
            if opened:
                self._opened = time.monotonic()
            self._count += len(ops) - before
            if opened or self._count >= self.max_pages:  # the thread sets its timer, or closes the window
                self._cond.notify_all()

    def throttle(self, timeout_s: float | None = None) -> None:
        """Wait while the buffered window holds ``BACKLOG_WINDOWS * max_pages`` operations
        or more and another window is being applied (not while a failed one holds the
        thread back: puts then go on, as before). Raises nothing."""
        limit = BACKLOG_WINDOWS * self.max_pages
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._count >= limit and self._applying and not self._stopping:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._cond.wait(left)

    def sync(self) -> None:
        """Make every operation added before this call durable. Raises TierIOError if it could
        not: a window since the last ``sync`` dropped records (raised once), or operations
        still wait for a degraded tier or a failing index (raised until they are applied)."""
        with self._apply_lock:
            self._flush_window()
        with self._cond:
            error, self._lost = self._lost or self._retrying, None
        if error is not None:
            raise error

    def drain(self, tier: str | None = None) -> bool:
        """Apply the open window now; whether nothing is left waiting (of ``tier`` only, if
        given: a degraded tier's records waiting for a later window say nothing about
        another tier's). Unlike :meth:`sync` it raises nothing: errors stay for the next
        ``sync`` to raise."""
        with self._apply_lock:   # answered before the commit thread can take another window
            self._flush_window()
            with self._cond:
                if tier is not None:
                    return not self._ops.get(tier)
                return self._count == 0 and self._retrying is None

    def close(self) -> None:
        """Apply what is buffered and stop the thread; raises as :meth:`sync` does."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self.sync()

    def drop(self, tier: str) -> None:
        """Forget every buffered operation of ``tier`` (its records are being cleared)."""
        with self._cond:
            self._count -= len(self._ops.pop(tier, {}))

    # -- the window ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._due():
                    due = max(self._opened + self.window_s, self._hold_until)
                    self._cond.wait(due - time.monotonic() if self._count else None)
                if self._stopping:
                    return
            with self._apply_lock:
                self._flush_window()

    def _due(self) -> bool:
        now = time.monotonic()
        return self._count > 0 and now >= self._hold_until and (
            self._count >= self.max_pages or now >= self._opened + self.window_s)

    def _flush_window(self) -> None:
        """Sync the data of one window's tiers, then apply its operations. Call with ``_apply_lock``."""
        with self._cond:
            ops, self._ops, self._count = self._ops, {}, 0
            self._applying = bool(ops)
        if not ops:
            return
        try:
            self._sync_and_apply(ops)
        finally:
            with self._cond:
                self._applying = False
                self._cond.notify_all()

    def _sync_and_apply(self, ops: Ops) -> None:
        lost: list[TierIOError] = []
        retry: list[TierIOError] = []
        waiting: Ops = {}  # records of degraded tiers: their sync was refused, not attempted
        for tier, by_key in list(ops.items()):
            if tier not in self._syncs or all(rec is None for rec in by_key.values()):
                continue  # deletes only: no new bytes to make durable
            try:
                self._syncs[tier]()
            except TierUnavailableError as exc:
                log.warning("group commit: the %s tier is degraded; its records wait for the next window: %s",
                            tier, exc)
                retry.append(exc)
                waiting[tier] = {k: r for k, r in by_key.items() if r is not None}
                ops[tier] = {k: r for k, r in by_key.items() if r is None}
            except TierKVError as exc:  # a closed tier (StoreClosedError) is as good as a failed sync
                log.warning("group commit: syncing the %s tier failed; its %d records of this window are "
                            "not committed (those pages are misses after a restart): %s", tier,
                            sum(rec is not None for rec in by_key.values()), exc)
                lost.append(exc if isinstance(exc, TierIOError) else TierIOError(str(exc)))
                ops[tier] = dict.fromkeys(by_key)  # delete instead: no record may name unsynced bytes
        try:
            self._apply(ops)
        except TierIOError as exc:
            log.warning("group commit: the index transaction failed; its %d operations wait for the "
                        "next window: %s", sum(map(len, ops.values())), exc)
            retry.append(exc)
            self._requeue(ops)
        else:
            self.windows += 1
        self._requeue(waiting)
        with self._cond:
            # A window that leaves nothing waiting made every earlier retried operation durable.
            self._retrying = retry[0] if retry else None
            self._lost = self._lost or (lost[0] if lost else None)
            if lost or retry:
                self._hold_until = time.monotonic() + self.window_s  # no tight loop on a full disk

    def _requeue(self, ops: Ops) -> None:
        """Put a window's operations back, behind newer operations on the same keys."""
        with self._cond:
            for tier, by_key in ops.items():
                if not by_key:
                    continue
                if not self._count:
                    self._opened = time.monotonic()
                newer = self._ops.get(tier, {})
                self._ops[tier] = {**by_key, **newer}
                self._count += len(self._ops[tier]) - len(newer)
