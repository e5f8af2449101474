"""The block manager: where every page lives, and the plans that move pages between tiers.

It knows each page's key, parent, length, checksum and slot per tier, the pin counts,
and one policy per tier; it reserves slots and decides demotions, promotions and
drops, but it never touches page bytes. Plans it hands out are executed by
:mod:`tierkv.store.transfer` and then completed here, which is when persistent records are
committed. Called by :mod:`tierkv.store.api` with the store lock held; not thread-safe on
its own.

Caching is inclusive downwards: a page promoted to a faster tier keeps its copy
below, so evicting it from the faster tier later costs no write, and the persistent
copy survives a restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from tierkv.errors import CapacityError, InputError, TierIOError
from tierkv.store.index import IndexRecord, PersistentIndex
from tierkv.keys import PageKey, new_keyset
from tierkv.store.moves import Entry, Move, PageLocation, MovePlan
from tierkv.policy import Policy
from tierkv.tiers.aligned import ALIGN
from tierkv.tiers.base import Tier, TierKind


log = logging.getLogger(__name__)

# Pages a full volatile tier demotes at once (capped at 1/16 of the tier).
DEMOTION_BATCH = 64


def _as_slot(rec: IndexRecord, blocks_per_slot: int) -> int | None:
    """The slot a record names on a slot tier; a block record only if it is one whole slot, raw."""
    if not rec.extents:
        return rec.slot
    if len(rec.extents) == 1:
        first, count = rec.extents[0]
        if count == blocks_per_slot and first % blocks_per_slot == 0:
            return first // blocks_per_slot
    return None


class BlockManager:
    """Page directory plus per-tier policies over an ordered list of tiers (fastest first)."""

    def __init__(self, tiers: Sequence[Tier], policies: dict[TierKind, Policy],
                 index: PersistentIndex | None) -> None:
        self.tiers = sorted(tiers, key=lambda t: t.kind.rank)
        self._by_kind = {t.kind: t for t in self.tiers}
        self._policies = policies
        self._index = index
        self._entries: dict[PageKey, Entry] = {}
        # Cached children of each page: the last tier keeps a parent whose child lives in
        # a faster tier (dropping it would orphan the child: lookups stop at the gap).
        self._children: dict[PageKey, set[PageKey]] = {}
        # Published pages -> rank of their fastest tier, so a lookup is one C scan.
        self.resident = new_keyset()
        self.demotion_batch = DEMOTION_BATCH
        # Observers told when pages become readable in a tier ("placed", after publish) and
        # when they stop being so ("removed", before their slots are reused): f(event, kind,
        # keys, slots). The store's peer server keeps its key index with them.
        self.listeners: list[Callable[[str, TierKind, list[PageKey], list[int]], None]] = []
        # Deletes of evicted or forgotten records whose index transaction failed (a full
        # disk, say): they ride in that tier's next commit, ahead of its puts.
        self._unsynced: dict[TierKind, list[PageKey]] = {}

    # -- queries -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, key: PageKey) -> Entry | None:
        return self._entries.get(key)

    def locate(self, key: PageKey) -> PageLocation | None:
        e = self._entries.get(key)
        if e is None:
            return None
        slots = tuple(sorted(e.slots.items(), key=lambda kv: kv[0].rank))
        return PageLocation(e.key, e.fastest, slots, e.nbytes, e.checksum, e.parent, e.pins)

    def used_slots(self, kind: TierKind) -> int:
        tier = self._by_kind[kind]
        return tier.num_slots - tier.num_free

    def below(self, kind: TierKind) -> Tier | None:
        """The next slower tier that is available (a degraded fabric tier is skipped), if any."""
        idx = self.tiers.index(self._by_kind[kind])
        return next((t for t in self.tiers[idx + 1:] if t.available), None)

    def source(self, e: Entry) -> TierKind | None:
        """The fastest available tier holding ``e``; None when its only copies are on degraded tiers."""
        return min((k for k in e.slots if self._by_kind[k].available), key=lambda k: k.rank, default=None)

    def sources(self, entries: Sequence[Entry]) -> list[TierKind | None]:
        """:meth:`source` of each entry; just their fastest tiers while every tier is up."""
        if all(t.available for t in self.tiers):
            return [e.fastest for e in entries]
        return [self.source(e) for e in entries]

    def unavailable_ranks(self) -> frozenset[int]:
        """Ranks of the tiers that serve no I/O now (degraded fabric tiers)."""
        return frozenset(t.kind.rank for t in self.tiers if not t.available)

    # -- reopening -------------------------------------------------------------------
    def adopt_persistent(self, kind: TierKind) -> int:
        """Load the index records of a persistent tier; their slots become used. Returns the count."""
        assert self._index is not None
        tier = self._by_kind[kind]
        blocks_per_slot = tier.slot_bytes // ALIGN
        slot_of: dict[PageKey, int] = {}

        def valid(rec: IndexRecord) -> bool:
            if rec.nbytes > tier.slot_bytes:
                return False
            if not tier.block_addressed:  # slot tier: a block record is usable only as a whole raw slot
                slot = _as_slot(rec, blocks_per_slot)
                if slot is None or slot >= tier.num_slots or slot in taken:
                    return False
                taken.add(slot)
                slot_of[rec.key] = slot
                return True
            # Block tier: a record from a slot-addressed open is its slot's blocks, raw.
            extents = rec.extents or ((rec.slot * blocks_per_slot, blocks_per_slot),)
            try:
                slot_of[rec.key] = tier.claim_extents(extents)
            except InputError:
                return False
            return True

        taken: set[int] = set()
        good, dropped = self._index.adopt(kind.value, valid)
        if dropped:
            log.warning("%s index: %d records fail validation (undecodable, out of range or sharing a slot); "
                        "dropped, those pages are misses", kind.value, dropped)
        if not tier.block_addressed:
            tier.claim([slot_of[r.key] for r in good])
        for rec in good:
            have = self._entries.get(rec.key)
            if have is not None and have.checksum == rec.checksum and have.nbytes == rec.nbytes:
                # Recorded in an earlier persistent tier too: a crash between a demotion's
                # commit and its source's delete. Copies are inclusive: keep both.
                have.slots[kind] = slot_of[rec.key]
            else:
                if have is not None:  # the same key with other bytes: trust neither copy
                    self.forget(rec.key)
                    tier.free([slot_of[rec.key]])
                    self._index.commit(kind.value, delete=[rec.key])
                    continue
                self._add(Entry(rec.key, rec.parent, rec.nbytes, rec.checksum, {kind: slot_of[rec.key]}))
            self.resident.add(rec.key, self._entries[rec.key].fastest.rank)
            self._policies[kind].insert(rec.key, rec.parent)
        return len(good)

    # -- planning --------------------------------------------------------------------
    def plan_store(self, pages: Sequence[tuple[PageKey, PageKey | None]], nbytes: int,
                   prefix: Sequence[PageKey] = ()) -> MovePlan:
        """Reserve slots for new pages, fastest tier first, evicting as the policies say.

        ``prefix`` are the prompt's pages already cached: they are not evicted to make
        room for the new pages that extend them (that would leave those orphaned).
        """
        total = sum(t.num_slots for t in self.tiers)
        if len(pages) > total:
            raise CapacityError(f"asked to store {len(pages)} pages; all tiers together hold {total}")
        plan = MovePlan()
        protect = {k for k, _ in pages} | set(prefix)
        todo = list(pages)
        for tier in self.tiers:
            if not todo:
                break
            if not tier.available:
                continue
            admitted = [(k, p) for k, p in todo if self._policies[tier.kind].admit(k, p)]
            slots = self._reserve(tier, len(admitted), protect, plan)
            for (key, parent), slot in zip(admitted, slots):
                plan.placements.append((key, tier.kind, slot))
                self._add(Entry(key, parent, nbytes, None, {tier.kind: slot}))
            placed = {k for k, _ in admitted[:len(slots)]}
            todo = [(k, p) for k, p in todo if k not in placed]
        plan.dropped += len(todo)
        return plan

    def plan_promote(self, keys: Sequence[PageKey], to: TierKind, protect: set[PageKey]) -> MovePlan:
        """Reserve slots in ``to`` for pages that live only below it (inclusive copy-up)."""
        plan = MovePlan()
        tier = self._by_kind[to]
        want = [k for k in keys if k in self._entries and to not in self._entries[k].slots
                and self._entries[k].fastest.rank > to.rank]
        slots = self._reserve(tier, len(want), protect | set(want), plan)
        for key, slot in zip(want, slots):
            plan.placements.append((key, to, slot))
            self._entries[key].slots[to] = slot
        return plan

    def plan_writeback(self) -> MovePlan:
        """Copy pages that live only in volatile tiers down to the first persistent tier.

        Used at a clean close so a restart finds them. Parents come before their
        children, since a page is useless without its prefix; older persistent pages
        are evicted as that tier's policy says.
        """
        plan = MovePlan()
        target = next((t for t in self.tiers if t.persistent and t.available), None)
        if target is None:
            return plan
        volatile = [e for e in self._entries.values() if not any(self._by_kind[k].persistent for k in e.slots)]
        slots = self._reserve(target, len(volatile), {e.key for e in volatile}, plan)
        for e, slot in zip(volatile, slots):
            plan.moves.append(Move(e.key, e.fastest, e.slots[e.fastest], target.kind, slot))
            e.slots[target.kind] = slot
        return plan

    def _reserve(self, tier: Tier, n: int, protect: set[PageKey], plan: MovePlan) -> list[int]:
        need = n - tier.num_free
        if need > 0 and not tier.persistent and self.below(tier.kind) is not None:
            # Demote in batches: one flush and one index commit then cover many pages.
            need = max(need, min(self.demotion_batch, tier.num_slots // 16))
        policy = self._policies[tier.kind]

        # The last tier keeps a parent whose child sits in a faster tier; a store whose last
        # tier is also its first (DRAM only) has no faster tier, so skips the check.
        last = self.below(tier.kind) is None and tier is not self.tiers[0]
        entries, children, faster = self._entries, self._children, tier.kind.rank
        parents, kept = plan.parents_below.get(tier.kind, ()), plan.kept

        def evictable(k: PageKey) -> bool:
            e = entries[k]
            if k in protect or e.pins or k in parents or k in kept:
                return False
            if last and len(e.slots) == 1:  # its last copy: dropped, not demoted
                return not any(any(t.rank < faster for t in entries[c].slots) for c in children.get(k, ()))
            return True

        # A compressed page frees less than the raw page reserved in its place, so a
        # block tier may need more victims than pages asked for: evict until they fit.
        while need > 0:
            victims = policy.victims(need, evictable)
            for victim in victims:
                self._evict(victim, tier, protect, plan)
            need = n - tier.num_free
            if not victims:
                break
        return tier.allocate(min(n, tier.num_free))

    def _emit(self, event: str, kind: TierKind, keys: list[PageKey], slots: list[int]) -> None:
        for listener in self.listeners:
            listener(event, kind, keys, slots)

    def _evict(self, key: PageKey, tier: Tier, protect: set[PageKey], plan: MovePlan) -> None:
        e = self._entries[key]
        lower: Tier | None = None
        dst: list[int] = []
        if len(e.slots) == 1:  # its last copy: demoted to the next tier down, or dropped
            lower = self.below(tier.kind)
            if lower is not None and self._policies[lower.kind].admit(key, e.parent):
                if e.parent is not None:  # see MovePlan.parents_below
                    plan.parents_below.setdefault(lower.kind, set()).add(e.parent)
                dst = self._reserve(lower, 1, protect | {key}, plan)
            if not dst and lower is not None and self._children.get(key):
                # Dropping it would strand its cached descendants (they went down before
                # it, leaves first, or live below): it stays where it is for this plan.
                plan.kept.add(key)
                return
        slot = e.slots.pop(tier.kind)
        if self.listeners:
            self._emit("removed", tier.kind, [key], [slot])
        self._policies[tier.kind].remove(key)
        plan.evicted += 1
        if tier.persistent:
            plan.deletes.setdefault(tier.kind, []).append(key)
        if not e.slots:
            if dst:
                plan.moves.append(Move(key, tier.kind, slot, lower.kind, dst[0]))  # type: ignore[union-attr]
                e.slots[lower.kind] = dst[0]  # type: ignore[union-attr]
            else:
                self._remove(key)
                self.resident.discard(key)
                plan.dropped += 1
        if e.slots and key in self.resident:
            self.resident.add(key, e.fastest.rank)
        tier.free([slot])

    def _add(self, e: Entry) -> None:
        self._entries[e.key] = e
        if e.parent is not None:
            self._children.setdefault(e.parent, set()).add(e.key)

    def _remove(self, key: PageKey) -> Entry | None:
        e = self._entries.pop(key, None)
        if e is not None and e.parent is not None:
            sib = self._children.get(e.parent)
            if sib is not None:
                sib.discard(key)
                if not sib:
                    del self._children[e.parent]
        return e

    # -- completion --------------------------------------------------------------------
    def _commit(self, kind: TierKind, put: Sequence[IndexRecord] = (), delete: Sequence[PageKey] = ()) -> None:
        """One index transaction for ``kind``, carrying the deletes earlier ones could not.

        On failure (TierIOError) the deletes are kept for the next commit; the puts are the
        caller's to roll back. Deletes run before puts, so a key deleted late and stored
        again in the same transaction keeps its new record.
        """
        assert self._index is not None
        deletes = self._unsynced.pop(kind, []) + list(delete)
        try:
            self._index.commit(kind.value, put=put, delete=deletes)
        except TierIOError:
            if deletes:
                self._unsynced[kind] = deletes
            raise

    def commit_deletes(self, plan: MovePlan) -> None:
        """Durably forget evicted persistent records that no publish has carried yet.

        A failed transaction is logged and its deletes wait for the tier's next commit:
        until then a record may name a slot that holds newer bytes, which fail its
        checksum after a restart (a miss, never wrong data).
        """
        if self._index is None:
            return
        for kind, keys in plan.deletes.items():
            try:
                self._commit(kind, delete=keys)
            except TierIOError as exc:
                log.warning("deleting %d evicted %s records from the index failed; retried with the "
                            "next commit: %s", len(keys), kind.value, exc)
        plan.deletes.clear()

    def publish(self, placed: Sequence[tuple[PageKey, TierKind, int]], checksums: dict[PageKey, int],
                plan: MovePlan | None = None) -> None:
        """Make written pages visible; persistent ones are committed to the index first.

        The plan's pending deletes for the same tier ride in the same transaction: one
        durable commit per batch. A crash before it leaves the evicted records pointing
        at slots that may hold newer bytes; their checksums then fail and the pages are
        misses, never wrong data. A failed commit raises TierIOError with nothing made
        visible; the caller then abandons ``placed``.
        """
        by_tier: dict[TierKind, list[IndexRecord]] = {}
        for key, kind, slot in placed:
            e = self._entries[key]
            if key in checksums:
                e.checksum = checksums[key]
            if self._by_kind[kind].persistent:
                if e.checksum is None:
                    raise InputError(f"page bound for the {kind.value} tier has no checksum")
                extents = self._by_kind[kind].extents(slot) or ()
                # Block records name the slot of their first block: a reader that addresses
                # the file in slots finds a raw page there, or bytes that fail the checksum.
                first = extents[0][0] * ALIGN // self._by_kind[kind].slot_bytes if extents else slot
                by_tier.setdefault(kind, []).append(
                    IndexRecord(key, first, e.nbytes, e.checksum, e.parent, extents))
        if self._index is not None:
            for kind, recs in by_tier.items():
                deletes = plan.deletes.pop(kind, []) if plan is not None else []
                self._commit(kind, put=recs, delete=deletes)
        for key, kind, _slot in placed:
            e = self._entries[key]
            self._policies[kind].insert(key, e.parent)
            self.resident.add(key, e.fastest.rank)
        if self.listeners:
            for kind in {k for _, k, _ in placed}:
                mine = [(key, slot) for key, k, slot in placed if k is kind]
                self._emit("placed", kind, [k for k, _ in mine], [s for _, s in mine])

    def abandon(self, placed: Sequence[tuple[PageKey, TierKind, int]]) -> None:
        """Roll back reservations whose writes failed: the slots are freed, the pages become misses."""
        for key, kind, slot in placed:
            if self.listeners:
                self._emit("removed", kind, [key], [slot])
            self._by_kind[kind].free([slot])
            e = self._entries.get(key)
            if e is None:
                continue
            e.slots.pop(kind, None)
            if not e.slots:
                self.forget(key)
            elif key in self.resident:
                self.resident.add(key, e.fastest.rank)

    def forget(self, key: PageKey) -> None:
        """Drop a page from every tier (quarantine or failed write); frees its slots.

        The page is gone from memory even if deleting its index record fails (logged; the
        delete rides in the tier's next commit, and the record fails its checksum after a
        restart if its slot was reused).
        """
        e = self._remove(key)
        self.resident.discard(key)
        if e is None:
            return
        for kind, slot in e.slots.items():
            if self.listeners:
                self._emit("removed", kind, [key], [slot])
            self._policies[kind].remove(key)
            if self._by_kind[kind].persistent and self._index is not None:
                try:
                    self._commit(kind, delete=[key])
                except TierIOError as exc:
                    log.warning("deleting the %s record of page %s failed; retried with the next "
                                "commit: %s", kind.value, key.hex(), exc)
            self._by_kind[kind].free([slot])

    def note_request(self, keys: Sequence[PageKey]) -> None:
        """Tell every tier's policy which pages a request needs, cached or not, in order."""
        now = time.monotonic()
        for policy in self._policies.values():
            policy.on_request(keys, now)

    def touch(self, key: PageKey, kind: TierKind) -> None:
        self._policies[kind].touch(key)

    def pin(self, key: PageKey, delta: int) -> None:
        e = self._entries[key]
        if e.pins + delta < 0:
            raise InputError("unpin of a page that is not pinned")
        e.pins += delta
