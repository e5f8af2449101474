"""Executes the manager's plans: moves between tiers, writes of new pages, verified reads.

Bytes move here and nowhere else; the manager only decides. Plans name tiers by
identity (two tiers may share a kind); moves between tiers go through a table keyed
by the ``(src, dst)`` tiers' *kinds*, so tiers with a faster path for a particular pair
(e.g. CUDA copies between HBM and pinned DRAM) register it instead of adding branches.
Byte counters are kept per tier name. Every read from a persistent tier is checked against the page's
recorded checksum. Called by :mod:`tierkv.store.api` with the store lock held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from itertools import groupby

import numpy as np

from tierkv.store.checksum import checksum64, checksum_rows
from tierkv.errors import TierIOError, TierUnavailableError
from tierkv.keys import PageKey
from tierkv.store.manager import BlockManager, Entry, Move, MovePlan
from tierkv.store.pages import PageList, Rows
from tierkv.store.stats import Counters
from tierkv.tiers.aligned import aligned_empty
from tierkv.tiers.base import Tier, TierId, TierKind
from tierkv.tiers.blocks import UndecodablePageError

log = logging.getLogger(__name__)

CopyFn = Callable[[Tier, Sequence[int], Tier, Sequence[int], int], np.ndarray]


def staged_copy(src: Tier, src_slots: Sequence[int], dst: Tier, dst_slots: Sequence[int],
                nbytes: int) -> tuple[np.ndarray, list[int] | None]:
    """Read from ``src`` into a staging buffer, write it to ``dst``; returns the staged rows
    and, where ``dst`` is persistent, their checksums (hashed while the write ran)."""
    staging = aligned_empty(len(src_slots) * nbytes).reshape(len(src_slots), nbytes)
    src.read(src_slots, staging)
    if dst.persistent:
        return staging, dst.write(dst_slots, staging, checksums=True)
    dst.write(dst_slots, staging)
    return staging, None


def hbm_to_dram(src: Tier, src_slots: Sequence[int], dst: Tier, dst_slots: Sequence[int], nbytes: int) -> np.ndarray:
    from tierkv.tiers.hbm import hbm_to_dram as copy  # torch loads only for stores with an HBM tier
    return copy(src, src_slots, dst, dst_slots, nbytes)  # type: ignore[arg-type]


def dram_to_hbm(src: Tier, src_slots: Sequence[int], dst: Tier, dst_slots: Sequence[int], nbytes: int) -> np.ndarray:
    from tierkv.tiers.hbm import dram_to_hbm as copy
    return copy(src, src_slots, dst, dst_slots, nbytes)  # type: ignore[arg-type]


# (src, dst) -> copy function. Pairs absent here are staged through host memory (``staged_copy``,
# which also returns the checksums a persistent destination computed).
COPY_TABLE: dict[tuple[TierKind, TierKind], CopyFn] = {
    (TierKind.HBM, TierKind.DRAM): hbm_to_dram,  # one batched copy into the pinned buffer, no staging
    (TierKind.DRAM, TierKind.HBM): dram_to_hbm,
}


def _gather(src: Rows, rows: list[int]) -> Rows:
    """``src[rows]``: a zero-copy view when the rows are consecutive or ``src`` is a
    list of separate pages, else a contiguous copy."""
    if isinstance(src, PageList):
        return src.take(rows)
    first = rows[0]
    if rows == list(range(first, first + len(rows))):
        return src[first:first + len(rows)]
    return np.take(src, rows, axis=0)


class Transfers:
    """Runs plans against the manager's tiers and keeps the byte counters."""

    def __init__(self, manager: BlockManager, counters: Counters, page_bytes: int, *,
                 deferred_sync: bool = False) -> None:
        self._m = manager
        # Group commit: the index syncs a persistent tier's data before it commits the
        # window's records, so a write here need not wait for the device.
        self._deferred = deferred_sync
        self._tiers = {t.name: t for t in manager.tiers}
        self._c = counters
        self._nbytes = page_bytes

    def run(self, plan: MovePlan, src: Rows | None = None, row_of: dict[PageKey, int] | None = None,
            source: str = "caller") -> int:
        """Execute ``plan``; placed page ``k`` takes its bytes from ``src[row_of[k]]``.

        Returns how many placed pages were published. A group whose write or index
        commit fails is abandoned (its pages become misses) and the rest of the plan
        still runs. If anything else escapes, every group not yet published is abandoned
        before it propagates, so no entry is left naming a slot its bytes never reached.
        """
        levels = self._m.levels
        moves = [list(g) for _, g in groupby(plan.ordered_moves(levels), key=lambda m: (m.src, m.dst))]
        placements = [list(g) for _, g in groupby(sorted(plan.placements, key=lambda p: levels[p[1]]),
                                                   key=lambda p: p[1])]
        published = done = 0
        try:
            for group in moves:
                self._move(group[0].src, group[0].dst, group, plan)
                done += 1
            for placed in placements:
                assert src is not None and row_of is not None
                published += self._place(placed[0][1], placed, _gather(src, [row_of[k] for k, _, _ in placed]),
                                         source, plan)
                done += 1
        except BaseException:
            rest = [[(m.key, m.dst, m.dst_slot) for m in group] for group in moves[done:]]
            for undo in rest + placements[max(0, done - len(moves)):]:
                try:
                    self._m.abandon(undo)
                except Exception:  # noqa: BLE001 - the original error is the one to raise
                    log.exception("rolling back %d planned pages after a failed transfer failed too", len(undo))
            raise
        self._m.commit_deletes(plan)  # evictions whose tier received nothing in this plan
        return published

    def _sync(self, tier: Tier) -> None:
        """Make a write durable before its publish, unless its group commit will."""
        if not (self._deferred and tier.persistent):
            tier.flush()

    def _timed(self, name: TierId, start: float) -> float:
        elapsed = time.perf_counter() - start
        self._c.tier_io_s[name] += elapsed
        return elapsed

    def _move(self, src: TierId, dst: TierId, moves: list[Move], plan: MovePlan) -> None:
        copy = COPY_TABLE.get((self._tiers[src].kind, self._tiers[dst].kind))
        args = (self._tiers[src], [m.src_slot for m in moves], self._tiers[dst], [m.dst_slot for m in moves],
                self._nbytes)
        start = time.perf_counter()
        try:
            staged, hashed = staged_copy(*args) if copy is None else (copy(*args), None)
            sums = self._checksums(dst, [m.key for m in moves], staged, hashed)
            self._sync(self._tiers[dst])
        except TierIOError as exc:
            log.warning("demotion %s->%s of %d pages failed, dropping them: %s", src, dst, len(moves), exc)
            self._m.abandon([(m.key, dst, m.dst_slot) for m in moves])
            return
        finally:
            elapsed = self._timed(dst, start)
        self._c.moved_bytes(src, dst, len(moves) * self._nbytes, elapsed)
        placed = [(m.key, dst, m.dst_slot) for m in moves]
        if self._publish(placed, sums, plan, f"demotion {src}->{dst}"):
            self._c.events["demotions"] += len(moves)

    def _place(self, name: TierId, placed: list[tuple[PageKey, TierId, int]],
               buf: Rows, source: str, plan: MovePlan) -> int:
        tier = self._tiers[name]
        start = time.perf_counter()
        try:
            slots = [s for _, _, s in placed]
            hashed: list[int] | None = None
            if tier.persistent:  # hashed on the I/O threads, as each chunk is written
                hashed = tier.write(slots, buf, checksums=True)
            else:
                tier.write(slots, buf)
            sums = self._checksums(name, [k for k, _, _ in placed], buf, hashed)
            self._sync(tier)
        except TierIOError as exc:
            log.warning("write of %d pages to %s failed, they stay misses: %s", len(placed), name, exc)
            self._m.abandon(placed)
            return 0
        finally:
            elapsed = self._timed(name, start)
        # The bytes come from a buffer: a source tier's read was counted when it happened.
        self._c.moved_bytes(source, name, len(placed) * self._nbytes, elapsed, src_read=False)
        return len(placed) if self._publish(placed, sums, plan, f"write to {name}") else 0

    def _publish(self, placed: list[tuple[PageKey, TierId, int]], sums: dict[PageKey, int], plan: MovePlan,
                 what: str) -> bool:
        """Publish written pages; if the index commit fails they are abandoned (misses), not served."""
        try:
            self._m.publish(placed, sums, plan)
        except TierIOError as exc:
            log.warning("%s of %d pages could not be committed to the index, dropping them: %s",
                        what, len(placed), exc)
            self._m.abandon(placed)
            return False
        return True

    def _checksums(self, name: TierId, keys: Sequence[PageKey], staged: Rows,
                   hashed: list[int] | None = None) -> dict[PageKey, int]:
        """Checksums for pages entering a persistent tier that do not have one yet
        (``hashed``: the rows' checksums where the write computed them)."""
        if not self._tiers[name].persistent:
            return {}
        out: dict[PageKey, int] = {}
        for i, need in enumerate(self._m.unsummed(keys)):
            if need:
                out[keys[i]] = hashed[i] if hashed is not None else checksum64(staged[i])
        return out

    def read(self, entries: Sequence[Entry], out: np.ndarray, serve: bool = True) -> int:
        """Load ``entries`` (leading pages, in order) into ``out`` rows, each from its fastest tier.

        Returns how many leading pages were loaded intact. A page that fails its
        checksum or whose read fails is forgotten (a miss from now on) and ends the run.
        ``serve``: the pages go to a caller's ``get`` (counted as hits and as
        ``tier->caller`` bytes, and touched in the policy); otherwise (a prefetch) only
        the tier's bytes read are counted.
        """
        loaded = 0
        sources = self._m.sources(entries)
        if None in sources:  # the rest of the prefix lives only on a degraded tier: misses, kept
            sources = sources[:sources.index(None)]
        for name, group in groupby(enumerate(entries[:len(sources)]), key=lambda ie: sources[ie[0]]):
            assert name is not None
            items = list(group)
            first = items[0][0]
            rows = out[first:first + len(items)]
            tier = self._tiers[name]
            start = time.perf_counter()
            sums: list[int] | None = None
            try:
                # Persistent tiers are verified: hashed on the I/O threads, as each chunk lands.
                sums = tier.read([e.slots[name] for _, e in items], rows, checksums=tier.persistent)
            except UndecodablePageError as exc:
                # Damaged blobs on a block tier: the pages before the first are intact.
                bad = min(exc.rows)
                good = self._verify(tier, items[:bad], rows[:bad]) if bad else 0
                if good == bad:
                    _, e = items[bad]
                    log.warning("page %s in %s does not decode (%s); quarantined", e.key.hex(), name, exc)
                    self._c.events["corrupt_pages"] += 1
                    self._m.forget(e.key)
                self._count(name, items[:good], time.perf_counter() - start, serve)
                return loaded + good
            except TierUnavailableError as exc:
                # The tier went down under this read: the pages are still there, only unreachable.
                log.warning("read of %d pages from %s failed, serving them as misses: %s", len(items), name, exc)
                return loaded
            except TierIOError as exc:
                log.warning("read of %d pages from %s failed, serving them as misses: %s", len(items), name, exc)
                for _, e in items:
                    self._m.forget(e.key)
                return loaded
            finally:
                elapsed = self._timed(name, start)
            good = self._verify(tier, items, rows, sums)
            self._count(name, items[:good], elapsed, serve)
            loaded += good
            if good < len(items):
                return loaded
        return loaded

    def _count(self, name: TierId, items: list[tuple[int, Entry]], seconds: float, serve: bool) -> None:
        """Count the intact pages of a read: hits and bytes to the caller, or bytes read only."""
        if not serve:
            self._c.tier_read[name] += len(items) * self._nbytes
            return
        self._c.moved_bytes(name, "caller", len(items) * self._nbytes, seconds)
        self._c.tier_hits[name] += len(items)
        for _, e in items:
            self._m.touch(e.key, name)

    def _verify(self, tier: Tier, items: list[tuple[int, Entry]], rows: np.ndarray,
                sums: list[int] | None = None) -> int:
        """How many leading ``items`` match their recorded checksums (``sums``: the rows'
        checksums where the read computed them); quarantines the first that does not."""
        if not tier.persistent:
            return len(items)
        if sums is None:
            sums = checksum_rows(rows)
        for i, (_, e) in enumerate(items):
            if sums[i] != e.checksum:
                log.warning("page %s in %s slot %d failed its checksum (stored %s, read %x); quarantined",
                            e.key.hex(), tier.name, e.slots[tier.name], e.checksum, sums[i])
                self._c.events["corrupt_pages"] += 1
                self._m.forget(e.key)
                return i
        return len(items)
