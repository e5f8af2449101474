"""One node's anchors in the page directory (:mod:`tierkv.cluster.directory`), in etcd.

The store tells the :class:`Publisher` the pages it places in and removes from the tier it
serves to other nodes; it writes their anchors as ``/tierkv/{cluster}/pages/{key hex}/{node}``
(value: the tier) under the node's lease, batched, at most
:data:`~tierkv.cluster.etcd.MAX_TXN_OPS` operations a transaction (deletes first within
it), every ``flush_s``. A page is announced after its bytes are in place; its removal is
queued when the store evicts it and sent with the next batch (after a put of it still in
flight), so for about a batch's delay, or while etcd does not answer, the directory can
name a node for a page it no longer has: the reader asks that node, which answers from its
live index (a miss), never with other bytes. When the node's lease changes (it registered
again) every anchor it still holds is put again under the new one; its anchors leave etcd
with its lease.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence

from tierkv.cluster.directory import ANCHOR_EVERY, RETRY_S, SHALLOW, anchor_key, is_anchor, pages_prefix
from tierkv.cluster.etcd import MAX_TXN_OPS, Etcd
from tierkv.config import check_name
from tierkv.errors import ClusterRefusedError, ClusterUnavailableError
from tierkv.keys import PageKey

log = logging.getLogger(__name__)


class Publisher:
    """This node's anchors in etcd, under its lease (:meth:`set_lease`), batched on a thread.

    Each key's state is the latest of: pending (what the store last said, not yet sent),
    in flight (sent in the transaction being written), published (confirmed by etcd), so
    a removal during a put's transaction is sent after it, and a lease change re-puts only
    what is still wanted. A write whose outcome is unknown (a timeout after etcd may have
    committed it) makes its keys *unsure*: their next operation is sent whatever the
    published set says (puts and deletes are idempotent)."""

    def __init__(self, etcd: Etcd, cluster: str, node: str, tier: str = "dram", flush_s: float = 0.05) -> None:
        self.etcd = etcd
        self.prefix = pages_prefix(check_name(cluster, "cluster.name"))
        self.node = check_name(node, "cluster.node")
        self.tier = tier.encode()
        self.flush_s = flush_s
        self.depth_cap = SHALLOW   # the positions placed() needs: those below it choose anchors
        self._pending: dict[bytes, bool] = {}    # key -> whether it should be published
        self._inflight: dict[bytes, bool] = {}   # the transaction being written
        self._published: set[bytes] = set()
        self._unsure: set[bytes] = set()
        self._lease = 0
        self._cond = threading.Condition()
        self._closed = False
        self.etcd_away = False
        self.transactions = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="tierkv-directory-publish", daemon=True)
        self._thread.start()

    # -- what the store tells it (with its lock held: never blocks) --------------------
    def placed(self, keys: Sequence[PageKey], depths: Sequence[int]) -> None:
        """Pages now readable by other nodes, with their positions (-1: deep, or unknown)."""
        mine = [k for k, d in zip(keys, depths) if (is_anchor(d, k) if d >= 0 else k[-1] % ANCHOR_EVERY == 0)]
        if not mine:
            return
        with self._cond:
            for k in mine:
                self._pending[k] = True
            self._cond.notify()

    def removed(self, keys: Sequence[PageKey]) -> None:
        """Pages no longer readable here (their slots about to be reused)."""
        with self._cond:
            for k in keys:
                if k in self._pending or k in self._inflight or k in self._published or k in self._unsure:
                    self._pending[k] = False

    def set_lease(self, lease: int) -> None:
        """The node's lease (0: none). A new lease: every anchor still wanted is put again
        under it (the ones under the old lease leave etcd with it; a put in flight under
        the old lease is queued again when it returns)."""
        with self._cond:
            if lease == self._lease:
                return
            self._lease = lease
            for k in self._published:
                if k not in self._inflight:
                    self._pending.setdefault(k, True)
            self._published.clear()
            self._cond.notify()

    # -- the writer --------------------------------------------------------------------
    def _batch(self) -> tuple[list[bytes], list[bytes], int]:
        """Up to a transaction's worth of changes, taken from pending into in flight (under the lock)."""
        deletes: list[bytes] = []
        puts: list[bytes] = []
        for k, want in list(itertools.islice(self._pending.items(), 4 * MAX_TXN_OPS)):
            if len(deletes) + len(puts) >= MAX_TXN_OPS:
                break
            del self._pending[k]
            if k not in self._unsure and want == (k in self._published):
                continue
            self._inflight[k] = want
            (puts if want else deletes).append(k)
        return puts, deletes, self._lease

    def _run(self) -> None:
        wait = 0.0
        while True:
            with self._cond:
                if wait:
                    self._cond.wait_for(lambda: self._closed, timeout=wait)
                self._cond.wait_for(lambda: self._closed or (self._pending and self._lease), timeout=1.0)
                if self._closed:
                    return
                if not (self._pending and self._lease):
                    wait = 0.0
                    continue
                puts, deletes, lease = self._batch()
            wait = 0.0
            if not (puts or deletes):
                continue
            try:
                self.etcd.write([(anchor_key(self.prefix, k, self.node), self.tier) for k in puts],
                                [anchor_key(self.prefix, k, self.node) for k in deletes], lease)
            except Exception as exc:   # noqa: BLE001 - whatever failed, the keys are retried
                self._failed(exc)
                wait = RETRY_S
                continue
            with self._cond:
                self.etcd_away = False
                self.transactions += 1
                done, self._inflight = self._inflight, {}
                self._unsure.difference_update(done)
                if lease != self._lease:   # a new lease meanwhile: these puts left with the old one
                    for k, want in done.items():
                        if want:
                            self._pending.setdefault(k, True)
                    continue
                self._published.update(puts)
                self._published.difference_update(deletes)
            if not self._pending:
                wait = self.flush_s   # gather the next batch

    def _failed(self, exc: Exception) -> None:
        """A write that failed, or whose outcome is unknown: its keys are unsure, queued
        again unless the store said something newer."""
        with self._cond:
            done, self._inflight = self._inflight, {}
            for k, want in done.items():
                self._unsure.add(k)
                self._pending.setdefault(k, want)
            self.errors += 1
            away = isinstance(exc, ClusterUnavailableError)
            if away and not self.etcd_away:
                log.warning("tierkv: publishing anchors: etcd does not answer (%s); retrying", exc)
            elif isinstance(exc, ClusterRefusedError):   # the lease gone: the membership registers again
                log.info("tierkv: publishing anchors: %s; waiting for the node's next lease", exc)
            elif not away:
                log.error("tierkv: publishing anchors failed: %r; retrying", exc)
            self.etcd_away = away

    def stats(self) -> dict[str, int | bool]:
        with self._cond:
            return {"anchors": len(self._published), "pending": len(self._pending) + len(self._inflight),
                    "transactions": self.transactions, "errors": self.errors, "etcd_away": self.etcd_away}

    def flushed(self, timeout_s: float) -> bool:
        """Wait until nothing is pending or in flight under a lease; whether that happened
        within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._cond:
                if not self._pending and not self._inflight and self._lease:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        """Stop publishing (the anchors stay until the node's lease ends: the node's close revokes it)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=self.etcd.timeout_s * 2 + 1)
