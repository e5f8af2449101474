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

Tiers are told apart by name (:data:`~tierkv.tiers.base.TierId`), so a store may hold
two tiers of one kind. They are ordered by kind (HBM, DRAM, NVMe, NVMe-oF), tiers of one
kind in the order given; a tier's *level* is its place in that order (0 is the fastest).
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
from tierkv.tiers.base import Tier, TierId, TierKind


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
    """Page directory plus per-tier policies over tiers ordered fastest first.

    ``policies`` has one policy per tier name; names must be unique (InputError).
    """

    def __init__(self, tiers: Sequence[Tier], policies: dict[TierId, Policy],
                 index: PersistentIndex | None) -> None:
        self.tiers = sorted(tiers, key=lambda t: t.kind.rank)  # stable: one kind's tiers keep their order
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise InputError(f"two tiers of a store share a name: {names}; name each tier")
        if TierKind.PEER.value in names:  # the stats count the pages loaded from other nodes under it
            raise InputError(f"a store's tier cannot be named {TierKind.PEER.value!r}: {names}")
        if set(policies) != set(names):
            raise InputError(f"policies are for tiers {sorted(policies)}, the tiers are {names}")
        self._by_id = {t.name: t for t in self.tiers}
        #: Each tier's level: its place in ``tiers`` (0 is the fastest).
        self.levels: dict[TierId, int] = {name: i for i, name in enumerate(names)}
        # bytes.translate table from levels (what ``resident`` holds) to kind ranks (what
        # lookups report): one C pass over a lookup's bytes.
        self.kind_ranks = bytes(t.kind.rank for t in self.tiers) + bytes(range(len(names), 256))
        self._policies = policies
        self._index = index
        self._entries: dict[PageKey, Entry] = {}
        # Cached children of each page: the last tier keeps a parent whose child lives in
        # a faster tier (dropping it would orphan the child: lookups stop at the gap).
        self._children: dict[PageKey, set[PageKey]] = {}
        # Published pages -> level of their fastest tier, so a lookup is one C scan.
        self.resident = new_keyset()
        self.demotion_batch = DEMOTION_BATCH
        # Observers told when pages become readable in a tier ("placed", after publish) and
        # when they stop being so ("removed", before their slots are reused): f(event, tier,
        # keys, slots). The store's peer server keeps its key index with them.
        self.listeners: list[Callable[[str, TierId, list[PageKey], list[int]], None]] = []
        # Deletes of evicted or forgotten records whose index transaction failed (a full
        # disk, say): they ride in that tier's next commit, ahead of its puts.
        self._unsynced: dict[TierId, list[PageKey]] = {}

    # -- queries -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, key: PageKey) -> Entry | None:
        return self._entries.get(key)

    def locate(self, key: PageKey) -> PageLocation | None:
        e = self._entries.get(key)
        if e is None:
            return None
        slots = tuple(sorted(e.slots.items(), key=lambda kv: self.levels[kv[0]]))
        return PageLocation(e.key, slots[0][0], slots, e.nbytes, e.checksum, e.parent, e.pins)

    def tier(self, name: TierId) -> Tier:
        return self._by_id[name]

    def fastest(self, e: Entry) -> TierId:
        """The fastest tier holding ``e``."""
        return min(e.slots, key=self.levels.__getitem__)

    def used_slots(self, name: TierId) -> int:
        tier = self._by_id[name]
        return tier.num_slots - tier.num_free

    def below(self, name: TierId) -> Tier | None:
        """The next slower tier that is available (a degraded fabric tier is skipped), if any."""
        return next((t for t in self.tiers[self.levels[name] + 1:] if t.available), None)

    def source(self, e: Entry) -> TierId | None:
        """The fastest available tier holding ``e``; None when its only copies are on degraded tiers."""
        return min((k for k in e.slots if self._by_id[k].available), key=self.levels.__getitem__, default=None)

    def sources(self, entries: Sequence[Entry]) -> list[TierId | None]:
        """:meth:`source` of each entry; just their fastest tiers while every tier is up."""
        if all(t.available for t in self.tiers):
            return [self.fastest(e) for e in entries]
        return [self.source(e) for e in entries]

    def unavailable_levels(self) -> frozenset[int]:
        """Levels of the tiers that serve no I/O now (degraded fabric tiers)."""
        return frozenset(i for i, t in enumerate(self.tiers) if not t.available)

    # -- reopening -------------------------------------------------------------------
    def adopt_persistent(self, name: TierId) -> int:
        """Load the index records of a persistent tier; their slots become used. Returns the count."""
        assert self._index is not None
        tier = self._by_id[name]
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
        good, dropped = self._index.adopt(name, valid)
        if dropped:
            log.warning("%s index: %d records fail validation (undecodable, out of range or sharing a slot); "
                        "dropped, those pages are misses", name, dropped)
        if not tier.block_addressed:
            tier.claim([slot_of[r.key] for r in good])
        for rec in good:
            have = self._entries.get(rec.key)
            if have is not None and have.checksum == rec.checksum and have.nbytes == rec.nbytes:
                # Recorded in an earlier persistent tier too: a crash between a demotion's
                # commit and its source's delete. Copies are inclusive: keep both.
                have.slots[name] = slot_of[rec.key]
            else:
                if have is not None:  # the same key with other bytes: trust neither copy
                    self.forget(rec.key)
                    tier.free([slot_of[rec.key]])
                    self._index.commit(name, delete=[rec.key])
                    continue
                self._add(Entry(rec.key, rec.parent, rec.nbytes, rec.checksum, {name: slot_of[rec.key]}))
            self.resident.add(rec.key, self.levels[self.fastest(self._entries[rec.key])])
            self._policies[name].insert(rec.key, rec.parent)
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
            admitted = [(k, p) for k, p in todo if self._policies[tier.name].admit(k, p)]
            slots = self._reserve(tier, len(admitted), protect, plan)
            for (key, parent), slot in zip(admitted, slots):
                plan.placements.append((key, tier.name, slot))
                self._add(Entry(key, parent, nbytes, None, {tier.name: slot}))
            placed = {k for k, _ in admitted[:len(slots)]}
            todo = [(k, p) for k, p in todo if k not in placed]
        plan.dropped += len(todo)
        return plan

    def plan_promote(self, keys: Sequence[PageKey], to: TierId, protect: set[PageKey]) -> MovePlan:
        """Reserve slots in ``to`` for pages that live only below it (inclusive copy-up)."""
        plan = MovePlan()
        tier = self._by_id[to]
        level = self.levels[to]
        want = [k for k in keys if k in self._entries and to not in self._entries[k].slots
                and self.levels[self.fastest(self._entries[k])] > level]
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
        volatile = [e for e in self._entries.values() if not any(self._by_id[k].persistent for k in e.slots)]
        slots = self._reserve(target, len(volatile), {e.key for e in volatile}, plan)
        for e, slot in zip(volatile, slots):
            src = self.fastest(e)
            plan.moves.append(Move(e.key, src, e.slots[src], target.name, slot))
            e.slots[target.name] = slot
        return plan

    def _reserve(self, tier: Tier, n: int, protect: set[PageKey], plan: MovePlan) -> list[int]:
        need = n - tier.num_free
        if need > 0 and not tier.persistent and self.below(tier.name) is not None:
            # Demote in batches: one flush and one index commit then cover many pages.
            need = max(need, min(self.demotion_batch, tier.num_slots // 16))
        policy = self._policies[tier.name]

        # The last tier keeps a parent whose child sits in a faster tier; a store whose last
        # tier is also its first (DRAM only) has no faster tier, so skips the check.
        last = self.below(tier.name) is None and tier is not self.tiers[0]
        entries, children, levels = self._entries, self._children, self.levels
        faster = levels[tier.name]
        parents, kept = plan.parents_below.get(tier.name, ()), plan.kept

        def evictable(k: PageKey) -> bool:
            e = entries[k]
            if k in protect or e.pins or k in parents or k in kept:
                return False
            if last and len(e.slots) == 1:  # its last copy: dropped, not demoted
                return not any(any(levels[t] < faster for t in entries[c].slots) for c in children.get(k, ()))
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

    def _emit(self, event: str, name: TierId, keys: list[PageKey], slots: list[int]) -> None:
        for listener in self.listeners:
            listener(event, name, keys, slots)

    def _evict(self, key: PageKey, tier: Tier, protect: set[PageKey], plan: MovePlan) -> None:
        e = self._entries[key]
        lower: Tier | None = None
        dst: list[int] = []
        if len(e.slots) == 1:  # its last copy: demoted to the next tier down, or dropped
            lower = self.below(tier.name)
            if lower is not None and self._policies[lower.name].admit(key, e.parent):
                if e.parent is not None:  # see MovePlan.parents_below
                    plan.parents_below.setdefault(lower.name, set()).add(e.parent)
                dst = self._reserve(lower, 1, protect | {key}, plan)
            if not dst and lower is not None and self._children.get(key):
                # Dropping it would strand its cached descendants (they went down before
                # it, leaves first, or live below): it stays where it is for this plan.
                plan.kept.add(key)
                return
        slot = e.slots.pop(tier.name)
        if self.listeners:
            self._emit("removed", tier.name, [key], [slot])
        self._policies[tier.name].remove(key)
        plan.evicted += 1
        if tier.persistent:
            plan.deletes.setdefault(tier.name, []).append(key)
        if not e.slots:
            if dst:
                assert lower is not None
                plan.moves.append(Move(key, tier.name, slot, lower.name, dst[0]))
                e.slots[lower.name] = dst[0]
            else:
                self._remove(key)
                self.resident.discard(key)
                plan.dropped += 1
        if e.slots and key in self.resident:
            self.resident.add(key, self.levels[self.fastest(e)])
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
    def _commit(self, name: TierId, put: Sequence[IndexRecord] = (), delete: Sequence[PageKey] = ()) -> None:
        """One index transaction for tier ``name``, carrying the deletes earlier ones could not.

        On failure (TierIOError) the deletes are kept for the next commit; the puts are the
        caller's to roll back. Deletes run before puts, so a key deleted late and stored
        again in the same transaction keeps its new record.
        """
        assert self._index is not None
        deletes = self._unsynced.pop(name, []) + list(delete)
        try:
            self._index.commit(name, put=put, delete=deletes)
        except TierIOError:
            if deletes:
                self._unsynced[name] = deletes
            raise

    def commit_deletes(self, plan: MovePlan) -> None:
        """Durably forget evicted persistent records that no publish has carried yet.

        A failed transaction is logged and its deletes wait for the tier's next commit:
        until then a record may name a slot that holds newer bytes, which fail its
        checksum after a restart (a miss, never wrong data).
        """
        if self._index is None:
            return
        for name, keys in plan.deletes.items():
            try:
                self._commit(name, delete=keys)
            except TierIOError as exc:
                log.warning("deleting %d evicted %s records from the index failed; retried with the "
                            "next commit: %s", len(keys), name, exc)
        plan.deletes.clear()

    def publish(self, placed: Sequence[tuple[PageKey, TierId, int]], checksums: dict[PageKey, int],
                plan: MovePlan | None = None) -> None:
        """Make written pages visible; persistent ones are committed to the index first.

        The plan's pending deletes for the same tier ride in the same transaction: one
        durable commit per batch. A crash before it leaves the evicted records pointing
        at slots that may hold newer bytes; their checksums then fail and the pages are
        misses, never wrong data. A failed commit raises TierIOError with nothing made
        visible; the caller then abandons ``placed``.
        """
        by_tier: dict[TierId, list[IndexRecord]] = {}
        for key, name, slot in placed:
            e = self._entries[key]
            if key in checksums:
                e.checksum = checksums[key]
            tier = self._by_id[name]
            if tier.persistent:
                if e.checksum is None:
                    raise InputError(f"page bound for the {name} tier has no checksum")
                extents = tier.extents(slot) or ()
                # Block records name the slot of their first block: a reader that addresses
                # the file in slots finds a raw page there, or bytes that fail the checksum.
                first = extents[0][0] * ALIGN // tier.slot_bytes if extents else slot
                by_tier.setdefault(name, []).append(
                    IndexRecord(key, first, e.nbytes, e.checksum, e.parent, extents))
        if self._index is not None:
            for name, recs in by_tier.items():
                deletes = plan.deletes.pop(name, []) if plan is not None else []
                self._commit(name, put=recs, delete=deletes)
        for key, name, _slot in placed:
            e = self._entries[key]
            self._policies[name].insert(key, e.parent)
            self.resident.add(key, self.levels[self.fastest(e)])
        if self.listeners:
            for name in {n for _, n, _ in placed}:
                mine = [(key, slot) for key, n, slot in placed if n == name]
                self._emit("placed", name, [k for k, _ in mine], [s for _, s in mine])

    def abandon(self, placed: Sequence[tuple[PageKey, TierId, int]]) -> None:
        """Roll back reservations whose writes failed: the slots are freed, the pages become misses."""
        for key, name, slot in placed:
            if self.listeners:
                self._emit("removed", name, [key], [slot])
            self._by_id[name].free([slot])
            e = self._entries.get(key)
            if e is None:
                continue
            e.slots.pop(name, None)
            if not e.slots:
                self.forget(key)
            elif key in self.resident:
                self.resident.add(key, self.levels[self.fastest(e)])

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
        for name, slot in e.slots.items():
            if self.listeners:
                self._emit("removed", name, [key], [slot])
            self._policies[name].remove(key)
            if self._by_id[name].persistent and self._index is not None:
                try:
                    self._commit(name, delete=[key])
                except TierIOError as exc:
                    log.warning("deleting the %s record of page %s failed; retried with the next "
                                "commit: %s", name, key.hex(), exc)
            self._by_id[name].free([slot])

    def note_request(self, keys: Sequence[PageKey]) -> None:
        """Tell every tier's policy which pages a request needs, cached or not, in order."""
        now = time.monotonic()
        for policy in self._policies.values():
            policy.on_request(keys, now)

    def touch(self, key: PageKey, name: TierId) -> None:
        self._policies[name].touch(key)

    def pin(self, key: PageKey, delta: int) -> None:
        e = self._entries[key]
        if e.pins + delta < 0:
            raise InputError("unpin of a page that is not pinned")
        e.pins += delta
