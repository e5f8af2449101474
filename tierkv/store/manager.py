"""The block manager: where every page lives, and the plans that move pages between tiers.

It knows each page's key, parent, length, checksum and slot per tier, the pin counts,
and one policy per tier; it reserves slots and decides demotions, promotions and
drops, but it never touches page bytes. Plans it hands out are executed by
:mod:`tierkv.store.transfer` and then completed here, which is when persistent records are
committed. Called by :mod:`tierkv.store.api` with the store lock held; not thread-safe on
its own.

What it knows of the pages lives in a :class:`~tierkv.store.table.PageTable`: rows of
numpy columns behind a C hash map, no Python object per page. The table is also the
resident-key index a lookup scans (:attr:`BlockManager.resident`). Callers get
:class:`~tierkv.store.moves.Entry` snapshots of the pages they asked for.

Caching is inclusive downwards: a page promoted to a faster tier keeps its copy
below, so evicting it from the faster tier later costs no write, and the persistent
copy survives a restart.

No page is kept that no lookup can reach (a lookup stops at a prompt's first miss): a
cached child in another tier keeps its parent from being dropped; the cached descendants
of a page that leaves the store anyway (a policy that is not leaf-first evicted it, it
failed its checksum, its write failed) are dropped once the plan is done; a close
persists, and an open adopts, only pages whose whole prefix is persisted.

Tiers are told apart by name (:data:`~tierkv.tiers.base.TierId`), so a store may hold
two tiers of one kind. They are ordered by kind (HBM, DRAM, NVMe, NVMe-oF), tiers of one
kind in the order given; a tier's *level* is its place in that order (0 is the fastest).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Sequence

import numpy as np

from tierkv.errors import CapacityError, InputError, TierIOError
from tierkv.keys import KEY_BYTES, PageKey, split_keys, take_keys
from tierkv.policy import Policy
from tierkv.store.columns import CountColumn
from tierkv.store.index import IndexRecord, PackedRecords, PersistentIndex, run_key
from tierkv.store.index_runs import COMPACT_CHUNK, COMPACT_MIN, load_runs, replay, unpack_run
from tierkv.store.index_scan import RECORD_DTYPE, RecordArrays, packed_blob, packed_values, scan_records
from tierkv.store.moves import Entry, Lead, MovePlan, Moves, NewPages, PageLocation, Placed, Sums, as_placed
from tierkv.store.table import LOWEST_LEVEL, MAX_SLOTS, MAX_TIERS, NO_LEVEL, PageTable, rows_of
from tierkv.tiers.aligned import ALIGN
from tierkv.tiers.base import Tier, TierId, TierKind

log = logging.getLogger(__name__)

# Pages a full volatile tier demotes at once (capped at 1/16 of the tier).
DEMOTION_BATCH = 64
_NO_KEY = bytes(KEY_BYTES)
_ROW = struct.Struct("<i")  # one int32 row, as the table's core takes rows
#: The largest page length a row records.
MAX_NBYTES = (1 << 32) - 1
# Pointer doublings that reach the root of any chain of rows (a depth below 2**40).
_MAX_DOUBLINGS = 40


#: Past every run's key: a rewrite through it replaces them all.
_LAST_RUN = run_key((1 << 64) - 1)


def _as_slot(rec: IndexRecord, blocks_per_slot: int) -> int | None:
    """The slot a record names on a slot tier; a block record only if it is one whole slot, raw."""
    if not rec.extents:
        return rec.slot
    if len(rec.extents) == 1:
        first, count = rec.extents[0]
        if count == blocks_per_slot and first % blocks_per_slot == 0:
            return first // blocks_per_slot
    return None


def _arrays_of(recs: Sequence[IndexRecord], slots: Sequence[int]) -> RecordArrays:
    """Records as arrays, with ``slots`` in the slot column."""
    return RecordArrays(b"".join(r.key for r in recs), np.array(slots, dtype=np.uint64),
                        np.array([r.nbytes for r in recs], dtype=np.uint32),
                        np.array([r.checksum for r in recs], dtype=np.uint64),
                        b"".join(r.parent or _NO_KEY for r in recs),
                        np.array([r.parent is not None for r in recs], dtype=bool))


def _slot_validator(tier: Tier) -> tuple[Callable[[RecordArrays], np.ndarray], list[np.ndarray]]:
    """Judge a slot tier's fixed-size records: valid where the length fits a slot, the slot
    is in range and no record before it names it. Also returns the list each call appends
    its kept slots to."""
    claimed: list[np.ndarray] = []

    def valid(a: RecordArrays) -> np.ndarray:
        ok = np.flatnonzero((a.nbytes <= tier.slot_bytes) & (a.slot < tier.num_slots))
        _, first = np.unique(a.slot[ok], return_index=True)
        keep = np.zeros(len(a), dtype=bool)
        keep[ok[first]] = True
        claimed.append(a.slot[keep])
        return keep

    return valid, claimed


def _remove_pages(policy: Policy, keys: list[PageKey]) -> None:
    """``policy.remove`` of each key in order: one ``remove_many`` call where the policy
    has it (optional, as ``insert_many``)."""
    remove_many = getattr(policy, "remove_many", None)
    if remove_many is not None and len(keys) > 1:
        remove_many(b"".join(keys))
    else:
        for key in keys:
            policy.remove(key)


def _insert_pages(policy: Policy, keys: bytes, parents: bytes, has_parent: np.ndarray) -> None:
    """``policy.insert`` of each 16-byte key of ``keys`` in order, its parent from ``parents``
    where ``has_parent``: one ``insert_many`` call where the policy has it (optional)."""
    insert_many = getattr(policy, "insert_many", None)
    if insert_many is not None:
        insert_many(keys, parents, has_parent.astype(np.uint8).tobytes())
        return
    for i, has in enumerate(has_parent.tolist()):
        j = i * KEY_BYTES
        policy.insert(PageKey(keys[j:j + KEY_BYTES]), PageKey(parents[j:j + KEY_BYTES]) if has else None)


def _admit(policy: Policy, pages: NewPages) -> np.ndarray | None:
    """``policy.admit`` of each page in order: None where it admits them all, else which
    it does. One ``admit_all`` call first where the policy has it (optional: it says
    whether it admits every page without weighing each), else one ``admit_keys`` call
    (optional: from the keys alone; None where the policy needs the parents), else one
    ``admit_many`` call where it has that (optional)."""
    admit_all = getattr(policy, "admit_all", None)
    if admit_all is not None and admit_all(pages.keys):
        return None
    admit_keys = getattr(policy, "admit_keys", None)
    ok = admit_keys(pages.keys) if admit_keys is not None else None
    if ok is None:   # the policy weighs the parents too: (key, parent) pairs
        pairs = pages.pairs()
        admit_many = getattr(policy, "admit_many", None)
        ok = admit_many(pairs) if admit_many is not None else [policy.admit(k, p) for k, p in pairs]
    return None if all(ok) else np.array(ok, dtype=bool)


def _lowest(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


def _new_table(tiers: Sequence[Tier], policies: dict[TierId, Policy]) -> PageTable:
    """The page table, keeping its keys in the key table of the slowest tier's policy where
    that policy offers one (``key_table()``: the compiled gittins policy): that tier holds
    most of the pages, and its leaf heaps and ghost hold their keys, so each such key is
    kept once for the three (about 30 bytes a page less: docs/benchmarks.md, round 11).

    A tier above the slowest with at most 1/8 of the store's slots (a node's DRAM above
    its NVMe) keeps its slot and cached-children columns for its own pages only (sparse:
    about 44 bytes a page it holds instead of 8 a page of the store)."""
    wide = any(t.block_addressed for t in tiers)
    total = sum(t.num_slots for t in tiers)
    sparse = [i < len(tiers) - 1 and not t.block_addressed and 8 * t.num_slots <= total for i, t in enumerate(tiers)]
    offer = getattr(policies[tiers[-1].name], "key_table", None)
    keys = offer() if offer is not None else None
    if keys is not None:
        try:
            return PageTable(len(tiers), wide_slots=wide, keys=keys, sparse=sparse)
        except ValueError:   # another store's page table uses it (a policy object given twice)
            pass
    return PageTable(len(tiers), wide_slots=wide, sparse=sparse)


class BlockManager:
    """Page table plus per-tier policies over tiers ordered fastest first.

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
        if len(names) > MAX_TIERS:
            raise InputError(f"a store holds at most {MAX_TIERS} tiers, got {len(names)}: {names}")
        for tier in tiers:
            if tier.num_slots > MAX_SLOTS and not tier.block_addressed:
                raise InputError(f"the {tier.name} tier has {tier.num_slots:,} slots; a tier holds at most "
                                 f"{MAX_SLOTS:,}: use larger pages or a smaller capacity")
        self._by_id = {t.name: t for t in self.tiers}
        #: Each tier's level: its place in ``tiers`` (0 is the fastest).
        self.levels: dict[TierId, int] = {name: i for i, name in enumerate(names)}
        self._names = names
        # bytes.translate table from levels (what ``resident`` holds) to kind ranks (what
        # lookups report): one C pass over a lookup's bytes.
        self.kind_ranks = bytes(t.kind.rank for t in self.tiers) + bytes(range(len(names), 256))
        self._policies = policies
        self._index = index
        # A block-addressed tier's slots are handles from a counter that never reuses one.
        self.table = _new_table(self.tiers, policies)
        #: Published pages -> level of their fastest tier (the table's lookup half), so a
        #: lookup is one C scan.
        self.resident = self.table.core
        self._pages = 0
        self._incarnations = 0    # pages that got a first copy so far: each snapshot's generation
        #: Copies removed so far (evicted, dropped, abandoned, forgotten): where it has not
        #: moved, every slot reserved since is still its page's (see ``still_placed``).
        self.removed = 0
        self.demotion_batch = DEMOTION_BATCH
        # Observers told when pages become readable in a tier ("placed", after publish) and
        # when they stop being so ("removed", before their slots are reused): f(event, tier,
        # keys, slots). The store's peer server keeps its key index with them.
        self.listeners: list[Callable[[str, TierId, list[PageKey], list[int]], None]] = []
        # Deletes of evicted or forgotten records whose index transaction failed (a full
        # disk, say): they ride in that tier's next commit, ahead of its puts.
        self._unsynced: dict[TierId, list[PageKey]] = {}
        # A plan took the last copy of a page with cached children (an eviction by a policy
        # that is not leaf-first, a failed write): the children may be in flight, so
        # commit_deletes, once the plan is done, drops what it stranded.
        self._stray = False
        self._adopted: set[TierId] = set()   # persistent tiers whose records were adopted
        self._adopting = False
        self.compactions = 0    # index compactions done (tierkv.store.index_runs)
        self._no_compaction: set[TierId] = set()   # tiers whose compaction failed unexpectedly, until a reopen

    # -- rows ------------------------------------------------------------------------
    def _row(self, key: PageKey) -> int:
        return self.table.core.row(key)  # type: ignore[no-any-return]

    def _parent_key(self, r: int) -> PageKey | None:
        p = int(self.table.parent[r]) - 1
        return PageKey(self.table.key(p)) if p >= 0 else None

    def _add_copy(self, r: int, lvl: int, slot: int) -> None:
        t = self.table
        w = int(t.where[r])
        t.slot[lvl, r] = slot + 1
        t.where[r] = w | (1 << lvl)
        p = int(t.parent[r]) - 1
        if p >= 0:
            t.kids[lvl, p] += 1
            if not w:
                t.nkids[p] += 1
        if not w:
            self._pages += 1
            self._incarnations += 1
            t.gen[r] = self._incarnations & 0xFFFFFFFF

    def _drop_copy(self, r: int, lvl: int) -> tuple[int, bool]:
        """Clear row ``r``'s copy at ``lvl``; returns its slot and whether it was the last copy.

        A page left with no copy is unpublished; its row is freed, or kept as a
        placeholder while cached children name it as their parent.
        """
        t = self.table
        w = int(t.where[r]) & ~(1 << lvl)
        slot = int(t.slot[lvl, r]) - 1
        t.slot[lvl, r] = 0
        self.removed += 1
        t.where[r] = w
        p = int(t.parent[r]) - 1
        if p >= 0:
            t.kids[lvl, p] -= 1
            if not w:
                t.nkids[p] -= 1
        if w:
            return slot, False
        self._pages -= 1
        t.core.set_levels(_ROW.pack(r), NO_LEVEL)
        t.parent[r] = 0
        t.pins.pop(r, None)
        t.has_sum[r] = False
        if not t.nkids[r]:
            t.nbytes.forget(r)            # an odd length's entry goes; the common one is set on reuse
            t.core.release(_ROW.pack(r))  # its columns are zero but length and checksum, set on reuse
        if p >= 0 and not t.where[p] and not t.nkids[p]:
            t.nbytes.forget(p)
            t.core.release(_ROW.pack(p))  # a placeholder: its columns are zero
        return slot, True

    def _republish(self, r: int) -> None:
        """A published page's level follows its fastest copy."""
        core = self.table.core
        rb = _ROW.pack(r)
        if core.levels(rb)[0] != NO_LEVEL:
            core.set_levels(rb, _lowest(int(self.table.where[r])))

    def _view(self, r: int) -> Entry:
        t = self.table
        w = int(t.where[r])
        slots = {self._names[lvl]: int(t.slot[lvl, r]) - 1 for lvl in range(len(self._names)) if w >> lvl & 1}
        return Entry(PageKey(t.key(r)), self._parent_key(r), int(t.nbytes[r]),
                     int(t.checksum[r]) if t.has_sum[r] else None, slots, t.pins.get(r, 0), int(t.gen[r]))

    # -- reachability ----------------------------------------------------------------
    def _stranded(self, has: np.ndarray) -> np.ndarray:
        """Rows where ``has`` (a bool per row) is set but not for every ancestor: pages a
        lookup could never reach if only those copies were kept. Pointer doubling over the
        parent column, O(rows log depth) numpy work; a row on a parent cycle (only a
        damaged index could name one) counts as stranded."""
        up = self.table.parent.astype(np.int64) - 1
        gap = np.zeros(len(up), dtype=bool)   # some ancestor within the span jumped lacks ``has``
        idx = np.flatnonzero(up >= 0)
        gap[idx] = ~has[up[idx]]
        for _ in range(_MAX_DOUBLINGS):
            if not len(idx):
                break
            a = up[idx]
            gap[idx] |= gap[a]
            up[idx] = up[a]
            idx = idx[up[idx] >= 0]
        gap[idx] = True   # still linked after every doubling: a cycle
        return np.flatnonzero(has & gap).astype(np.int32)   # rows as the core takes them

    def _discard(self, rows: np.ndarray, mask: int, plan: MovePlan | None) -> int:
        """Evict the copies of ``rows`` on the levels of ``mask``, a vectorized pass per tier;
        their records' deletes go to ``plan``, or without one are committed now (a failure
        is logged and the deletes ride in the tier's next commit). Returns how many pages
        left the store (also counted in the plan's ``dropped``)."""
        work = MovePlan() if plan is None else plan
        before = work.dropped
        t = self.table
        rows = np.asarray(rows, dtype=np.int32)
        for lvl, tier in enumerate(self.tiers):
            if mask >> lvl & 1:
                sel = rows[(t.where[rows] >> lvl) & 1 == 1]
                if len(sel):
                    self._evict_run(t.keys(sel), sel, tier, work)
        if plan is None:
            stray, self._stray = self._stray, False   # commit only: no sweep from inside one
            self.commit_deletes(work)
            self._stray = stray
        return work.dropped - before

    def _sweep(self, plan: MovePlan | None = None) -> int:
        """Drop every page that some ancestor's absence strands (a miss for every lookup);
        returns how many. Only where no plan is in flight: its reserved copies count as held.

        Pinned pages stay while pinned: their holder may be reading them, and they are
        reachable again once the missing page is stored again (a quarantined page is
        recomputed). A later sweep, the close or the next open drops them if not.
        """
        dead = self._stranded(self.table.where != 0)
        dead = dead[~self.table.pinned(dead)]
        gone = self._discard(dead, (1 << len(self.tiers)) - 1, plan) if len(dead) else 0
        self._stray = False   # nothing is stranded now
        return gone

    # -- queries -------------------------------------------------------------------
    def __len__(self) -> int:
        return self._pages

    def entry(self, key: PageKey) -> Entry | None:
        """A snapshot of the page's bookkeeping, or None when no tier holds it."""
        r = self._row(key)
        if r < 0 or not self.table.where[r]:
            return None
        return self._view(r)

    def held(self, blob: bytes) -> list[bool]:
        """For each key of a blob: whether some tier holds the page (published or reserved)."""
        return self.held_mask(blob).tolist()  # type: ignore[no-any-return]

    def held_mask(self, blob: bytes) -> np.ndarray:
        """:meth:`held` as a bool array."""
        t = self.table
        rows = rows_of(t.core.find(blob))
        return (rows >= 0) & (t.where[np.where(rows >= 0, rows, 0)] != 0)  # type: ignore[no-any-return]

    def leading(self, blob: bytes, limit: int) -> list[Entry]:
        """Snapshots of the leading published pages of a key blob, at most ``limit``."""
        t = self.table
        rows = rows_of(t.core.prefix_rows(blob[:max(limit, 0) * KEY_BYTES]))
        if not len(rows):
            return []
        keys = t.keys(rows)
        prow = t.parent[rows].astype(np.int64) - 1
        pkeys: list[PageKey | None] = [None] * len(rows)
        linked = np.flatnonzero(prow >= 0)
        if len(linked):
            for i, k in zip(linked.tolist(), t.keys(prow[linked])):
                pkeys[i] = k
        where = t.where[rows].tolist()
        slots = (t.slot[:, rows].astype(np.int64) - 1).T.tolist()
        sums = np.where(t.has_sum[rows], t.checksum[rows], 0).tolist()
        has_sum = t.has_sum[rows].tolist()
        names = list(enumerate(self._names))
        pins = [t.pins.get(r, 0) for r in rows.tolist()] if t.pins else [0] * len(rows)
        return [Entry(keys[i], pkeys[i], nb, sums[i] if has_sum[i] else None,
                      {name: slots[i][lvl] for lvl, name in names if where[i] >> lvl & 1}, pins[i], gen)
                for i, (nb, gen) in enumerate(zip(t.nbytes[rows].tolist(), t.gen[rows].tolist()))]

    def shallow_depths(self, keys: Sequence[PageKey], cap: int) -> np.ndarray:
        """For each key: its page's position in its chain (0: no parent) where that is below
        ``cap`` and the chain up to its root is held, else -1 (deeper, not held, or its
        chain passes a page no tier holds, whose parent link is no longer kept). A walk of
        at most ``cap`` steps over the parent column, all keys at once."""
        t = self.table
        rows = rows_of(t.core.find(b"".join(keys))).astype(np.int64)
        depth = np.full(len(rows), -1, dtype=np.int64)
        cur = rows.copy()
        live = (cur >= 0) & (t.where[np.maximum(cur, 0)] != 0)
        for d in range(cap):
            if not live.any():
                break
            up = np.where(live, t.parent[np.maximum(cur, 0)].astype(np.int64) - 1, -1)
            root = live & (up < 0)
            depth[root] = d
            live &= ~root
            cur = up
            live &= (cur >= 0) & (t.where[np.maximum(cur, 0)] != 0)
        return depth

    def lead(self, blob: bytes, limit: int) -> Lead:
        """The leading published pages of a key blob (at most ``limit``), column by column,
        each with its fastest copy on a tier that serves I/O."""
        t = self.table
        rows = rows_of(t.core.prefix_rows(blob[:max(limit, 0) * KEY_BYTES]))
        where = t.where[rows]
        down = sum(1 << lvl for lvl, tier in enumerate(self.tiers) if not tier.available)
        if down:
            where = where & ~np.uint8(down)
        levels = LOWEST_LEVEL[where]    # NO_LEVEL (NO_SOURCE) where no copy serves I/O
        slots = t.slot[np.minimum(levels, len(self.tiers) - 1), rows].astype(np.int64) - 1
        return Lead(blob[:len(rows) * KEY_BYTES], levels, slots.tolist(), t.checksum[rows].tolist())

    def snapshots(self) -> list[Entry]:
        """Snapshots of every page the manager holds (for checks and tests: a Python object per page)."""
        live = rows_of(self.table.core.live_rows())
        return [self._view(r) for r in live[self.table.where[live] != 0].tolist()]

    def current(self, e: Entry) -> bool:
        """Whether the snapshot ``e`` is still of the page the manager holds (not removed since)."""
        r = self._row(e.key)
        return r >= 0 and bool(self.table.where[r]) and int(self.table.gen[r]) == e.gen

    def unsummed(self, keys: Sequence[PageKey]) -> np.ndarray:
        """For each key (a bool each): whether the manager holds the page without a checksum yet."""
        if not keys:
            return np.zeros(0, dtype=bool)
        t = self.table
        rows = rows_of(t.core.find(b"".join(keys)))
        safe = np.where(rows >= 0, rows, 0)
        return (rows >= 0) & (t.where[safe] != 0) & ~t.has_sum[safe]  # type: ignore[no-any-return]

    def locate(self, key: PageKey) -> PageLocation | None:
        e = self.entry(key)
        if e is None:
            return None
        slots = tuple(sorted(e.slots.items(), key=lambda kv: self.levels[kv[0]]))
        return PageLocation(e.key, slots[0][0], slots, e.nbytes, e.checksum, e.parent, e.pins)

    def tier(self, name: TierId) -> Tier:
        return self._by_id[name]

    def memory_bytes(self) -> tuple[int, dict[str, int | None]]:
        """Bytes the page table holds, and each tier's policy (None where it cannot tell)."""
        policies: dict[str, int | None] = {}
        for name, policy in self._policies.items():
            measure = getattr(policy, "memory_bytes", None)
            policies[name] = None if measure is None else measure()
        return self.table.memory_bytes, policies

    def used_slots(self, name: TierId) -> int:
        tier = self._by_id[name]
        return tier.num_slots - tier.num_free

    def below(self, name: TierId) -> Tier | None:
        """The next slower tier that is available (a degraded fabric tier is skipped), if any."""
        return next((t for t in self.tiers[self.levels[name] + 1:] if t.available), None)

    def unavailable_levels(self) -> frozenset[int]:
        """Levels of the tiers that serve no I/O now (degraded fabric tiers)."""
        return frozenset(i for i, t in enumerate(self.tiers) if not t.available)

    # -- reopening -------------------------------------------------------------------
    def adopt_persistent(self, name: TierId) -> int:
        """Load the index records of a persistent tier; their slots become used. Returns the count.

        A slot tier's records are read in one pass into arrays (its runs, replayed:
        :mod:`~tierkv.store.index_runs`; per-key records of an older format with
        :func:`~tierkv.store.index_scan.scan_records`) and enter the table in bulk; a block
        tier's claim their block runs one by one.

        Once every persistent tier is adopted, the pages whose parent no tier recorded (it
        lived in a volatile tier only when the last run ended: a crash, or a close without
        write-back) are dropped and their records deleted: no lookup could reach them.
        """
        self._adopting = True   # until the last tier: a page's parent may be in a tier not read yet
        got = self._adopt(name)
        self._adopted.add(name)
        if self._adopted >= {t.name for t in self.tiers if t.persistent}:
            self._adopting = False
            dropped = self._sweep()
            if dropped:
                log.info("%d pages recorded without their prefix (their parent was not recorded) were dropped",
                         dropped)
        return got

    def _adopt(self, name: TierId) -> int:
        assert self._index is not None
        tier = self._by_id[name]
        if tier.block_addressed:
            recs, slots, dropped = self._scan_blocks(tier)
            got = _arrays_of(recs, slots)
        else:
            got, dropped = self._scan_slots(tier)
        if dropped:
            log.warning("%s index: %d records fail validation (undecodable, out of range or sharing a slot); "
                        "dropped, those pages are misses", name, dropped)
        return self._install(tier, got)

    def _scan_blocks(self, tier: Tier) -> tuple[list[IndexRecord], list[int], int]:
        """A block tier's valid records and the slot handles their claimed block runs got."""
        assert self._index is not None
        blocks_per_slot = tier.slot_bytes // ALIGN
        handles: dict[PageKey, int] = {}

        def valid(rec: IndexRecord) -> bool:
            if rec.nbytes > tier.slot_bytes:
                return False
            # A record from a slot-addressed open is its slot's blocks, raw.
            extents = rec.extents or ((rec.slot * blocks_per_slot, blocks_per_slot),)
            try:
                handles[rec.key] = tier.claim_extents(extents)
            except InputError:
                return False
            return True

        if self._index.has_runs(tier.name):   # written as a slot tier: carried into per-key records
            live = replay(load_runs(self._index, tier.name)[0])
            self._index.runs_to_records(tier.name, live.keys, packed_blob(live))
        good, dropped = self._index.adopt(tier.name, valid)
        return good, [handles[r.key] for r in good], dropped

    def _scan_slots(self, tier: Tier) -> tuple[RecordArrays, int]:
        """A slot tier's valid records as arrays (slot column: the slot), claimed in the tier.

        Valid: the length fits a slot, the slot is in range and no record before it (in
        key order) names it. A record with block runs is usable only as one whole raw slot.
        A tier kept as runs is replayed (:mod:`~tierkv.store.index_runs`); per-key records
        of an older format count as older than every run and are carried into runs here.
        """
        assert self._index is not None
        if self._index.is_runs(tier.name):
            return self._scan_runs(tier)
        blocks_per_slot = tier.slot_bytes // ALIGN
        valid, claimed = _slot_validator(tier)
        taken: set[int] = set()

        def valid_one(rec: IndexRecord) -> bool:
            while claimed:
                taken.update(claimed.pop().tolist())
            slot = _as_slot(rec, blocks_per_slot)
            if rec.nbytes > tier.slot_bytes or slot is None or slot >= tier.num_slots or slot in taken:
                return False
            taken.add(slot)
            return True

        arrays, others, dropped = scan_records(self._index, tier.name, valid, valid_one)
        if others:
            more = _arrays_of(others, [_as_slot(r, blocks_per_slot) or 0 for r in others])
            arrays = arrays.concat(more)
        tier.claim(arrays.slot.tolist())
        return arrays, dropped

    def _scan_runs(self, tier: Tier) -> tuple[RecordArrays, int]:
        """:meth:`_scan_slots` of a tier kept as runs."""
        index, name = self._index, tier.name
        assert index is not None
        older: RecordArrays | None = None
        dropped = 0
        legacy = index.entries(name) > 0
        if legacy:  # an older format's per-key records: judged with the runs, then carried into them
            bps = tier.slot_bytes // ALIGN
            older, others, dropped = scan_records(index, name, lambda a: np.ones(len(a), dtype=bool), lambda r: True)
            usable = [r for r in others if _as_slot(r, bps) is not None]
            dropped += len(others) - len(usable)
            if usable:
                older = older.concat(_arrays_of(usable, [_as_slot(r, bps) or 0 for r in usable]))
        runs, damaged, lost = load_runs(index, name)   # damage logged there
        if damaged:   # the per-key records are older than the damaged run: dropped too
            dropped += lost + (len(older) if older is not None else 0)
            older = None
        live = replay(runs, older)
        keep = _slot_validator(tier)[0](live)
        got = live if keep.all() else live.take(keep)
        dropped += int((~keep).sum())
        if legacy:   # carried into runs, or the open fails (TierIOError): readers and compaction
            # take the runs for the whole index once there are any, so no per-key record may stay
            index.rewrite_runs(name, _LAST_RUN, got.keys, packed_blob(got), events=index.events(name),
                               drop_records=True)
        else:
            try:
                if damaged:   # one set of runs of what is live, the rest gone
                    index.rewrite_runs(name, _LAST_RUN, got.keys, packed_blob(got), events=index.events(name))
                elif not keep.all():
                    self._commit(name, delete=split_keys(take_keys(live.keys, ~keep)))
            except TierIOError as exc:   # the index as it is replays to the same pages at the next open
                log.warning("%s index: rewriting it at open failed (it replays to the same pages next time): %s",
                            name, exc)
        index.release_map()   # the runs were read once: their pages need not stay mapped here
        tier.claim(got.slot.tolist())
        return got, dropped

    def _install(self, tier: Tier, got: RecordArrays) -> int:
        """Enter adopted records (``slot``: the tier's slot handle) into the table and the policy."""
        name, lvl, t = tier.name, self.levels[tier.name], self.table
        if not len(got):
            return 0
        rows = rows_of(t.core.find(got.keys))
        safe = np.where(rows >= 0, rows, 0)
        held = (rows >= 0) & (t.where[safe] != 0)
        keep = np.ones(len(got), dtype=bool)
        for i in np.flatnonzero(held).tolist():
            # Recorded in an earlier persistent tier too: a crash between a demotion's commit
            # and its source's delete. Copies are inclusive: keep both, if they are one page.
            r, key, slot = int(rows[i]), PageKey(got.keys[i * KEY_BYTES:(i + 1) * KEY_BYTES]), int(got.slot[i])
            if t.has_sum[r] and int(t.checksum[r]) == int(got.checksum[i]) and int(t.nbytes[r]) == int(got.nbytes[i]):
                self._add_copy(r, lvl, slot)
                continue
            keep[i] = False  # the same key with other bytes: trust neither copy
            self.forget(key)
            tier.free([slot])
            assert self._index is not None
            self._index.commit(name, delete=[key])
        fresh = got.take(keep & ~held)
        self._add_pages(fresh.keys, fresh.parents, fresh.has_parent, fresh.nbytes, lvl, fresh.slot, fresh.checksum)
        got = got.take(keep) if not keep.all() else got
        rows = rows_of(t.core.find(got.keys))
        t.core.set_levels(rows.tobytes(), t.fastest(rows).tobytes())
        _insert_pages(self._policies[name], got.keys, got.parents, got.has_parent)
        return len(got)

    def _add_pages(self, keys: bytes, parents: bytes, has_parent: np.ndarray, nbytes: np.ndarray,
                   lvl: int, slots: Sequence[int] | np.ndarray, checksums: np.ndarray | None = None) -> np.ndarray:
        """Rows for pages no tier holds yet, each with one copy at ``lvl``; unpublished.

        ``keys`` and ``parents`` are blobs of 16-byte keys, ``parents`` meaningful where
        ``has_parent``.
        """
        t = self.table
        if not keys:
            return np.zeros(0, dtype=np.int32)
        rows, _ = t.ensure(keys)
        n = len(rows)
        prow = np.zeros(n, dtype=np.int32)
        # A chain (each page's parent the page before it: a prompt's pages, or one page)
        # looks up only its first page's parent; its parents are distinct, so each gains
        # one child.
        chain = bool(has_parent[1:].all()) and parents[KEY_BYTES:] == keys[:-KEY_BYTES]
        if chain:
            prow[1:] = rows[:-1] + 1
            if has_parent[0]:
                got, _ = t.ensure(parents[:KEY_BYTES])
                prow[0] = got[0] + 1
                chain = not bool((rows == got[0]).any())
        elif has_parent.any():
            if has_parent.all():
                got, _ = t.ensure(parents)
            else:
                got, _ = t.ensure(take_keys(parents, has_parent))
            prow[has_parent] = got + 1
        if t.where[rows].any():
            raise AssertionError("a page added to the table already has a copy")
        t.parent[rows] = prow
        t.nbytes[rows] = nbytes
        if checksums is not None:
            t.checksum[rows] = checksums
            t.has_sum[rows] = True
        t.slot[lvl, rows] = np.asarray(slots, dtype=np.int64) + 1
        t.where[rows] = 1 << lvl
        # A new incarnation of each page: a number no other row has had since (mod 2**32),
        # so a snapshot of the old one is stale even if the key comes back on another row.
        t.gen[rows] = (self._incarnations + 1 + np.arange(n, dtype=np.int64)) & 0xFFFFFFFF
        self._incarnations += n
        if chain:
            parents_of = prow[prow > 0] - 1
            if len(parents_of):
                t.kids.add_unique(lvl, parents_of, 1)
                t.nkids.add_unique(parents_of, 1)
        else:
            parents_of, counts = np.unique(prow[prow > 0] - 1, return_counts=True)   # np.add.at, 5x faster in bulk
            t.kids.add_unique(lvl, parents_of, counts.astype(t.kids.dtype))
            t.nkids.add_unique(parents_of, counts.astype(t.nkids.dtype))
        self._pages += n
        return rows

    # -- planning --------------------------------------------------------------------
    def plan_store(self, pages: Sequence[tuple[PageKey, PageKey | None]], nbytes: int,
                   prefix: Sequence[PageKey] = (), *, first_level: int = 0, plan: MovePlan | None = None) -> MovePlan:
        """Reserve slots for new pages, fastest tier first, evicting as the policies say.

        ``prefix`` are the prompt's pages already cached: they are not evicted to make
        room for the new pages that extend them (that would leave those orphaned).
        ``first_level``: the fastest tier the pages may go to (a lossy tier's
        conversions); ``plan``: one to extend instead of a new one.
        """
        return self.plan_new(NewPages.of(pages), nbytes, prefix, first_level=first_level, plan=plan)

    def plan_new(self, pages: NewPages, nbytes: int, prefix: Sequence[PageKey] = (), *, first_level: int = 0,
                 plan: MovePlan | None = None) -> MovePlan:
        """:meth:`plan_store` of pages given as columns. The plan's new batches index the
        pages by their position in ``pages`` (plus what the plan was asked before)."""
        n = len(pages)
        total = sum(t.num_slots for t in self.tiers[first_level:])
        if n > total:
            raise CapacityError(f"asked to store {n} pages; all tiers together hold {total}")
        if not 0 <= nbytes <= MAX_NBYTES:
            raise InputError(f"a page is 0 to {MAX_NBYTES} bytes long, got {nbytes}")
        plan = MovePlan() if plan is None else plan
        # What victims calls must not offer: built only where a tier has to make room.
        protect: set[PageKey] | None = None
        todo, at = pages, np.arange(plan.asked, plan.asked + n, dtype=np.int64)
        plan.asked += n
        for tier in self.tiers[first_level:]:
            if not len(todo):
                break
            if not tier.available:
                continue
            ok = _admit(self._policies[tier.name], todo)
            admitted, where = (todo, at) if ok is None else (todo.take(ok), at[ok])
            if protect is None and len(admitted) > tier.num_free:
                protect = set(pages.keys) | set(prefix)
            slots = self._reserve(tier, len(admitted), protect if protect is not None else set(), plan)
            k = len(slots)
            if not k:
                continue
            if k < len(admitted):
                head = np.arange(len(admitted)) < k
                admitted, where = admitted.take(head), where[:k]
            self._add_pages(admitted.blob, admitted.parents, admitted.has_parent, np.full(k, nbytes, dtype=np.int64),
                            self.levels[tier.name], slots)
            plan.placed.append(Placed(tier.name, admitted.keys, admitted.blob, slots, where))
            if k == len(todo):
                todo = NewPages([], b"", b"", np.zeros(0, dtype=bool))
            else:   # what is left: the pages whose key was not placed (a key named twice goes once)
                done = set(admitted.keys)
                left = np.fromiter((key not in done for key in todo.keys), dtype=bool, count=len(todo))
                todo, at = todo.take(left), at[left]
        plan.dropped += len(todo)
        return plan

    def plan_promote(self, keys: Sequence[PageKey], to: TierId, protect: set[PageKey]) -> MovePlan:
        """Reserve slots in ``to`` for pages that live only below it (inclusive copy-up)."""
        plan = MovePlan()
        tier = self._by_id[to]
        level = self.levels[to]
        t = self.table
        rows = rows_of(t.core.find(b"".join(keys))) if keys else np.zeros(0, dtype=np.int32)
        ok = (rows >= 0)
        where = t.where[np.where(ok, rows, 0)]
        ok &= (where != 0) & (LOWEST_LEVEL[where] > level)   # also: no copy at ``to`` yet
        want = [k for k, good in zip(keys, ok.tolist()) if good]
        slots = self._reserve(tier, len(want), protect | set(want), plan)
        for key, slot in zip(want, slots):
            self._add_copy(self._row(key), level, slot)
        if slots:
            batch = Placed.of(to, want[:len(slots)], slots)
            batch.index += plan.asked
            plan.placed.append(batch)
        plan.asked += len(want)
        return plan

    def plan_writeback(self) -> MovePlan:
        """Copy pages that live only in volatile tiers down to the first persistent tier.

        Used at a clean close so a restart finds them. Parents come before their
        children, since a page is useless without its prefix; older persistent pages
        are evicted as that tier's policy says, as if each were a page's last copy (the
        volatile tiers go away). Persistent copies of pages whose parent will not be
        persisted are dropped, their deletes in the plan: the next open finds only
        pages it can reach.
        """
        plan = MovePlan()
        target = next((t for t in self.tiers if t.persistent and t.available), None)
        if target is None:
            return plan
        # No request is being served: the last one's pages, which prefix-aware policies
        # never evict, must not keep older persistent pages from making room.
        self.note_request(())
        t = self.table
        durable = sum(1 << i for i, tier in enumerate(self.tiers) if tier.persistent)
        live = rows_of(t.core.live_rows())
        where = t.where[live]
        rows = live[(where != 0) & (where & durable == 0)]
        rows = rows[np.argsort(t.depths()[rows], kind="stable")]   # parents first
        keys = t.keys(rows)
        slots = self._reserve(target, len(rows), set(keys), plan, final=True)
        rows, keys = rows[:len(slots)], keys[:len(slots)]
        # What the persistent tiers will hold is all the next open gets: a page there whose
        # parent is not (left behind for want of room, or evicted above) could never be
        # reached, so it is neither written nor kept.
        has = (t.where & durable) != 0
        has[rows] = True
        dead = self._stranded(has)
        if len(dead):
            write = ~np.isin(rows, dead)
            target.free([slot for slot, yes in zip(slots, write.tolist()) if not yes])
            slots = [slot for slot, yes in zip(slots, write.tolist()) if yes]
            keys = [key for key, yes in zip(keys, write.tolist()) if yes]
            rows = rows[write]
            self._discard(dead[(t.where[dead] & durable) != 0], durable, plan)
        lvl = self.levels[target.name]
        runs: dict[int, Moves] = {}   # by source level, each in the order above (parents first)
        for r, key, slot in zip(rows.tolist(), keys, slots):
            src = _lowest(int(t.where[r]))
            run = runs.get(src)
            if run is None:
                run = runs[src] = Moves(self._names[src], target.name, [], [], [])
            run.keys.append(PageKey(key))
            run.src_slots.append(int(t.slot[src, r]) - 1)
            run.dst_slots.append(slot)
            self._add_copy(r, lvl, slot)
        plan.moves.extend(runs.values())
        return plan

    def _reserve(self, tier: Tier, n: int, protect: set[PageKey], plan: MovePlan, final: bool = False) -> list[int]:
        """``n`` slots of ``tier`` (fewer if it cannot make room), evicting as its policy says.

        ``final``: every copy evicted is taken as its page's last one (at a close, when the
        volatile tiers go away), so a page with cached children keeps it.
        """
        need = n - tier.num_free
        if need > 0 and not tier.persistent and self.below(tier.name) is not None:
            # Demote in batches: one flush and one index commit then cover many pages.
            need = max(need, min(self.demotion_batch, tier.num_slots // 16))
        policy = self._policies[tier.name]
        evictable = self._evictable(tier, protect, plan, final)
        # A compressed page frees less than the raw page reserved in its place, so a
        # block tier may need more victims than pages asked for: evict until they fit.
        while need > 0:
            victims = policy.victims(need, evictable)
            self._evict_all(victims, tier, protect, plan)
            need = n - tier.num_free
            if not victims:
                break
        return tier.allocate(min(n, tier.num_free))

    def _evictable(self, tier: Tier, protect: set[PageKey], plan: MovePlan, final: bool) -> Callable[[PageKey], bool]:
        """Which pages of ``tier`` a victims call for ``plan`` may offer."""
        # A page whose last copy is here leaves the store when evicted from the last tier
        # (there is no tier below to take it); at a close (``final``) also one whose other
        # copies are all volatile. A cached child elsewhere (a faster tier, say) keeps it,
        # as does any at a close. Its children here go first with a leaf-first policy
        # (gittins, lru-leaf); with any other (lru, s3fifo) they are dropped after it, once
        # the plan is done (commit_deletes), since no lookup could reach them. In a tier
        # with one below, ``_demote_run`` (or ``_evict``) keeps such a page if it cannot go down.
        last = self.below(tier.name) is None
        t = self.table
        row = t.core.row
        lvl = self.levels[tier.name]
        parents, kept = plan.parents_below.get(tier.name, ()), plan.kept
        mine = ~(1 << lvl)
        keeps = sum(1 << i for i, other in enumerate(self.tiers) if other.persistent) if final else 0xFF
        alone = len(t.kids.cols) == 1   # one level: a child can only be here (only_at is true)

        def evictable(k: PageKey) -> bool:
            # Called once per candidate a victims call considers: the cheap tests first, and
            # the tier's columns read only for a page with children.
            if k in protect or k in parents or k in kept:
                return False
            r = row(k)
            if t.pins and r in t.pins:
                return False
            # (the children count's byte is nonzero exactly where the count is)
            if t.nkids.bytes[r]:
                others = int(t.where[r]) & mine
                if not others & keeps if others else last:  # it would leave the store
                    return not final and (alone or t.kids.only_at(lvl, r))
            return True

        return evictable

    def _emit(self, event: str, name: TierId, keys: list[PageKey], slots: list[int]) -> None:
        for listener in self.listeners:
            listener(event, name, keys, slots)

    def _evict_all(self, victims: list[PageKey], tier: Tier, protect: set[PageKey], plan: MovePlan) -> None:
        """Evict ``victims`` from ``tier`` in order: runs of victims that need no demotion (a
        copy stays elsewhere, or there is no tier below) in one vectorized pass each, runs
        of last copies with one reservation below each (:meth:`_demote_run`: it may evict
        there first)."""
        if not victims:
            return
        t, lvl = self.table, self.levels[tier.name]
        rows = rows_of(t.core.find(b"".join(victims)))
        if (rows < 0).any():
            raise AssertionError(f"the {tier.name} policy offered a page the manager does not hold")
        if self.below(tier.name) is None:
            self._evict_run(victims, rows, tier, plan)
            return
        # Runs of last copies are demoted a run at a time (one reservation below); a
        # demotion may evict a later victim's copy below, so whether a victim is a last
        # copy is asked when its run's turn comes.
        i, n, alone, where = 0, len(victims), 1 << lvl, t.where
        while i < n:
            j = i
            if where[rows[i]] == alone:
                while j < n and where[rows[j]] == alone:
                    j += 1
                self._demote_run(victims[i:j], rows[i:j], tier, protect, plan)
            else:
                while j < n and where[rows[j]] != alone:
                    j += 1
                self._evict_run(victims[i:j], rows[i:j], tier, plan)
            i = j

    def _evict_run(self, keys: list[PageKey], rows: np.ndarray, tier: Tier, plan: MovePlan) -> None:
        """Evict pages from ``tier`` that either keep a copy elsewhere or are dropped."""
        t, lvl, name = self.table, self.levels[tier.name], tier.name
        bit = np.uint8(1 << lvl)
        slots = (t.slot[lvl, rows].astype(np.int64) - 1).tolist()
        if self.listeners:
            self._emit("removed", name, list(keys), slots)
        t.slot[lvl, rows] = 0
        self.removed += len(rows)
        where = t.where[rows] & ~bit
        t.where[rows] = where
        prow = t.parent[rows].astype(np.int64) - 1
        linked = prow >= 0
        t.kids.add_at(lvl, prow[linked], -1)
        gone = where == 0
        t.nkids.add_at(prow[linked & gone], -1)
        _remove_pages(self._policies[name], keys)
        plan.evicted += len(keys)
        if tier.persistent:
            plan.deletes.setdefault(name, []).extend(keys)
        if gone.any():
            dead = rows[gone]
            if t.nkids[dead].any():
                self._stray = True   # their cached descendants go when the plan is done
            self._pages -= len(dead)
            t.core.set_levels(dead.tobytes(), NO_LEVEL)
            t.parent[dead] = 0
            t.unpin(dead)
            t.has_sum[dead] = False
            plan.dropped += len(dead)
            parents = prow[linked & gone]
            free = np.concatenate([dead[t.nkids[dead] == 0], parents[(t.where[parents] == 0) & (t.nkids[parents] == 0)]])
            if len(free):
                free = np.unique(free).astype(np.int32)
                t.nbytes.forget(free)     # an odd length's entry goes; the common one is set on reuse
                t.core.release(free.tobytes())
        kept = rows[~gone]
        if len(kept):
            levels = np.frombuffer(t.core.levels(kept.tobytes()), dtype=np.uint8)
            live = kept[levels != NO_LEVEL]
            if len(live):
                t.core.set_levels(live.tobytes(), t.fastest(live).tobytes())
        tier.free(slots)

    def _demote_run(self, keys: list[PageKey], rows: np.ndarray, tier: Tier, protect: set[PageKey],
                    plan: MovePlan) -> None:
        """Evict pages whose last copy is in ``tier``: each moves to the next tier down
        where its policy admits it and room is made there (one reservation for the run),
        else is dropped, or stays where dropping it would strand cached descendants."""
        lower = self.below(tier.name)
        policy = self._policies[lower.name] if lower is not None else None
        if lower is None or len(keys) == 1 or getattr(policy, "admits_alone", False):
            for key in keys:
                self._evict(key, tier, protect, plan)
            return
        t, lvl, low = self.table, self.levels[tier.name], self.levels[lower.name]
        prow = t.parent[rows].astype(np.int64) - 1
        linked = prow >= 0
        parents = t.keys(prow[linked]) if linked.any() else []
        parent_of: list[PageKey | None] = [None] * len(keys)
        for i, pk in zip(np.flatnonzero(linked).tolist(), parents):
            parent_of[i] = pk
        assert policy is not None
        said = _admit(policy, NewPages.of(list(zip(keys, parent_of))))
        ok = np.ones(len(keys), dtype=bool) if said is None else said
        slots: list[int] = []
        if ok.any():
            below = plan.parents_below.setdefault(lower.name, set())   # see MovePlan.parents_below
            below.update(p for p, good in zip(parent_of, ok.tolist()) if good and p is not None)
            slots = self._reserve(lower, int(ok.sum()), protect | set(keys), plan)
        down = np.flatnonzero(ok)[:len(slots)]
        moved = np.zeros(len(keys), dtype=bool)
        moved[down] = True
        # Refused or without room: dropped, in order, but kept where cached descendants
        # depend on it (a child dropped earlier in the run no longer counts).
        keep = np.zeros(len(keys), dtype=bool)
        nkids, dropped_kids = t.nkids, dict[int, int]()
        for i in np.flatnonzero(~moved).tolist():
            r = int(rows[i])
            if nkids[r] > dropped_kids.get(r, 0):
                keep[i] = True
                plan.kept.add(keys[i])
            elif prow[i] >= 0:
                p = int(prow[i])
                dropped_kids[p] = dropped_kids.get(p, 0) + 1
        if len(down):   # the copies below first, so no row looks empty
            drows = rows[down]
            src = (t.slot[lvl, drows].astype(np.int64) - 1).tolist()
            t.slot[low, drows] = np.asarray(slots, dtype=np.int64) + 1
            t.where[drows] |= np.uint8(1 << low)
            up = prow[down]
            up = up[up >= 0]
            if len(up):
                parents_of, counts = np.unique(up, return_counts=True)
                t.kids.add_unique(low, parents_of, counts.astype(t.kids.dtype))
            going = keys if len(down) == len(keys) else [keys[i] for i in down.tolist()]
            plan.moves.append(Moves(tier.name, lower.name, going, src, list(slots)))
        go = ~keep
        if go.all():
            self._evict_run(keys, rows, tier, plan)
        elif go.any():
            self._evict_run([k for k, g in zip(keys, go.tolist()) if g], rows[go], tier, plan)

    def _evict(self, key: PageKey, tier: Tier, protect: set[PageKey], plan: MovePlan) -> None:
        t = self.table
        r = self._row(key)
        lvl = self.levels[tier.name]
        lower: Tier | None = None
        dst: list[int] = []
        if int(t.where[r]) == 1 << lvl:  # its last copy: demoted to the next tier down, or dropped
            lower = self.below(tier.name)
            parent = self._parent_key(r)
            if lower is not None and self._policies[lower.name].admit(key, parent):
                if parent is not None:  # see MovePlan.parents_below
                    plan.parents_below.setdefault(lower.name, set()).add(parent)
                dst = self._reserve(lower, 1, protect | {key}, plan)
            if not dst and lower is not None and t.nkids[r]:
                # Dropping it would strand its cached descendants (they went down before
                # it, leaves first, or live below): it stays where it is for this plan.
                plan.kept.add(key)
                return
        if dst:  # the copy below first, so the row never looks empty
            assert lower is not None
            self._add_copy(r, self.levels[lower.name], dst[0])
        slot, gone = self._drop_copy(r, lvl)
        if self.listeners:
            self._emit("removed", tier.name, [key], [slot])
        self._policies[tier.name].remove(key)
        plan.evicted += 1
        if tier.persistent:
            plan.deletes.setdefault(tier.name, []).append(key)
        if dst:
            assert lower is not None
            plan.moves.append(Moves(tier.name, lower.name, [key], [slot], [dst[0]]))
            self._republish(r)
        elif gone:
            plan.dropped += 1
            self._stray = self._stray or bool(t.nkids[r])
        else:
            self._republish(r)
        tier.free([slot])

    # -- completion --------------------------------------------------------------------
    def _commit(self, name: TierId, put: Sequence[IndexRecord] | PackedRecords = (),
                delete: Sequence[PageKey] = ()) -> None:
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
        if (self._index.is_runs(name) and not self._adopting and name not in self._no_compaction
                and self._index.appended(name) >= COMPACT_CHUNK // 4):
            try:
                self._compact(self._by_id[name])
            except Exception:   # noqa: BLE001 - the commit above is done: nothing may undo it now
                log.exception("compacting the %s index failed; its compaction is off until the store reopens "
                              "(the index is checked then)", name)
                self._no_compaction.add(name)

    def _over(self, tier: Tier) -> bool:
        """Whether ``tier``'s runs hold more than twice its pages and COMPACT_MIN entries."""
        assert self._index is not None
        return self._index.events(tier.name) > 2 * (tier.num_slots - tier.num_free) + COMPACT_MIN

    def _compact(self, tier: Tier) -> None:
        """While ``tier``'s runs hold too much garbage, rewrite the oldest ones, about
        COMPACT_CHUNK entries at a time, as runs of the records in them that the table still
        holds (same slot, same checksum): see :mod:`tierkv.store.index_runs`. Asked once per
        COMPACT_CHUNK / 4 entries appended; the entries are recounted from the runs' headers
        first (only their first bytes are read), and it stops at the run that was newest
        when it started (one pass: the oldest runs may be live and the garbage newer), so
        that its cost per entry appended stays bounded. Every buffered commit is made
        durable first, so the table holds nothing the index has not committed but in-flight
        writes, whose records are in no old run. A failure is logged; the runs stay as they
        were (replayed to the same pages)."""
        index = self._index
        assert index is not None
        if not self._over(tier):
            return
        index.appended(tier.name, reset=True)   # asked again after as many entries, whatever comes of it
        if not index.drain(tier.name):
            return  # a window waits to be retried: the table may hold what the index does not yet
        try:
            index.count_events(tier.name)
            newest = index.newest_run(tier.name)
            while self._over(tier):
                last = self._compact_chunk(tier)
                if not last or last >= newest:
                    return
        except TierIOError as exc:   # resources, a full reader table: tried again later
            log.warning("compacting the %s index is put off: %s", tier.name, exc)

    def _compact_chunk(self, tier: Tier) -> bytes:
        """One step of :meth:`_compact`; returns the key of the last run it read (b"":
        nothing done). A run that fails its seal is dropped with the others, its records
        left out (the table says what is live); the entries are then recounted."""
        index, name, t, lvl = self._index, tier.name, self.table, self.levels[tier.name]
        assert index is not None
        raw = index.read_runs(name, limit=COMPACT_CHUNK)
        if not raw:
            return b""
        runs = [run for key, value in raw if (run := unpack_run(key, value)) is not None]
        keys = b"".join(r.keys for r in runs)
        recs = np.concatenate([r.records for r in runs]) if runs else np.zeros(0, dtype=RECORD_DTYPE)
        rows = rows_of(t.core.find(keys))
        r = np.where(rows >= 0, rows, 0)
        live = ((rows >= 0) & ((t.where[r] >> lvl) & 1 == 1) & (t.slot[lvl, r].astype(np.uint64) == recs["slot"] + 1)
                & t.has_sum[r] & (t.checksum[r] == recs["checksum"]) & (t.nbytes[r] == recs["nbytes"]))
        index.rewrite_runs(name, raw[-1][0], take_keys(keys, live), recs[live].tobytes(),
                           events=sum(r.events for r in runs))
        if len(runs) < len(raw):   # a damaged run's header cannot be trusted to count it
            index.count_events(name)
        self.compactions += 1
        return raw[-1][0]

    def commit_deletes(self, plan: MovePlan) -> None:
        """Durably forget evicted persistent records that no publish has carried yet.

        A failed transaction is logged and its deletes wait for the tier's next commit:
        until then a record may name a slot that holds newer bytes, which fail its
        checksum after a restart (a miss, never wrong data).
        """
        if self._stray:   # the plan is done: what it stranded can go
            self._sweep(plan)
        if self._index is None:
            return
        for name, keys in plan.deletes.items():
            try:
                self._commit(name, delete=keys)
            except TierIOError as exc:
                log.warning("deleting %d evicted %s records from the index failed; retried with the "
                            "next commit: %s", len(keys), name, exc)
        plan.deletes.clear()

    def publish(self, placed: Placed | Sequence[tuple[PageKey, TierId, int]], checksums: dict[PageKey, int] | Sums,
                plan: MovePlan | None = None) -> None:
        """Make written pages visible; persistent ones are committed to the index first.

        ``placed``: a batch, or (key, tier, slot) of each page. The plan's pending deletes
        for the same tier ride in the same transaction: one durable commit per batch. A
        crash before it leaves the evicted records pointing at slots that may hold newer
        bytes; their checksums then fail and the pages are misses, never wrong data. A
        failed commit raises TierIOError with nothing made visible; the caller then
        abandons ``placed``.
        """
        batches = [b for b in as_placed(placed) if len(b)]
        if isinstance(checksums, Sums) and not (isinstance(placed, Placed) and len(checksums.need) == len(placed)):
            raise ValueError(f"checksums by position ({len(checksums.need)}) need one batch of as many pages")
        # Every batch is committed before any page is made visible (inserted into its
        # policy, given a level): abandon, which a failed commit calls for, takes back
        # reservations, not published pages.
        ready = [self._commit_placed(b, checksums, plan) for b in batches]
        t = self.table
        for batch, (rows, parents, has_parent) in zip(batches, ready):
            _insert_pages(self._policies[batch.tier], batch.blob, parents, has_parent)
            t.core.set_levels(rows.tobytes(), t.fastest(rows).tobytes())
            if self.listeners:
                self._emit("placed", batch.tier, list(batch.keys), list(batch.slots))

    def _commit_placed(self, placed: Placed, checksums: dict[PageKey, int] | Sums, plan: MovePlan | None
                       ) -> tuple[np.ndarray, bytes, np.ndarray]:
        """The index commit of one batch of :meth:`publish` (persistent tiers), its
        checksums recorded first; returns its rows, parents' keys and which have one."""
        t = self.table
        name, keys, blob = placed.tier, placed.keys, placed.blob
        rows = rows_of(t.core.find(blob))
        if (rows < 0).any():  # a negative row would index the columns from the end
            raise AssertionError("publish of a page the manager does not hold")
        if isinstance(checksums, Sums):
            if checksums.need.any():
                t.checksum[rows[checksums.need]] = checksums.values[checksums.need]
                t.has_sum[rows[checksums.need]] = True
        elif checksums:
            sums = [(i, checksums[k]) for i, k in enumerate(keys) if k in checksums]
            idx = [i for i, _ in sums]
            t.checksum[rows[idx]] = np.array([v for _, v in sums], dtype=np.uint64)
            t.has_sum[rows[idx]] = True
        prow = t.parent[rows].astype(np.int64) - 1
        has_parent = prow >= 0
        # The parents' keys, back to back (a page's own key stands in where it has none).
        parents = t.core.keys(np.where(has_parent, prow, rows).astype(np.int32).tobytes())
        tier = self._by_id[name]
        if tier.persistent:
            if not t.has_sum[rows].all():
                raise InputError(f"page bound for the {name} tier has no checksum")
            recs: list[IndexRecord] | PackedRecords
            if tier.block_addressed:
                recs = self._block_records(placed, tier, rows, parents, has_parent)
            else:   # fixed-size records, packed and sealed in one pass
                arrays = RecordArrays(blob, np.asarray(placed.slots, dtype=np.uint64), t.nbytes[rows],
                                      t.checksum[rows], parents, has_parent)
                recs = PackedRecords(list(keys), packed_values(arrays))
            if self._index is not None:
                deletes = plan.deletes.pop(name, []) if plan is not None else []
                self._commit(name, put=recs, delete=deletes)
        return rows, parents, has_parent

    def _block_records(self, placed: Placed, tier: Tier, rows: np.ndarray, parents: bytes,
                       has_parent: np.ndarray) -> list[IndexRecord]:
        """The index records of a batch on a block-addressed tier, with their block runs."""
        t = self.table
        nbytes, sums = t.nbytes[rows].tolist(), t.checksum[rows].tolist()
        recs: list[IndexRecord] = []
        for i, (key, slot, has) in enumerate(zip(placed.keys, placed.slots, has_parent.tolist())):
            extents = tier.extents(slot) or ()
            # Block records name the slot of their first block: a reader that addresses
            # the file in slots finds a raw page there, or bytes that fail the checksum.
            first = extents[0][0] * ALIGN // tier.slot_bytes if extents else slot
            parent = PageKey(parents[i * KEY_BYTES:(i + 1) * KEY_BYTES]) if has else None
            recs.append(IndexRecord(key, first, nbytes[i], sums[i], parent, extents))
        return recs

    def abandon(self, placed: Placed | Sequence[tuple[PageKey, TierId, int]]) -> None:
        """Roll back reservations whose writes failed: the slots are freed, the pages become misses."""
        t = self.table
        for key, name, slot in (placed.tuples() if isinstance(placed, Placed) else placed):
            if self.listeners:
                self._emit("removed", name, [key], [slot])
            self._by_id[name].free([slot])
            r = self._row(key)
            lvl = self.levels[name]
            if r < 0 or int(t.slot[lvl, r]) - 1 != slot:
                continue
            _, gone = self._drop_copy(r, lvl)
            if not gone:
                self._republish(r)
            elif t.nkids[r]:
                self._stray = True   # its cached descendants may be in flight: dropped at commit_deletes

    def still_placed(self, placed: Placed | Sequence[tuple[PageKey, TierId, int]]) -> np.ndarray:
        """Whether each reserved placement still holds its slot (nothing dropped the page
        or its copy there since it was planned), as a boolean array."""
        t = self.table
        out = []
        for batch in as_placed(placed):
            rows = rows_of(t.core.find(batch.blob)).astype(np.int64)
            held = t.slot[self.levels[batch.tier], np.maximum(rows, 0)].astype(np.int64) - 1
            out.append((rows >= 0) & (held == np.asarray(batch.slots, dtype=np.int64)))
        if len(out) == 1:
            return out[0]
        return np.concatenate(out) if out else np.zeros(0, dtype=bool)

    def drop_orphans(self, keys: Sequence[PageKey], blob: bytes | None = None) -> int:
        """Forget those of ``keys`` whose parent no tier holds any more (it left while their
        bytes were being written without the store's lock), with their descendants;
        returns how many of ``keys`` were. ``blob``: the same keys back to back, if at hand."""
        if not keys:
            return 0
        t = self.table
        rows = rows_of(t.core.find(b"".join(keys) if blob is None else blob))
        ok = rows >= 0
        prow = np.full(len(rows), -1, dtype=np.int64)
        prow[ok] = t.parent[rows[ok]].astype(np.int64) - 1
        lost = np.flatnonzero((prow >= 0) & (t.where[np.maximum(prow, 0)] == 0))
        for i in lost.tolist():
            self.forget(keys[i])
        return len(lost)

    def present(self, keys: bytes, name: TierId) -> bytes:
        """The keys of ``keys`` (16 bytes each) that have a copy in tier ``name``, in order."""
        if not keys:
            return b""
        t = self.table
        rows = rows_of(t.core.find(keys))
        ok = rows >= 0
        lvl = self.levels[name]
        ok[ok] = (t.where[rows[ok]] >> lvl) & 1 == 1
        return keys if ok.all() else take_keys(keys, ok)

    def copy_at(self, key: PageKey, first_level: int) -> tuple[int, int, int, int] | None:
        """(level, slot, incarnation, checksum) of ``key``'s fastest copy at ``first_level``
        or below; None where it has none there."""
        r = self._row(key)
        if r < 0:
            return None
        t = self.table
        w = int(t.where[r]) >> first_level << first_level
        if not w:
            return None
        lvl = _lowest(w)
        return lvl, int(t.slot[lvl, r]) - 1, int(t.gen[r]), int(t.checksum[r])

    def blocking_children(self, key: PageKey, level: int) -> int | None:
        """What keeps ``key``'s copy at ``level`` from being dropped: None where nothing may
        (a pinned page, or one not held), else how many cached children it would strand
        (0 where another copy stays, or it has none)."""
        r = self._row(key)
        t = self.table
        if r < 0 or r in t.pins or not int(t.where[r]) >> level & 1:
            return None
        return 0 if int(t.where[r]) != 1 << level else int(t.nkids[r])

    def parent_of(self, key: PageKey) -> PageKey | None:
        """The key of ``key``'s parent (None: a root, or not held)."""
        r = self._row(key)
        return self._parent_key(r) if r >= 0 else None

    def drop_copy(self, key: PageKey, level: int, plan: MovePlan) -> None:
        """Drop ``key``'s copy at ``level`` (held: :meth:`copy_at`) as an eviction without
        a demotion; a persistent tier's delete rides in ``plan``."""
        r = self._row(key)
        self._evict_run([key], np.array([r], dtype=np.int32), self.tiers[level], plan)

    def forget(self, key: PageKey) -> None:
        """Drop a page from every tier (quarantine or failed read); frees its slots.

        Its cached descendants go with it (no lookup could reach them), except pinned
        ones and while records are being adopted. The page is gone from memory even if deleting its index
        record fails (logged; the delete rides in the tier's next commit, and the record
        fails its checksum after a restart if its slot was reused). Not while a plan is in
        flight (its reserved pages could be among the descendants).
        """
        r = self._row(key)
        if r < 0 or not self.table.where[r]:
            return
        stranding = bool(self.table.nkids[r]) and not self._adopting
        self._forget(key, r)
        if stranding:
            self._sweep()

    def _forget(self, key: PageKey, r: int) -> None:
        w = int(self.table.where[r])
        copies = []
        for lvl in range(len(self._names)):
            if w >> lvl & 1:
                slot, _ = self._drop_copy(r, lvl)
                copies.append((self._names[lvl], slot))
        for name, slot in copies:
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

    def touch_many(self, keys: bytes, name: TierId) -> None:
        """:meth:`touch` of each 16-byte key of ``keys`` in order: one ``touch_many`` call
        where the tier's policy has it (optional)."""
        policy = self._policies[name]
        touch_many = getattr(policy, "touch_many", None)
        if touch_many is not None:
            touch_many(keys)
            return
        for j in range(0, len(keys), KEY_BYTES):
            policy.touch(PageKey(keys[j:j + KEY_BYTES]))

    def pin(self, key: PageKey, delta: int) -> None:
        r = self._row(key)
        if r < 0 or not self.table.where[r]:
            raise InputError(f"pin of page {key.hex()}, which no tier holds")
        pins = self.table.pins
        now = pins.get(r, 0) + delta
        if now < 0:
            raise InputError("unpin of a page that is not pinned")
        if now:
            pins[r] = now
        else:
            pins.pop(r, None)

    def check(self) -> None:
        """Recount the table's derived columns from scratch; AssertionError on any mismatch.

        For tests and ``tierkv doctor``-style checks: O(rows) numpy work.
        """
        t = self.table
        live = rows_of(t.core.live_rows())
        where = t.where[live]
        assert int((where != 0).sum()) == self._pages, "page count"
        kids = np.zeros((len(self._names), len(t.nkids)), dtype=t.kids.dtype)
        nkids = np.zeros(len(t.nkids), dtype=np.int32)
        pr = t.parent[live].astype(np.int64) - 1
        linked = pr >= 0
        np.add.at(nkids, pr[linked], 1)
        for lvl in range(len(self._names)):
            has = linked & (where >> lvl & 1 == 1)
            np.add.at(kids[lvl], pr[has], 1)
            held = t.slot[lvl, live] != 0
            assert np.array_equal(held, where >> lvl & 1 == 1), f"slots vs tier mask at level {lvl}"
        assert np.array_equal(kids, t.kids.dense()) and np.array_equal(nkids, t.nkids.dense()), "cached-children counts"
        for col in [t.nkids, *t.kids.cols]:
            if isinstance(col, CountColumn):
                col.check()
        assert bool(((where != 0) | (t.nkids[live] > 0)).all()), "a row with no copy and no child is not freed"
        assert not (linked & (where == 0)).any(), "a placeholder row names a parent"
        pinned = np.fromiter(t.pins, dtype=np.int64, count=len(t.pins))
        assert all(n > 0 for n in t.pins.values()), "a pin count below one is kept"
        assert bool(np.isin(pinned, live[where != 0]).all()), "a pin on a row no tier holds"
        levels = np.frombuffer(t.core.levels(live.tobytes()), dtype=np.uint8)
        published = levels != NO_LEVEL
        assert np.array_equal(levels[published], t.fastest(live)[published]), "published level vs fastest copy"
        assert len(t.core) == int(published.sum())
