"""The serving side of a peer: a DRAM tier's slots, their metas, and a key index.

:class:`SlotStore` wraps a :class:`~tierkv.tiers.dram.DramTier` of this node and is what
both transports' servers call: it answers page reads by slot, applies page writes
idempotently (keyed by slot and generation), keeps one :class:`~tierkv.net.wire.PageMeta`
record per slot in a packed table (24 bytes a slot, in memory the RDMA server registers
so a peer can also read a meta one-sided), and holds a small key -> slot index so a
peer can ask "which of these keys do you hold" (the ``lookup`` call).

A store serving its own pages (``keyed``) answers a read only where it names, per slot,
the key that slot holds: a slot number alone never returns bytes. Each published page
carries the tag of the tenant whose request placed it (:func:`tierkv.net.auth.tenant_tag`;
0 when not known); a connection scoped to one tenant is answered only for that tenant's
pages, by lookup and by read alike. The RDMA connect call, which hands out one-sided
access to every slot, is for the cluster's principal only.

Thread-safety: every method may be called from any thread. Writers of one slot are
serialized (a striped lock held from the generation check to the new meta), so racing
writers leave the newest generation's bytes; page bytes are copied outside the meta
lock, so a reader racing a writer may see torn bytes, which fail their checksum at the
reader (a miss), never wrong data.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from tierkv.errors import TierKVError
from tierkv.net.auth import UNKNOWN_TENANT, Scope
from tierkv.net.wire import (EMPTY_GENERATION, Call, PageMeta, Pages, ProtocolError, Reply, WriteAck, WriteStatus,
                             decode_keys, encode_metas, page_checksum)
from tierkv.tiers.dram import DramTier

META_DTYPE = np.dtype([("slot", "<u4"), ("generation", "<u8"), ("length", "<u4"), ("checksum", "<u8")])
assert META_DTYPE.itemsize == 24
Method = Callable[[bytes, Scope], bytes]
#: Calls a connection scoped to one tenant may not make (they reach every slot, or read
#: for another node: DualPath's push).
CLUSTER_ONLY = frozenset({"rdma-connect", "push"})
#: Calls that wait on other nodes (DualPath's push): served over TCP only, never on the
#: RDMA server's progress thread, which every QP of the node waits on.
TCP_ONLY = frozenset({"push"})


class SlotStore:
    """Pages of ``tier`` addressed by slot, with metas and a key index."""

    def __init__(self, tier: DramTier, accept_writes: bool = True, keyed: bool = False) -> None:
        self.tier = tier
        self.keyed = keyed
        # A store serving its own DRAM tier to peers owns every slot: remote writes are refused.
        self.accept_writes = accept_writes
        self.num_slots = tier.num_slots
        self.slot_bytes = tier.slot_bytes
        self.epoch = (time.time_ns() ^ (os.getpid() << 40)) & ((1 << 64) - 1) or 1
        self.metas = np.zeros(self.num_slots, dtype=META_DTYPE)
        self.metas["slot"] = np.arange(self.num_slots, dtype=np.uint32)
        self.tags = np.zeros(self.num_slots, dtype=np.uint64)  # the tenant of each slot's page
        self._lock = threading.Lock()
        self._slot_locks = [threading.Lock() for _ in range(64)]  # striped by slot
        self._index: dict[bytes, int] = {}
        self.methods: dict[str, Method] = {"lookup": self._lookup}

    # -- node-local API -------------------------------------------------------------------
    def meta(self, slot: int) -> PageMeta:
        """The slot's page; an empty one (never written, withdrawn, or mid-write) has no bytes."""
        with self._lock:
            return self._meta_held(slot)

    def _meta_held(self, slot: int) -> PageMeta:
        """:meth:`meta` for a caller holding ``self._lock``."""
        r = self.metas[slot]
        gen = int(r["generation"])
        if gen == EMPTY_GENERATION:  # unseal and put leave the old length behind
            return PageMeta(slot, EMPTY_GENERATION, 0, 0)
        return PageMeta(slot, gen, int(r["length"]), int(r["checksum"]))

    def publish(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Announce that ``keys[i]`` lives in ``slots[i]`` (already written)."""
        with self._lock:
            self._index.update(zip(keys, slots))

    def forget(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._index.pop(k, None)

    def seal(self, keys: Sequence[bytes], slots: Sequence[int], generation: int, length: int,
             tags: Sequence[int] | None = None) -> None:
        """Publish pages the owning node has already written into ``slots`` (its own
        transfers, not :meth:`put`): their metas are computed from the bytes there.
        ``tags[i]``: the tenant tag of page ``i`` (default: not known, cluster-only)."""
        for i, (k, s) in enumerate(zip(keys, slots)):
            actual = page_checksum(self.tier.buffer[s, :length].data)
            with self._lock:
                r = self.metas[s]
                r["generation"], r["length"], r["checksum"] = generation, length, actual
                self.tags[s] = UNKNOWN_TENANT if tags is None else tags[i]
                self._index[k] = s

    def unseal(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """The owning node is about to reuse ``slots``: their keys and metas are withdrawn,
        so a peer's read racing the reuse fails its check (a miss) instead of matching."""
        with self._lock:
            for k, s in zip(keys, slots):
                if self._index.get(k) == s:
                    del self._index[k]
                self.metas[s]["generation"] = EMPTY_GENERATION
                self.tags[s] = UNKNOWN_TENANT

    def store(self, keys: Sequence[bytes], src: np.ndarray, generation: int = 1) -> list[int]:
        """Allocate slots in the tier, write ``src`` there and publish ``keys`` (what the
        owning node does with its own pages)."""
        slots = self.tier.allocate(len(keys))
        for i, s in enumerate(slots):
            self.put(s, generation, src[i].data)
        self.publish(keys, slots)
        return slots

    # -- what the servers call ------------------------------------------------------------
    def read(self, slots: Sequence[int], keys: Sequence[bytes] | None = None,
             scope: Scope = None) -> tuple[tuple[PageMeta, ...], list[memoryview]]:
        """The metas of ``slots`` and views of their stored bytes (empty for a miss or an
        out-of-range slot, whose meta then has generation 0). A keyed store answers only
        slots that hold ``keys[i]`` for a tenant ``scope`` may see."""
        metas, parts = [], []
        buf = self.tier.buffer
        if keys is not None and len(keys) != len(slots):
            raise ProtocolError(f"a read names {len(keys)} keys for {len(slots)} slots")
        with self._lock:
            for i, s in enumerate(slots):
                if not 0 <= s < self.num_slots or (self.keyed and (keys is None or self._index.get(keys[i]) != s
                                                                  or not self._visible(s, scope))):
                    metas.append(PageMeta(s, EMPTY_GENERATION, 0, 0))
                    continue
                m = self._meta_held(s)
                metas.append(m)
                if m.generation != EMPTY_GENERATION:
                    parts.append(buf[s, :m.length].data)
        return tuple(metas), parts

    def _visible(self, slot: int, scope: Scope) -> bool:
        """Whether a connection of ``scope`` may see the page in ``slot`` (lock held)."""
        return scope is None or int(self.tags[slot]) == scope

    def write(self, pages: Pages) -> WriteAck:
        if not self.accept_writes:
            return WriteAck(tuple(WriteStatus.OUT_OF_RANGE for _ in pages.metas))
        offs = pages.offsets()
        out = []
        for m, at in zip(pages.metas, offs):
            out.append(self.put(m.slot, m.generation, pages.data[at:at + m.length], m.checksum))
        return WriteAck(tuple(out))

    def decide(self, m: PageMeta) -> WriteStatus | None:
        """What a write of ``m`` would do, when that is known without its bytes: OUT_OF_RANGE,
        STALE (older than the stored generation), DUPLICATE (this generation and checksum
        are stored); None when only the bytes decide. The RDMA server asks before it
        grants staging, so a resend of a write that already landed moves no bytes."""
        if not self.accept_writes or not (0 <= m.slot < self.num_slots and 0 < m.length <= self.slot_bytes) \
                or m.generation <= 0:
            return WriteStatus.OUT_OF_RANGE
        with self._lock:
            r = self.metas[m.slot]
            cur, checksum = int(r["generation"]), int(r["checksum"])
        if m.generation < cur:
            return WriteStatus.STALE
        if m.generation == cur and m.checksum == checksum:
            return WriteStatus.DUPLICATE
        return None

    def put(self, slot: int, generation: int, data: memoryview, checksum: int | None = None) -> WriteStatus:
        if not self.accept_writes or not (0 <= slot < self.num_slots and 0 < len(data) <= self.slot_bytes) or generation <= 0:
            return WriteStatus.OUT_OF_RANGE
        actual = page_checksum(data)
        if checksum is not None and actual != checksum:
            return WriteStatus.BAD_CHECKSUM
        # One writer per slot from the generation check to the new meta: two writers racing
        # on a slot (TCP workers, two clients) must not interleave their bytes.
        with self._slot_locks[slot % len(self._slot_locks)]:
            with self._lock:
                cur = int(self.metas[slot]["generation"])
                if generation < cur:
                    return WriteStatus.STALE
                if generation == cur and int(self.metas[slot]["checksum"]) == actual:
                    return WriteStatus.DUPLICATE
                self.metas[slot]["generation"] = EMPTY_GENERATION  # torn-read guard while the bytes move
            self.tier.buffer[slot, :len(data)] = np.frombuffer(data, dtype=np.uint8)
            return self._set_meta(PageMeta(slot, generation, len(data), actual), actual)

    def call(self, call: Call, scope: Scope = None, *, inline: bool = False) -> Reply:
        """Answer a control call; ``inline``: on a thread that must not wait (RDMA's progress)."""
        if inline and call.method in TCP_ONLY:
            return Reply(False, f"{call.method} is served over TCP only".encode())
        if scope is not None and call.method in CLUSTER_ONLY:
            return Reply(False, f"{call.method} is for the cluster's principal; this connection may see one "
                                "tenant's pages".encode())
        fn = self.methods.get(call.method)
        if fn is None:
            return Reply(False, f"unknown method {call.method!r}; known: {sorted(self.methods)}".encode())
        try:
            return Reply(True, fn(call.body, scope))
        except (TierKVError, ValueError, IndexError) as e:  # InputError, a malformed body (ProtocolError)
            return Reply(False, f"{call.method}: {e}".encode())

    def _set_meta(self, m: PageMeta, actual: int) -> WriteStatus:
        if actual != m.checksum:
            return WriteStatus.BAD_CHECKSUM
        with self._lock:
            cur = int(self.metas[m.slot]["generation"])
            if m.generation < cur:
                return WriteStatus.STALE
            r = self.metas[m.slot]
            r["generation"], r["length"], r["checksum"] = m.generation, m.length, m.checksum
            return WriteStatus.STORED

    def _lookup(self, body: bytes, scope: Scope = None) -> bytes:
        keys = decode_keys(body)
        # Slot and meta under one hold: between two, the owner could reuse the slot for
        # another page (another tenant's), whose meta would then vouch for it under this key.
        with self._lock:
            slots = [self._index.get(k, -1) for k in keys]
            metas = [self._meta_held(s) if s >= 0 and self._visible(s, scope) else PageMeta(0, EMPTY_GENERATION, 0, 0)
                     for s in slots]
        return encode_metas(metas)
