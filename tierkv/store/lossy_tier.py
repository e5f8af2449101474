"""A lossy tier (issue 26): exact pages demoted into it are converted to lossy pages.

A persistent tier configured with ``lossy_bits`` (``[tiers.nvme]`` or ``[tiers.nvmeof]``)
holds lossy pages (:mod:`tierkv.store.lossy_pages`) at that budget. Pages reach it as
they always did (demoted from the tier above, or written there when the tiers above
decline them) and as exact pages; every page published in that tier is queued, and a
background thread converts the exact ones: under the store's lock it reads the
page, without it codes it (:func:`~tierkv.store.lossy_pages.code_rows`: no attention
statistics come with a demotion, so importance is flat over tokens and, where the tier's
calibration measured it, the model's query energy per key channel; no token evicted,
which needs them), and under the lock again, if the copy
is still the one it read, drops the exact copy and places the blob under the page's
lossy key (:func:`tierkv.keys.lossy_keys`, from the exact key alone) in the tier, in
one plan (one index commit: after a crash either the exact record or the lossy one
names the slot's bytes, and a record whose bytes were overwritten fails its checksum: a
miss, never wrong data).

What is converted is gone for exact gets: a get that accepts lossy pages at the tier's
budget reads them after the exact ones, as it reads pages :meth:`Store.put_lossy` stored.
A converted page has no parent (its exact parent may still be cached above, and is
converted in turn when it comes down); a page with cached children and no other copy
waits until they are gone (converting it would strand them), as do pinned pages. Pages
already lossy (put_lossy's, demoted) are recognised by their bytes and left as they are.
Tiers below it take what it demotes as it is: lossy pages, and exact ones it had not
converted yet (they stay exact: below, where a tier may not code, a lossy page need not
be smaller).

Conversion costs CPU (about 30-40 MB/s of BF16 pages a core, in numpy): under a steady
stream of demotions faster than that the tier holds exact pages, served exact, until
their turn. The queue is 16 bytes a page; a clean close saves it beside the index
(``lossy-pending``) and the next open resumes it; after a crash, pages left in it stay
exact. ``stats()`` counts ``lossy_converted`` and ``lossy_pending``.
"""

from __future__ import annotations

import logging
import os
import threading
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
#: Seconds between retries of pages kept back, where nothing else brings them back sooner.
RETRY_S = 2.0
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
        self._waiting = KeyQueue()   # kept back (cached children, pins, a degraded tier)
        self._retry = KeyQueue()     # kept back, now retried: checked before they are read again
        self._own: set[bytes] = set()   # lossy keys being placed: not queued
        self._busy = 0               # keys taken from the queue and not yet done with
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
                self._queue.extend([k for k in keys if k not in mine] if mine else keys)
                self._wake.notify_all()

    @property
    def pending(self) -> int:
        """Pages queued or kept back (lock held)."""
        return len(self._queue) + len(self._retry) + len(self._waiting) + self._busy

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
        keys = self._waiting.drain() + self._retry.drain() + self._queue.drain()
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
        """Stop the thread (the store's lock not held); pages it had taken go back first."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        self._thread.join()

    def wait(self, timeout_s: float | None) -> int:
        """Until nothing is queued or being converted (or ``timeout_s``); pages left, those
        kept back included (lock not held)."""
        with self._wake:
            self._wake.wait_for(lambda: self._stop or not (len(self._queue) or len(self._retry) or self._busy),
                                timeout_s)
            return self.pending

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._wake.wait_for(lambda: self._stop or len(self._queue) > 0 or len(self._retry) > 0,
                                           RETRY_S if len(self._waiting) else None):
                    self._retry.extend(self._waiting.drain())   # an unpin, say, sends no event
                    continue
                if self._stop:
                    return
                retry = len(self._retry) > 0
                keys = list(dict.fromkeys((self._retry if retry else self._queue).take(BATCH)))  # queued twice: once
                self._busy = len(keys)
            try:
                self._batch(keys, retry)
            except Exception:  # noqa: BLE001 - a failed batch costs its conversions, never the thread
                log.exception("converting %d pages for the lossy tier %s failed; they stay exact", len(keys),
                              self.name)
            finally:
                with self._wake:
                    self._busy = 0
                    self._wake.notify_all()

    def _batch(self, keys: list[PageKey], retry: bool) -> None:
        """Convert ``keys``; ``retry``: pages kept back before, so read and found exact
        (or on a degraded tier): whether they can be dropped is asked before a read."""
        store = self._store
        with store._lock:
            if self._stop or store._closed:
                (self._retry if retry else self._queue).extend(keys)
                return
            read = self._read(keys, retry)
        coded = self._code(read)
        with store._lock:
            if self._stop or store._closed:
                self._queue.extend([k for k, _, _ in coded])
                return
            done = self._place(coded)
            if done and len(self._waiting):   # progress may have freed pages kept back
                self._retry.extend(self._waiting.drain())

    def _read(self, keys: list[PageKey], retry: bool) -> list[_Read]:
        """The exact copies at the tier or below that can be converted, read (lock held).
        A page already lossy (put_lossy's, come down) is left out before it is asked
        whether it could be dropped: it may have children (its lossy successors)."""
        m, out = self._m, []
        for key in keys:
            at = m.copy_at(key, self.level)
            if at is None or at[0] != self.level:
                continue   # gone, or not in the tier now (it is queued again if it comes back)
            if not m.tiers[at[0]].available or (retry and not m.can_drop_copy(key, at[0])):
                self._waiting.extend([key])
                continue
            row = np.empty((1, self._store.layout.page_bytes), np.uint8)
            lead = Lead(key, np.array([at[0]], np.uint8), [at[1]], [at[3]])
            if self._store._transfers.read(lead, row, serve=False) != 1:   # a failed read forgets the page
                continue
            if lossy_length(row[0]):
                continue   # put_lossy's page, come down: nothing to do
            if not m.can_drop_copy(key, at[0]):
                self._waiting.extend([key])
                continue
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
                log.debug("page %s stays exact in the lossy tier: %s", key.hex(), exc)
        return out

    def _place(self, coded: list[_Read]) -> int:
        """Swap each still-current exact copy for its lossy page, in one plan (lock held);
        how many."""
        m, store = self._m, self._store
        items: list[tuple[PageKey, np.ndarray]] = []
        for key, at, rows in coded:
            if m.copy_at(key, self.level) != at:
                continue   # moved, dropped or written again while it was coded: queued again if it came back
            if not m.can_drop_copy(key, at[0]):
                self._waiting.extend([key])
                continue
            items.append((key, rows))
        if not items:
            return 0
        plan = MovePlan()
        lkeys = split_keys(lossy_keys(b"".join(k for k, _ in items), self.budget))
        for key, _ in items:
            m.drop_copy(key, self.level, plan)
        swapped = (plan.evicted, plan.dropped)   # the swaps, not evictions
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
        return len(items)
