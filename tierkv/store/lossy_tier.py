"""A lossy tier (issue 26): exact pages that come down into it are converted to lossy pages.

A persistent tier configured with ``lossy_bits`` (``[tiers.nvme]`` or ``[tiers.nvmeof]``)
holds lossy pages (:mod:`tierkv.store.lossy_pages`) at that budget. Pages reach it as
they always did (demoted from the tier above, or written there when the tiers above
decline them), exact; every page published in that tier is queued (a put's pages
children first), and a background thread converts the exact ones, a batch at a time:
under the store's lock it reads them, without it codes them
(:func:`~tierkv.store.lossy_pages.code_rows`: no attention statistics come with a
demotion, so importance is flat over tokens and, where the tier's calibration measured
it, the model's query energy per key channel; no token evicted, which needs them), and
under the lock again drops each exact copy that is still the one it read and places the
blobs under the pages' lossy keys (:func:`tierkv.keys.lossy_keys`, from the exact key
alone) in the tier, in one plan (one index commit: after a crash either the exact
record or the lossy one names the slot's bytes, and a record whose bytes were
overwritten fails its checksum: a miss, never wrong data).

What is converted is gone for exact gets: a get that accepts lossy pages at the tier's
budget reads them after the exact ones, as it reads pages :meth:`Store.put_lossy` stored.
A converted page has no parent (its exact parent may still be cached above, and is
converted in turn when it comes down). A page with cached children and no other copy
waits until they are gone (converting it would strand them; children converted in the
same batch count as gone, and converting a page sends the ancestors waiting on it back
to the queue), as do pinned pages and pages on a degraded tier: *kept back*, and retried
2 s later, then less often (up to every 64 s) while retries convert nothing, on a clock of
their own (a steady stream of new pages does not put them off). Pages already lossy
(put_lossy's, come down) are recognised by their bytes, and derived pages (splices:
their gets ask for derived keys, which a lossy key is not) by their recorded origins;
both are left as they are, as is a page the format cannot code (non-finite values:
logged; its ancestors in the tier are kept back while it is cached). Tiers below take
what it demotes as it is: lossy pages, and exact ones it had not converted yet (they stay
exact: below, where a tier may not code, a lossy page need not be smaller).

Conversion costs CPU (about 30-40 MB/s of BF16 pages a core, in numpy): under a steady
stream of demotions faster than that the tier holds exact pages, served exact, until
their turn. The queue is 16 bytes a page; a clean close saves it beside the index
(``lossy-pending``) and the next open resumes it; after a crash, pages left in it stay
exact. ``stats()`` counts ``lossy_converted``, ``lossy_pending`` (queued or being
converted) and ``lossy_waiting`` (kept back).
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tierkv.errors import InputError, TierIOError
from tierkv.keys import KEY_BYTES, PageKey, lossy_keys, split_keys
from tierkv.store.manager import MovePlan
from tierkv.store.moves import Lead
from tierkv.tiers.base import TierId
from tierkv.tiers.blocks import lossy_length

if TYPE_CHECKING:
    from tierkv.lossy.alloc import Calibration
    from tierkv.store.api import Store

log = logging.getLogger(__name__)

#: A page being converted: its exact key, where its copy was (``BlockManager.copy_at``), a row.
_Read = tuple[PageKey, tuple[int, int, int, int], np.ndarray]

#: Pages read, coded and placed at a time (the lock is released while they are coded).
BATCH = 8
#: Seconds before pages kept back are retried, doubled (up to RETRY_MAX_S) while retries convert nothing.
RETRY_S = 2.0
RETRY_MAX_S = 64.0
#: The file a clean close leaves the queue in, in the store's directory.
PENDING_FILE = "lossy-pending"


class KeyQueue:
    """A FIFO of 16-byte keys in one buffer (16 bytes a key, no object per key)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._head = 0

    def __len__(self) -> int:
        return (len(self._buf) - self._head) // KEY_BYTES

    def extend(self, keys: Sequence[bytes] | bytes) -> None:
        self._buf += keys if isinstance(keys, (bytes, bytearray)) else b"".join(keys)

    def take(self, n: int) -> list[PageKey]:
        end = min(len(self._buf), self._head + n * KEY_BYTES)
        out = split_keys(bytes(self._buf[self._head:end]))
        self._head = end
        if self._head > 1 << 20 and self._head * 2 > len(self._buf):   # drop what was consumed
            del self._buf[:self._head]
            self._head = 0
        return out

    def drain(self) -> bytes:
        out = bytes(self._buf[self._head:])
        self._buf, self._head = bytearray(), 0
        return out


def open_converter(store: Store) -> Converter | None:
    """The converter of ``store``'s lossy tier, None where it has none (or is read-only);
    ConfigError for a calibration file that is not one, or not of this layout's layers."""
    cfg = store.config
    tiers = [(kind, t) for kind, t in (("nvme", cfg.nvme), ("nvmeof", cfg.nvmeof)) if t is not None and t.lossy_bits]
    if not tiers or store.read_only:
        return None
    kind, tcfg = tiers[0]
    cal = None
    if tcfg.lossy_calibration is not None:
        from tierkv.errors import ConfigError
        from tierkv.lossy.alloc import Calibration

        cal = Calibration.load(os.path.expanduser(tcfg.lossy_calibration))
        lay = store.layout
        want = (lay.num_layers, lay.num_kv_heads, lay.head_dim)
        got = (len(cal.key), *(cal.query_energy.shape[1:] if cal.query_energy is not None else want[1:]))
        if got != want:
            raise ConfigError(f"tiers.{kind}.lossy_calibration: {tcfg.lossy_calibration} calibrates {got[0]} layers "
                              f"of {got[1]} KV heads of {got[2]} channels ({cal.model_id or 'a model'}), this store's "
                              f"pages have {want[0]} of {want[1]} of {want[2]}")
    name = next(t.name for t in store._manager.tiers if t.kind.value == kind)
    return Converter(store, name, float(tcfg.lossy_bits), cal)


class Converter:
    """The background conversion of one store's lossy tier (module docstring)."""

    def __init__(self, store: Store, name: TierId, budget: float, calibration: Calibration | None) -> None:
        self._store = store
        self._m = store._manager
        self.name = name
        self.level = self._m.levels[name]
        self.budget = budget
        self._cal = calibration
        self._queue = KeyQueue()     # to convert, oldest first
        self._retry = KeyQueue()     # kept back, now retried: asked whether they can go before a read
        self._waiting: dict[bytes, None] = {}   # kept back (cached children, pins, a degraded tier)
        self._own: set[bytes] = set()   # lossy keys being placed: not queued
        self._busy = 0               # pages of the batch being converted
        self._inflight: list[PageKey] = []   # that batch's keys (saved at a close that does not wait for it)
        self._backoff = RETRY_S
        self._retry_at: float | None = None   # when pages kept back are retried (monotonic clock)
        self._wake = threading.Condition(store._lock)
        self._stop = False
        self._m.listeners.append(self._on_event)
        self._path = Path(store.config.path) / PENDING_FILE
        self._load()
        self._thread = threading.Thread(target=self._run, name=f"tierkv-lossy-{name}", daemon=True)
        self._thread.start()

    # -- the queue (store lock held) ---------------------------------------------------------
    def _on_event(self, event: str, name: TierId, keys: list[PageKey], slots: list[int]) -> None:
        if event == "placed" and self._m.levels[name] == self.level:
            mine = self._own
            with self._wake:   # the store's lock, which its caller holds
                # Children first: a put's pages come parents first, and a parent waits for its children.
                fresh = [k for k in reversed(keys) if k not in mine]
                self._queue.extend(fresh)
                if self._waiting:
                    for k in fresh:   # queued again: no longer kept back (counted once)
                        self._waiting.pop(k, None)
                    if not self._waiting:
                        self._retry_at = None
                self._wake.notify_all()

    @property
    def pending(self) -> int:
        """Pages queued or being converted (lock held)."""
        return len(self._queue) + len(self._retry) + self._busy

    @property
    def waiting(self) -> int:
        """Pages kept back (lock held)."""
        return len(self._waiting)

    def _keep(self, key: bytes) -> None:
        self._waiting[key] = None
        if self._retry_at is None:
            self._retry_at = time.monotonic() + self._backoff

    def _load(self) -> None:
        try:
            raw = self._path.read_bytes()
            self._path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("reading the lossy tier's queue %s failed; those pages stay exact: %s", self._path, exc)
            return
        self._queue.extend(raw[:len(raw) - len(raw) % KEY_BYTES])

    def save(self) -> None:
        """Leave the queue for the next open (at a clean close, the thread stopped)."""
        keys = b"".join(self._inflight) + self._retry.drain() + self._queue.drain() + b"".join(self._waiting)
        self._waiting.clear()
        if not keys:
            return
        tmp = self._path.with_suffix(".tmp")
        try:
            tmp.write_bytes(keys)
            os.replace(tmp, self._path)
        except OSError as exc:
            log.warning("saving the lossy tier's queue (%d pages) failed; they stay exact: %s",
                        len(keys) // KEY_BYTES, exc)

    def stop(self) -> None:
        """Stop the thread; joined unless the caller holds the store's lock (the thread
        then ends when it next takes it, and finds the store closed)."""
        held = self._store._lock._is_owned()  # type: ignore[attr-defined]
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if not held:
            self._thread.join()

    def wait(self, timeout_s: float | None) -> int:
        """Until nothing is queued or being converted (or ``timeout_s``); pages left,
        those kept back included (lock not held)."""
        if timeout_s is not None:
            if isinstance(timeout_s, (bool, np.bool_)) or not isinstance(timeout_s, numbers.Real) \
                    or not math.isfinite(timeout_s) or timeout_s < 0:
                raise InputError(f"wait_converted: timeout_s is seconds (a finite number >= 0) or None, "
                                 f"got {timeout_s!r}")
            timeout_s = min(float(timeout_s), threading.TIMEOUT_MAX)
        with self._wake:
            self._wake.wait_for(lambda: self._stop or not (len(self._queue) or len(self._retry) or self._busy),
                                timeout_s)
            return self.pending + self.waiting

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stop or len(self._queue) > 0 or len(self._retry) > 0
                                    or self._retry_due(), self._retry_in())
                if self._stop:
                    return
                if self._retry_due():
                    # Kept back long enough (an unpin, say, sends no event): retried, on a clock
                    # of its own (a steady stream of new pages must not put it off); less
                    # often each time nothing converts in between.
                    self._retry.extend(list(self._waiting))
                    self._waiting.clear()
                    self._retry_at = None
                    self._backoff = min(2 * self._backoff, RETRY_MAX_S)
                if not (len(self._queue) or len(self._retry)):
                    continue
                retry = len(self._retry) > 0
                keys = list(dict.fromkeys((self._retry if retry else self._queue).take(BATCH)))  # queued twice: once
                self._busy = len(keys)
                self._inflight = keys
            try:
                self._batch(keys, retry)
            except Exception:  # noqa: BLE001 - a failed batch costs its conversions, never the thread
                log.exception("converting %d pages for the lossy tier %s failed; they stay exact", len(keys),
                              self.name)
            finally:
                with self._wake:
                    self._busy = 0
                    self._inflight = []
                    self._wake.notify_all()

    def _retry_due(self) -> bool:
        return self._retry_at is not None and bool(self._waiting) and time.monotonic() >= self._retry_at

    def _retry_in(self) -> float | None:
        """Seconds until pages kept back are due (None: none are)."""
        if self._retry_at is None or not self._waiting:
            return None
        return max(0.0, self._retry_at - time.monotonic())

    def _batch(self, keys: list[PageKey], retry: bool) -> None:
        """Convert ``keys``; ``retry``: pages kept back before (read and found exact, or on a
        degraded tier): whether they can go is asked before a read."""
        store = self._store
        with store._lock:
            if self._stop or store._closed:
                (self._retry if retry else self._queue).extend(keys)
                return
            read = self._read(keys, retry)
            self._busy = len(read)
        coded = self._code(read)
        with store._lock:
            if self._stop or store._closed:
                self._queue.extend([k for k, _, _ in coded])
                return
            if self._place(coded):
                self._backoff = RETRY_S

    def _children_first(self, keys: list[PageKey]) -> tuple[list[PageKey], dict[bytes, PageKey | None]]:
        """``keys`` with each page before its ancestors among them, and each one's parent."""
        parents: dict[bytes, PageKey | None] = {k: self._m.parent_of(k) for k in keys}
        mine = set(keys)

        def depth(k: bytes) -> int:
            d, p = 0, parents[k]
            while p is not None and p in mine and d < len(keys):
                d, p = d + 1, parents.get(p)
            return d

        return sorted(keys, key=depth, reverse=True), parents

    def _read(self, keys: list[PageKey], retry: bool) -> list[_Read]:
        """The exact copies in the tier that can be converted, read, children first (lock
        held). A page already lossy (put_lossy's, come down) is left out before it is
        asked whether it could go: it may have children (its lossy successors)."""
        m, out = self._m, []
        order, parents = self._children_first(keys)
        going: list[bytes] = []

        def can_go(key: bytes) -> bool:   # its cached children all go in this batch
            blocking = m.blocking_children(PageKey(key), self.level)
            return blocking is not None and blocking == sum(parents[k] == key for k in going)

        for key in order:
            at = m.copy_at(key, self.level)
            if at is None or at[0] != self.level or key in self._store._provenance:
                continue   # gone, not in the tier now (queued again if it comes back), or derived
            if not m.tiers[at[0]].available or (retry and not can_go(key)):
                self._keep(key)
                continue
            row = np.empty((1, self._store.layout.page_bytes), np.uint8)
            lead = Lead(key, np.array([at[0]], np.uint8), [at[1]], [at[3]])
            if self._store._transfers.read(lead, row, serve=False) != 1:   # a failed read forgets the page
                continue
            if lossy_length(row[0]):
                continue   # put_lossy's page, come down: nothing to do
            if not can_go(key):
                self._keep(key)
                continue
            going.append(key)
            out.append((key, at, row))
        return out

    def _code(self, read: list[_Read]) -> list[_Read]:
        """Each page's lossy row, where it can be coded (lock not held)."""
        from tierkv.store.lossy_pages import code_rows

        out: list[_Read] = []
        for key, at, row in read:
            try:
                out.append((key, at, code_rows(self._store.layout, row, 1, self.budget, None, self._cal, False,
                                               f"the lossy tier {self.name}")))
            except InputError as exc:   # a page lossy pages cannot code (non-finite values, say)
                log.warning("page %s stays exact in the lossy tier %s: %s", key.hex(), self.name, exc)
        return out

    def _place(self, coded: list[_Read]) -> int:
        """Swap each still-current exact copy for its lossy page, children first, in one
        plan (lock held); how many. The ancestors waiting on them are retried."""
        m, store = self._m, self._store
        plan = MovePlan()
        items: list[tuple[PageKey, np.ndarray]] = []
        ups: list[PageKey | None] = []
        for key, at, rows in coded:
            if m.copy_at(key, self.level) != at:
                continue   # moved, dropped or written again while it was coded: queued again if it came back
            if m.blocking_children(key, self.level) != 0:   # its children in this batch went first
                self._keep(key)
                continue
            ups.append(m.parent_of(key))
            m.drop_copy(key, self.level, plan)
            items.append((key, rows))
        if not items:
            return 0
        swapped = (plan.evicted, plan.dropped)   # the swaps, not evictions
        lkeys = split_keys(lossy_keys(b"".join(k for k, _ in items), self.budget))
        new = [(lk, i) for i, (lk, held) in enumerate(zip(lkeys, m.held(b"".join(lkeys)))) if not held]
        rows = np.concatenate([items[i][1] for _, i in new]) if new else np.zeros((0, 0), np.uint8)
        self._own = {lk for lk, _ in new}   # its own pages are not queued
        try:
            if new:
                m.plan_store([(lk, None) for lk, _ in new], store.layout.page_bytes, first_level=self.level,
                             plan=plan)
            placed = store._transfers.run(plan, rows, {lk: j for j, (lk, _) in enumerate(new)}, "lossy")
        except TierIOError as exc:
            log.warning("converting %d pages in %s failed; they are misses: %s", len(items), self.name, exc)
            return 0
        finally:
            self._own = set()
        plan.evicted -= swapped[0]
        plan.dropped -= swapped[1]
        store._count_plan(plan)
        store._counters.events["lossy_converted"] += placed + (len(items) - len(new))
        self._wake_ancestors(ups)
        return len(items)

    def _wake_ancestors(self, parents: list[PageKey | None]) -> None:
        """Send the kept-back ancestors of converted pages (up to a batch each) to be retried."""
        back: list[bytes] = []
        for p in parents:
            for _ in range(BATCH):
                if p is None or p not in self._waiting:
                    break
                del self._waiting[p]
                back.append(p)
                p = self._m.parent_of(p)
        if back:
            self._retry.extend(back)
            if not self._waiting:
                self._retry_at = None
