"""The page directory: which member holds which prefix, kept in etcd as *anchors*.

A page's key is prefix-chained: a node holding page ``i`` of a prompt holds its whole
prefix's worth of keys, so the directory needs only some of each prefix's pages to say
where a prompt's leading pages are. The anchors of a chain are its pages at positions 1,
2, 4, 8, 16 and 32 (counting from 1), and beyond 32 the pages whose key's last byte is a
multiple of :data:`ANCHOR_EVERY` (one in 64 on average, chosen by the key so that no node
needs to know how deep a page lies). The arithmetic that chose this over a key per page
or per-node summaries is in docs/cluster.md.

- :class:`~tierkv.cluster.publisher.Publisher` (its own module): one node's anchors,
  written under its lease as ``/tierkv/{cluster}/pages/{key hex}/{node}``.
- :class:`Directory`: every member's anchors as one process sees them, listed once (in
  pages of :data:`~tierkv.cluster.etcd.LIST_PAGE` keys at one revision) and kept current
  by a watch; a watch that ends (idle, reset, etcd restarted) is resumed from the last
  revision seen, and only a compaction past it, or counts of the keys etcd holds that
  differ from the directory's twice in a row (checked every ``check_s``), list again.
  :meth:`Directory.holders` says, for a prompt's keys, how deep an anchor each member
  holds; entries under a lease other than the member's current one (its epoch) are left
  out. Lookups ask the members it names how far they really hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from tierkv.cluster.etcd import Etcd, Event
from tierkv.config import check_name
from tierkv.errors import ClusterRefusedError, ClusterUnavailableError
from tierkv.keys import KEY_BYTES

log = logging.getLogger(__name__)

#: Beyond the first :data:`SHALLOW` pages, one page in this many (by its key) is an anchor.
ANCHOR_EVERY = 64
#: The first pages of a chain whose anchors are chosen by position (1, 2, 4, ... 32).
SHALLOW = 32
#: Seconds between attempts to reach etcd again.
RETRY_S = 1.0
#: Watch events applied under the directory's lock at a time.
EVENT_CHUNK = 1024


def pages_prefix(cluster: str) -> bytes:
    return f"/tierkv/{cluster}/pages/".encode()


def is_anchor(position: int, key: bytes) -> bool:
    """Whether the page at ``position`` (0: a chain's first page) with ``key`` is an anchor."""
    if position < SHALLOW:
        return position & (position + 1) == 0   # positions 0, 1, 3, 7, 15, 31: pages 1, 2, 4, ... 32
    return key[-1] % ANCHOR_EVERY == 0


def anchor_positions(keys: Sequence[bytes]) -> list[int]:
    """The positions of a chain's anchors among its ``keys`` (a chain from its first page)."""
    out = [p for p in (0, 1, 3, 7, 15, 31) if p < len(keys)]
    out.extend(i for i in range(SHALLOW, len(keys)) if keys[i][-1] % ANCHOR_EVERY == 0)
    return out


def anchor_key(prefix: bytes, key: bytes, node: str) -> bytes:
    return prefix + key.hex().encode() + b"/" + node.encode()


class AnchorTable:
    """Anchors in memory: page key -> a bit mask of its holders, a holder being a (node,
    lease) pair numbered as it first appears (numbers reused once unused). About 100-130
    bytes an anchor in CPython (a dict of dicts took 285)."""

    def __init__(self) -> None:
        self.masks: dict[bytes, int] = {}
        self._ids: dict[tuple[str, int], int] = {}
        self._holders: list[tuple[str, int]] = []
        self._uses: list[int] = []
        self._free: list[int] = []
        self.count = 0   # anchors, one per (page, node)

    def _id(self, node: str, lease: int) -> int:
        i = self._ids.get((node, lease))
        if i is None:
            i = self._free.pop() if self._free else len(self._holders)
            if i == len(self._holders):
                self._holders.append((node, lease))
                self._uses.append(0)
            else:
                self._holders[i] = (node, lease)
            self._ids[(node, lease)] = i
        return i

    def _release(self, i: int) -> None:
        self._uses[i] -= 1
        if not self._uses[i]:
            del self._ids[self._holders[i]]
            self._free.append(i)

    def _of(self, mask: int, node: str) -> int:
        """The holder number of ``node`` in ``mask``, or -1."""
        while mask:
            low = mask & -mask
            i = low.bit_length() - 1
            if self._holders[i][0] == node:
                return i
            mask ^= low
        return -1

    def add(self, key: bytes, node: str, lease: int) -> None:
        """``node`` holds ``key`` under ``lease`` (replacing its entry under another lease)."""
        mask = self.masks.get(key, 0)
        old = self._of(mask, node)
        i = self._id(node, lease)
        if old == i:
            return
        if old >= 0:
            mask &= ~(1 << old)
            self._release(old)
        else:
            self.count += 1
        self._uses[i] += 1
        self.masks[key] = mask | 1 << i

    def remove(self, key: bytes, node: str) -> None:
        mask = self.masks.get(key, 0)
        old = self._of(mask, node)
        if old < 0:
            return
        mask &= ~(1 << old)
        self._release(old)
        self.count -= 1
        if mask:
            self.masks[key] = mask
        else:
            del self.masks[key]

    def holders(self, key: bytes) -> list[tuple[str, int]]:
        """The (node, lease) pairs holding ``key``."""
        mask, out = self.masks.get(key, 0), []
        while mask:
            low = mask & -mask
            out.append(self._holders[low.bit_length() - 1])
            mask ^= low
        return out


class Directory:
    """Every member's anchors, as listed from etcd and kept current by a watch."""

    def __init__(self, etcd: Etcd, cluster: str, check_s: float = 1.0) -> None:
        self.etcd = etcd
        self.prefix = pages_prefix(check_name(cluster, "cluster.name"))
        self.check_s = check_s
        self._table = AnchorTable()
        self._stray: set[bytes] = set()   # keys under the prefix that are not anchors (counted, ignored)
        self._revision = 0                # the newest revision the listing or the watch delivered
        self._resume = False              # the watch ended (not compacted): watch again from _revision
        self._lock = threading.Condition()
        self.stale = True
        self.relists = 0
        self.rewatches = 0
        self._generation = 0
        self._cancel: Callable[[], None] | None = None
        self._closed = False
        self._checker: threading.Thread | None = None

    def start(self) -> Directory:
        try:
            self._list_and_watch()
        except (ClusterUnavailableError, ClusterRefusedError) as exc:
            log.warning("tierkv: cannot list the page directory yet (%s)", exc)
        self._checker = threading.Thread(target=self._check, name="tierkv-directory", daemon=True)
        self._checker.start()
        return self

    def _parse(self, key: bytes) -> tuple[bytes, str] | None:
        rest = key[len(self.prefix):]
        hexkey, sep, node = rest.partition(b"/")
        if not sep or len(hexkey) != 2 * KEY_BYTES or not node:
            return None
        try:
            return bytes.fromhex(hexkey.decode()), node.decode()
        except (ValueError, UnicodeDecodeError):
            return None

    def _list_and_watch(self) -> None:
        """List every anchor (in pages, at one revision) and watch from there (only start()
        and the checking thread call it)."""
        revision, kvs = self.etcd.get_prefix_paged(self.prefix, keys_only=True)
        table, stray = AnchorTable(), set()
        for kv in kvs:
            parsed = self._parse(kv.key)
            if parsed is None:
                stray.add(kv.key)
            else:
                table.add(parsed[0], parsed[1], kv.lease)
        with self._lock:
            if self._closed:
                return
            self._table, self._stray, self._revision, self.stale, self._resume = table, stray, revision, False, False
            self.relists += 1
            self._lock.notify_all()
        self._watch(revision + 1)

    def _watch(self, start: int) -> None:
        """Watch from revision ``start`` under a new generation (the old watch's calls are ignored)."""
        with self._lock:
            if self._closed:
                return
            old, self._cancel = self._cancel, None
            self._generation += 1
            generation = self._generation
        if old is not None:
            threading.Thread(target=old, name="tierkv-directory-unwatch", daemon=True).start()
        cancel = self.etcd.watch_prefix(self.prefix, start, lambda evs: self._events(generation, evs),
                                        lambda exc: self._broken(generation, exc))
        with self._lock:
            current = self._generation == generation and not self._closed
            if current:
                self._cancel = cancel
        if not current:
            cancel()

    def _events(self, generation: int, events: list[Event]) -> None:
        # In chunks: a node's lease ending deletes all its anchors in one response, and
        # routing (holders) must not wait for all of it.
        for i in range(0, len(events), EVENT_CHUNK):
            with self._lock:
                if self._closed or generation != self._generation:
                    return
                for ev in events[i:i + EVENT_CHUNK]:
                    self._revision = max(self._revision, ev.kv.mod_revision)
                    parsed = self._parse(ev.kv.key)
                    if parsed is None:
                        if ev.deleted:
                            self._stray.discard(ev.kv.key)
                        else:
                            self._stray.add(ev.kv.key)
                    elif ev.deleted:
                        self._table.remove(*parsed)
                    else:
                        self._table.add(parsed[0], parsed[1], ev.kv.lease)
                self._lock.notify_all()

    def _broken(self, generation: int, error: Exception | None) -> None:
        with self._lock:
            if self._closed or generation != self._generation:
                return
            if "compact" in str(error):   # the revisions after ours are gone: list again
                self.stale = True
            else:                         # idle, reset, etcd restarted: watch on from where it stopped
                self._resume = True
        log.info("tierkv: the page directory's watch ended (%s); %s", error,
                 "listing again" if self.stale else "watching on from the last revision seen")

    def _check(self) -> None:
        """Every ``check_s`` (or 20 times a count's duration, if longer): is etcd there,
        and does it hold as many keys as the listing and the watch gave?"""
        differed = False
        wait = self.check_s
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._closed, timeout=wait)
                if self._closed:
                    return
                stale, resume, revision = self.stale, self._resume, self._revision
            try:
                if resume and not stale:
                    self.rewatches += 1
                    with self._lock:
                        self._resume = False
                    self._watch(revision + 1)
                t0 = time.monotonic()
                count, _rev = self.etcd.count_prefix(self.prefix)
                wait = max(self.check_s, 20 * (time.monotonic() - t0))
                with self._lock:
                    same = count == self._table.count + len(self._stray)
                if stale or (not same and differed):
                    self._list_and_watch()
                    differed = False
                else:
                    differed = not same
            except (ClusterUnavailableError, ClusterRefusedError):
                with self._lock:
                    self.stale = True
            except Exception:   # noqa: BLE001 - the directory must go on being checked
                log.exception("tierkv: checking the page directory failed")
                with self._lock:
                    self.stale = True

    def holders(self, keys: Sequence[bytes], epochs: dict[str, int] | None = None) -> dict[str, int]:
        """For a chain's ``keys`` (from its first page): each member holding one of its
        anchors, and how many leading pages its deepest anchor covers. ``epochs``: each
        member's current lease; anchors under another lease (or of a node not in it) are
        left out."""
        out: dict[str, int] = {}
        positions = anchor_positions(keys)
        with self._lock:
            for p in positions:
                for node, lease in self._table.holders(bytes(keys[p])):
                    if epochs is None or epochs.get(node) == lease:
                        out[node] = p + 1
        return out

    def wait(self, cond: Callable[[Directory], bool], timeout_s: float) -> bool:
        """Wait until ``cond(self)`` holds (checked as events arrive); whether it did in time."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not cond(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.1))
            return True

    def __len__(self) -> int:
        """Anchors held (one per member holding it)."""
        with self._lock:
            return self._table.count

    def close(self) -> None:
        with self._lock:
            self._closed = True
            cancel, self._cancel = self._cancel, None
            self._lock.notify_all()
        if cancel is not None:
            cancel()
        if self._checker is not None:
            self._checker.join(timeout=self.etcd.timeout_s * 2 + 1)
