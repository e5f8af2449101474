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

import numpy as np

from tierkv.store.checksum import checksum64, checksum_rows
from tierkv.errors import TierIOError, TierUnavailableError
from tierkv.keys import KEY_BYTES, PageKey
from tierkv.store.manager import BlockManager, MovePlan
from tierkv.store.moves import Lead, Moves, Placed, Sums
from tierkv.store.pages import PageList, Rows
from tierkv.store.stats import Counters
from tierkv.tiers.aligned import ALIGN, aligned_empty, is_aligned
from tierkv.tiers.base import Tier, TierId, TierKind
from tierkv.tiers.blocks import UndecodablePageError
from tierkv.tiers.dram import DramTier

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


def direct_copy(src: Tier, src_slots: Sequence[int], dst: Tier, dst_slots: Sequence[int],
                nbytes: int) -> tuple[PageList, list[int] | None]:
    """:func:`staged_copy` out of a DRAM tier, whose slots ``dst`` reads in place (a tier
    that cannot stacks them once): no staging buffer to fault in per move. The slots
    are freed in the plan but not written again before its moves are done."""
    assert isinstance(src, DramTier)
    rows = direct_rows(src, src_slots, nbytes)
    return rows, dst.write(dst_slots, rows, checksums=True) if dst.persistent else dst.write(dst_slots, rows)


def direct_rows(src: DramTier, src_slots: Sequence[int], nbytes: int) -> PageList:
    """The first ``nbytes`` of each of ``src_slots`` of a DRAM tier, as the rows a tier
    writes in place: marked aligned where the slots are, and scattered where the kernel
    gave the buffer no huge pages (a direct write then goes through bounce buffers)."""
    buf = src.buffer
    if buf.dtype != np.uint8 or buf.ndim != 2 or not buf.flags.c_contiguous or nbytes > buf.shape[1]:
        raise AssertionError(f"the {src.name} tier's buffer is not a C-contiguous uint8 [slots, bytes] array "
                             f"of slots holding {nbytes} bytes")
    return PageList([buf[s, :nbytes] for s in src_slots], nbytes,
                    aligned=src.slot_bytes % ALIGN == 0 and is_aligned(buf), checked=True,
                    scattered=not src.huge_pages)


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


def gather_rows(src: Rows, rows: list[int] | np.ndarray) -> Rows:
    """``src[rows]``: a zero-copy view when the rows are consecutive or ``src`` is a
    list of separate pages, else a contiguous copy."""
    if isinstance(src, PageList):
        return src.take(rows if isinstance(rows, list) else rows.tolist())
    first, n = int(rows[0]), len(rows)
    if isinstance(rows, np.ndarray):
        consecutive = int(rows[-1]) - first == n - 1 and (n < 3 or bool((np.diff(rows) == 1).all()))
    else:
        consecutive = rows == list(range(first, first + n))
    if consecutive:
        return src[first:first + n]
    return np.take(src, rows, axis=0)


#: Where a plan's new pages take their bytes from: the row of the source for each page,
#: by key, or by its position in what the plan was asked to place (a batch's ``index``).
RowOf = dict[PageKey, int] | np.ndarray


def _rows_for(placed: Placed, row_of: RowOf) -> list[int] | np.ndarray:
    if isinstance(row_of, np.ndarray):
        return row_of[placed.index]
    return [row_of[k] for k in placed.keys]


#: A read-only store reports the pages that failed verification at most once per this many seconds.
READER_REPORT_S = 60.0


class Transfers:
    """Runs plans against the manager's tiers and keeps the byte counters."""

    def __init__(self, manager: BlockManager, counters: Counters, page_bytes: int, *,
                 deferred_sync: bool = False, read_only: bool = False) -> None:
        self._m = manager
        # A read-only store's pages that fail verification are misses it cannot quarantine
        # (the writer owns the index), and most are races with the writer reusing a slot:
        # counted, and reported in one warning per READER_REPORT_S.
        self._read_only = read_only
        self._unverified = 0
        self._reported = -READER_REPORT_S
        # Group commit: the index syncs a persistent tier's data before it commits the
        # window's records, so a write here need not wait for the device.
        self._deferred = deferred_sync
        self._tiers = {t.name: t for t in manager.tiers}
        self._c = counters
        self._nbytes = page_bytes

    def run(self, plan: MovePlan, src: Rows | None = None, row_of: RowOf | None = None,
            source: str = "caller") -> int:
        """Execute ``plan``; placed page ``k`` takes its bytes from ``src[row_of[k]]`` (or,
        where ``row_of`` is an array, from ``src[row_of[i]]``, ``i`` its batch's ``index``).

        Returns how many placed pages were published. A group whose write or index
        commit fails is abandoned (its pages become misses) and the rest of the plan
        still runs. If anything else escapes, every group not yet published is abandoned
        before it propagates, so no entry is left naming a slot its bytes never reached.
        """
        levels = self._m.levels
        moves = plan.move_groups(levels)
        placements = plan.placed_by_level(levels)
        published = done = 0
        try:
            for group in moves:
                self._move(group, plan)
                done += 1
            for placed in placements:
                assert src is not None and row_of is not None
                published += self._place(placed, gather_rows(src, _rows_for(placed, row_of)), source, plan)
                done += 1
        except BaseException:
            rest = [group.placed() for group in moves[done:]]
            for undo in rest + placements[max(0, done - len(moves)):]:
                try:
                    self._m.abandon(undo)
                except Exception:  # noqa: BLE001 - the original error is the one to raise
                    log.exception("rolling back %d planned pages after a failed transfer failed too", len(undo))
            raise
        self._m.commit_deletes(plan)  # evictions whose tier received nothing in this plan
        return published

    def run_deferring(self, plan: MovePlan, src: Rows, row_of: RowOf, defer: TierId) -> tuple[int, Placed | None]:
        """As :meth:`run`, except the pages placed in the tier ``defer``: their slots stay
        reserved and unpublished, returned (None if there are none) for the caller to
        write (without the store's lock) and then hand to :meth:`finish_deferred`.
        Returns (pages published, deferred)."""
        mine = [b for b in plan.placed_by_level(self._m.levels) if b.tier == defer]
        plan.placed = [b for b in plan.placed if b.tier != defer]
        removed = self._m.removed
        try:
            published = self.run(plan, src, row_of)
        except BaseException:
            for batch in mine:
                self._m.abandon(batch)
            raise
        if not mine or self._m.removed == removed:
            return published, (mine[0] if mine else None)
        # run() may have swept a reserved page (left without its prefix by an eviction in
        # this plan), freeing its slot: such pages are not written.
        live = self._m.still_placed(mine[0])
        return published, (mine[0] if live.all() else mine[0].take(live))

    def finish_deferred(self, plan: MovePlan, placed: Placed | None, seconds: float, wrote: bool,
                        removed: int | None = None) -> int:
        """Publish deferred placements whose bytes were written (``wrote``) in ``seconds``;
        pages dropped meanwhile (their slot no longer theirs) are left out, as is all of it
        when the write failed. ``removed``: the manager's ``removed`` when the plan was
        made. Where it has not moved since, every placement still holds its slot, and
        every parent its copy if the plan dropped nothing: neither is checked again.
        Returns how many were published."""
        if placed is None or not len(placed):
            return 0
        name = placed.tier
        settled = removed is not None and self._m.removed == removed
        if settled:
            keep = placed
        else:
            live = self._m.still_placed(placed)
            keep = placed if live.all() else placed.take(live)
        gone = len(placed) - len(keep)
        if not wrote:
            self._m.abandon(keep)
            self._m.commit_deletes(plan)
            return 0
        if gone:
            log.debug("%d pages written to %s were dropped before they were published", gone, name)
        self._c.tier_io_s[name] += seconds
        self._c.moved_bytes("caller", name, len(placed) * self._nbytes, seconds, src_read=False)
        try:
            published = len(keep) if len(keep) and self._publish(keep, None, plan, f"write to {name}") else 0
        except BaseException:   # anything but a failed commit (handled there): nothing stays reserved
            self._m.abandon(keep)
            raise
        self._m.commit_deletes(plan)
        if published and not (settled and plan.dropped == 0) and self._m.drop_orphans(keep.keys, keep.blob):
            published = len(self._m.present(keep.blob, name)) // KEY_BYTES
        return published

    def count_served(self, name: TierId, keys: bytes, seconds: float) -> None:
        """Count pages a get copied out of ``name`` without the store's lock: hits, bytes,
        and a touch in the tier's policy for those still there."""
        k = len(keys) // KEY_BYTES
        self._c.tier_io_s[name] += seconds
        self._c.moved_bytes(name, "caller", k * self._nbytes, seconds)
        self._c.tier_hits[name] += k
        present = self._m.present(keys, name)
        if present:
            self._m.touch_many(present, name)

    def _sync(self, tier: Tier) -> None:
        """Make a write durable before its publish, unless its group commit will."""
        if not (self._deferred and tier.persistent):
            tier.flush()

    def _timed(self, name: TierId, start: float) -> float:
        elapsed = time.perf_counter() - start
        self._c.tier_io_s[name] += elapsed
        return elapsed

    def _move(self, moves: Moves, plan: MovePlan) -> None:
        src, dst = moves.src, moves.dst
        copy = COPY_TABLE.get((self._tiers[src].kind, self._tiers[dst].kind))
        args = (self._tiers[src], moves.src_slots, self._tiers[dst], moves.dst_slots, self._nbytes)
        start = time.perf_counter()
        staged: Rows
        try:
            if copy is not None:
                staged, hashed = copy(*args), None
            elif isinstance(self._tiers[src], DramTier):   # written from the slots: no staging buffer
                staged, hashed = direct_copy(*args)
            else:
                staged, hashed = staged_copy(*args)
            sums = self._checksums(dst, moves.keys, staged, hashed)
            self._sync(self._tiers[dst])
        except TierIOError as exc:
            log.warning("demotion %s->%s of %d pages failed, dropping them: %s", src, dst, len(moves), exc)
            self._m.abandon(moves.placed())
            return
        finally:
            elapsed = self._timed(dst, start)
        self._c.moved_bytes(src, dst, len(moves) * self._nbytes, elapsed)
        if self._publish(moves.placed(), sums, plan, f"demotion {src}->{dst}"):
            self._c.events["demotions"] += len(moves)

    def _place(self, placed: Placed, buf: Rows, source: str, plan: MovePlan) -> int:
        name = placed.tier
        tier = self._tiers[name]
        start = time.perf_counter()
        try:
            slots = placed.slots
            hashed: list[int] | None = None
            if tier.persistent:  # hashed on the I/O threads, as each chunk is written
                hashed = tier.write(slots, buf, checksums=True)
            else:
                tier.write(slots, buf)
            sums = self._checksums(name, placed.keys, buf, hashed)
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

    def _publish(self, placed: Placed, sums: Sums | None, plan: MovePlan, what: str) -> bool:
        """Publish written pages; if the index commit fails they are abandoned (misses), not served."""
        try:
            self._m.publish(placed, sums if sums is not None else {}, plan)
        except TierIOError as exc:
            log.warning("%s of %d pages could not be committed to the index, dropping them: %s",
                        what, len(placed), exc)
            self._m.abandon(placed)
            return False
        return True

    def _checksums(self, name: TierId, keys: Sequence[PageKey], staged: Rows,
                   hashed: list[int] | None = None) -> Sums | None:
        """Checksums by position for pages entering a persistent tier that do not have one
        yet (``hashed``: the rows' checksums where the write computed them); None elsewhere."""
        if not self._tiers[name].persistent:
            return None
        need = self._m.unsummed(keys)
        if hashed is not None:
            values = np.array(hashed, dtype=np.uint64)
        else:
            values = np.zeros(len(keys), dtype=np.uint64)
            for i in np.flatnonzero(need).tolist():
                values[i] = checksum64(staged[i])
        return Sums(values, need)

    def read(self, lead: Lead, out: np.ndarray, serve: bool = True) -> int:
        """Load the pages of ``lead`` (leading pages, in order) into ``out`` rows, each from
        the tier its ``levels`` name.

        Returns how many leading pages were loaded intact. A page that fails its
        checksum or whose read fails is forgotten (a miss from now on) and ends the run;
        so does a page with no copy on a tier that serves I/O (it is kept).
        ``serve``: the pages go to a caller's ``get`` (counted as hits and as
        ``tier->caller`` bytes, and touched in the policy); otherwise (a prefetch) only
        the tier's bytes read are counted.
        """
        levels = lead.levels
        n = lead.sourced()
        starts = (np.flatnonzero(levels[1:n] != levels[:n - 1]) + 1).tolist() if n else []
        for a, b in zip([0, *starts], [*starts, n]):
            if a == b:
                break
            tier = self._m.tiers[int(levels[a])]
            name = tier.name
            rows = out[a:b]
            start = time.perf_counter()
            sums: list[int] | None = None
            try:
                # Persistent tiers are verified: hashed on the I/O threads, as each chunk lands.
                sums = tier.read(lead.slots[a:b], rows, checksums=tier.persistent)
            except UndecodablePageError as exc:
                # Damaged blobs on a block tier: the pages before the first are intact.
                bad = min(exc.rows)
                good = self._verify(tier, lead, a, rows[:bad]) if bad else 0
                if good == bad:
                    key = lead.key(a + bad)
                    self._quarantine(key, f"page {key.hex()} in {name} does not decode ({exc})")
                self._count(name, lead, a, a + good, time.perf_counter() - start, serve)
                return a + good
            except TierUnavailableError as exc:
                # The tier went down under this read: the pages are still there, only unreachable.
                log.warning("read of %d pages from %s failed, serving them as misses: %s", b - a, name, exc)
                return a
            except TierIOError as exc:
                log.warning("read of %d pages from %s failed, serving them as misses: %s", b - a, name, exc)
                for i in range(a, b):
                    self._m.forget(lead.key(i))
                return a
            finally:
                elapsed = self._timed(name, start)
            good = self._verify(tier, lead, a, rows, sums)
            self._count(name, lead, a, a + good, elapsed, serve)
            if good < b - a:
                return a + good
        return n

    def read_layered(self, lead: Lead, out: np.ndarray, ranges: Sequence[tuple[int, int]],
                     after: Callable[[int], None], *, shared: bool = False) -> int:
        """:meth:`read` for a caller's get, range by range across every page: ``after(k)``
        once bytes ``ranges[k]`` of every page still being read have landed in ``out``, so
        that a consumer of the first ranges (an engine's first layers) starts before the
        last land. Pages from persistent tiers are verified once all their ranges are in:
        what ``after`` announced is only good up to the count returned. When a tier cannot
        read ranges (encoded pages, unaligned for O_DIRECT), pages are read whole and
        ``after`` is called for every range at the end. ``shared``: ``out`` is a caller's
        memory (a client's page buffer), so a page that fails its check there is read
        again into a row of the store's own before it is quarantined.
        """
        levels = lead.levels
        n = lead.sourced()
        cuts = [0, *(np.flatnonzero(levels[1:n] != levels[:n - 1]) + 1).tolist(), n] if n else [0]
        runs = [(a, b, self._m.tiers[int(levels[a])]) for a, b in zip(cuts, cuts[1:])]
        if not all(t.reads_ranges(s, e, out[a:b]) for a, b, t in runs for s, e in ranges):
            got = self.read(lead, out)
            for k in range(len(ranges)):
                after(k)
            return got
        limit = n
        elapsed = [0.0] * len(runs)
        # One tier: it overlaps the ranges' reads where it can. Several: range by range.
        passes = [ranges] if len(runs) == 1 else [[rng] for rng in ranges]
        for k, part in enumerate(passes):
            for r, (a, b, tier) in enumerate(runs):
                if a >= limit:
                    break
                start = time.perf_counter()
                try:
                    if len(runs) == 1:
                        tier.read_ranges(lead.slots[a:b], out[a:b], part, after)
                    else:
                        tier.read_range(lead.slots[a:b], out[a:b], *part[0])
                except TierUnavailableError as exc:   # still there, only unreachable
                    log.warning("read of %d pages from %s failed, serving them as misses: %s", b - a, tier.name, exc)
                    limit = a
                except TierIOError as exc:
                    log.warning("read of %d pages from %s failed, serving them as misses: %s", b - a, tier.name, exc)
                    for i in range(a, b):
                        self._m.forget(lead.key(i))
                    limit = a
                finally:
                    elapsed[r] += self._timed(tier.name, start)
            if len(runs) > 1:
                after(k)
        for r, (a, b, tier) in enumerate(runs):
            if a >= limit:
                return limit
            good = self._recheck(tier, lead, a, out[a:b]) if shared else self._verify(tier, lead, a, out[a:b])
            self._count(tier.name, lead, a, a + good, elapsed[r], True)
            if good < b - a:
                return a + good
        return limit

    def _recheck(self, tier: Tier, lead: Lead, start: int, rows: np.ndarray) -> int:
        """:meth:`_verify` for rows in a caller's memory: a page that does not match is read
        again into a row of the store's own and checked there (the caller may have
        written into its rows meanwhile; that must not get a good page quarantined for
        everyone); a good re-read replaces the caller's row."""
        if not tier.persistent:
            return len(rows)
        got = checksum_rows(rows)
        want = lead.sums[start:start + len(rows)]
        for i in range(len(rows)):
            if int(got[i]) == want[i]:
                continue
            own = aligned_empty(rows.shape[1]).reshape(1, rows.shape[1])
            try:
                again = tier.read([lead.slots[start + i]], own, checksums=True)
            except TierIOError:
                again = None
            if again is not None and int(again[0]) == want[i]:
                rows[i] = own[0]
                continue
            key = lead.key(start + i)
            self._quarantine(key, f"page {key.hex()} in {tier.name} slot {lead.slots[start + i]} failed its "
                                  f"checksum (stored {want[i]:x}, read {int(got[i]):x}, then again)")
            return i
        return len(rows)

    def _quarantine(self, key: PageKey, what: str) -> None:
        """A page that failed verification: the writer forgets it (a miss from now on); a
        read-only store serves it as a miss and reports such pages in bulk."""
        self._c.events["corrupt_pages"] += 1
        if not self._read_only:
            log.warning("%s; quarantined", what)
            self._m.forget(key)
            return
        self._unverified += 1
        log.debug("%s; a miss for this read-only store", what)
        now = time.monotonic()
        if now - self._reported >= READER_REPORT_S:
            log.warning("%d pages read by this read-only store failed verification since the last report (the "
                        "latest: %s) and were served as misses: a writer reusing slots after this store looked "
                        "them up, or damage, which the writer quarantines when it reads them", self._unverified, what)
            self._unverified, self._reported = 0, now

    def _count(self, name: TierId, lead: Lead, start: int, stop: int, seconds: float, serve: bool) -> None:
        """Count the intact pages ``start .. stop-1`` of a read: hits and bytes to the caller,
        or bytes read only."""
        k = stop - start
        if not serve:
            self._c.tier_read[name] += k * self._nbytes
            return
        self._c.moved_bytes(name, "caller", k * self._nbytes, seconds)
        self._c.tier_hits[name] += k
        if k:
            self._m.touch_many(lead.keys_of(start, stop), name)

    def _verify(self, tier: Tier, lead: Lead, start: int, rows: np.ndarray, sums: list[int] | None = None) -> int:
        """How many leading ``rows`` (pages ``start ..`` of ``lead``) match their recorded
        checksums (``sums``: the rows' checksums where the read computed them);
        quarantines the first that does not."""
        n = len(rows)
        if not tier.persistent:
            return n
        got = [int(v) for v in (checksum_rows(rows) if sums is None else sums)]
        want = lead.sums[start:start + n]
        if got == want:
            return n
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                key = lead.key(start + i)
                self._quarantine(key, f"page {key.hex()} in {tier.name} slot {lead.slots[start + i]} failed its "
                                      f"checksum (stored {w:x}, read {g:x})")
                return i
        return n
