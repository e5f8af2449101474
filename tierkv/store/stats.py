"""Per-tier counters and the immutable snapshot the API returns from ``stats()``.

Counters are updated by :mod:`tierkv.store.api` and :mod:`tierkv.store.transfer` under the store
lock, per tier *name* (a tier's identity; the kind's name unless the tier was given
another, so two tiers of one kind are counted apart). ``bytes_moved`` and
``seconds_moved`` are keyed ``"src->dst"`` where ``caller`` stands for the engine's
buffers, e.g. ``"caller->dram"``, ``"dram->nvme"``, ``"nvme->caller"``. A promotion on a
hit counts once as ``"nvme->caller"`` (the read) and once as ``"nvme->dram"`` (the copy
written up into DRAM from that same read).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierkv.tiers.base import Tier


@dataclass(frozen=True)
class TierStats:
    """Counters of one tier: ``name`` (its identity, the key of ``StoreStats.tiers``) and
    ``kind`` (its medium: ``hbm``, ``dram``, ``nvme``, ``nvmeof``). ``hits`` counts pages
    served from it by ``get`` (a prefetch is not a hit); ``bytes_read`` and
    ``bytes_written`` count bytes that crossed the tier's own I/O, once each (a promoted
    hit is read once)."""

    name: str
    kind: str
    hits: int
    capacity_slots: int
    used_slots: int
    slot_bytes: int
    bytes_read: int
    bytes_written: int
    io_seconds: float
    state: str = "available"  # "degraded" while a fabric tier's namespace is unreachable
    #: Block-addressed tiers (nvme, nvmeof): the codec choice and its reason
    #: (:meth:`tierkv.store.coding.CodecChoice.describe`); None for the others.
    codec: dict[str, object] | None = None
    #: Bytes of memory the tier's eviction policy holds for its pages (None: a policy
    #: that cannot tell, such as the pure-Python structures).
    policy_bytes: int | None = None

    @property
    def occupancy(self) -> float:
        return self.used_slots / self.capacity_slots if self.capacity_slots else 0.0


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store's counters."""

    tiers: dict[str, TierStats]
    bytes_moved: dict[str, int]
    seconds_moved: dict[str, float]
    lookups: int
    pages_requested: int
    pages_hit: int
    pages_stored: int
    pages_dropped: int
    evictions: int
    promotions: int
    corrupt_pages: int
    peer_pages: int = 0  # pages get loaded from other nodes ([peers] fetch)
    #: DualPath ([peers] helpers / helper): this node's divided fetches
    #: (:meth:`tierkv.dualpath.loads.Loads.stats`) under ``loads`` and each side's measured
    #: cost under ``rates_bytes_s`` and ``latency_s``, the pushes it served for others under ``helper``;
    #: empty where neither is configured.
    dualpath: dict[str, dict[str, float]] = field(default_factory=dict)
    derived_pages: int = 0   # derived pages gets returned (accept="derived": moved by a splice, docs/splice.md)
    lossy_pages: int = 0     # lossy pages read for gets (accept_lossy=: coded at a budget, docs/lossy.md)
    lossy_converted: int = 0   # exact pages a lossy tier (lossy_bits) converted to lossy ones
    lossy_pending: int = 0     # pages queued for that conversion, or being converted, now
    lossy_waiting: int = 0     # pages it keeps back now (cached children or pins need them exact)
    page_table_bytes: int = 0  # the page table's columns, keys and map (not a key table a policy shares)
    index_file_bytes: int = 0  # the persistent index's file in use (LMDB; the writer unmaps its pages after use)

    @property
    def misses(self) -> int:
        """Pages asked for by ``get`` that no tier could serve."""
        return self.pages_requested - self.pages_hit

    @property
    def hit_rate(self) -> float:
        return self.pages_hit / self.pages_requested if self.pages_requested else 0.0

    def to_dict(self) -> dict[str, object]:
        """The snapshot as a JSON-ready dict (``json.dumps`` takes it): every counter, the
        derived ``hit_rate`` and ``misses``, and per tier its counters and ``occupancy``."""
        out: dict[str, object] = {k: v for k, v in self.__dict__.items() if k != "tiers"}
        out["hit_rate"] = self.hit_rate
        out["misses"] = self.misses
        out["tiers"] = {name: {**t.__dict__, "occupancy": t.occupancy} for name, t in self.tiers.items()}
        return out


#: What ``snapshot`` reports of memory: the page table's bytes, each tier's policy's (None:
#: not measured), the index file's.
Memory = tuple[int, Mapping[str, int | None], int]


class Counters:
    """Mutable counters behind :class:`StoreStats`."""

    def __init__(self) -> None:
        self.events: Counter[str] = Counter()
        self.moved: Counter[str] = Counter()
        self.moved_s: defaultdict[str, float] = defaultdict(float)
        self.tier_hits: Counter[str] = Counter()
        self.tier_read: Counter[str] = Counter()
        self.tier_written: Counter[str] = Counter()
        self.tier_io_s: defaultdict[str, float] = defaultdict(float)

    def snapshot(self, tiers: Sequence[Tier], dualpath: dict[str, dict[str, float]] | None = None,
                 lossy: tuple[int, int] = (0, 0), memory: Memory = (0, {}, 0)) -> StoreStats:
        """The counters as a :class:`StoreStats`, with each tier's occupancy and state now;
        ``memory``: the page table's bytes, each tier's policy's, the index file's."""
        table_bytes, policy_bytes, index_bytes = memory
        stats: dict[str, TierStats] = {
            t.name: TierStats(t.name, t.kind.value, self.tier_hits[t.name], t.num_slots, t.num_slots - t.num_free,
                              t.slot_bytes, self.tier_read[t.name], self.tier_written[t.name], self.tier_io_s[t.name],
                              "available" if t.available else "degraded", t.codec_state(), policy_bytes.get(t.name))
            for t in tiers
        }
        ev = self.events
        return StoreStats(stats, dict(self.moved), dict(self.moved_s), ev["lookups"], ev["pages_requested"],
                          ev["pages_hit"], ev["pages_stored"], ev["pages_dropped"], ev["evictions"],
                          ev["promotions"], ev["corrupt_pages"], self.tier_hits["peer"], dualpath or {},
                          derived_pages=ev["derived_pages"], lossy_pages=ev["lossy_pages"],
                          lossy_converted=ev["lossy_converted"], lossy_pending=lossy[0], lossy_waiting=lossy[1],
                          page_table_bytes=table_bytes, index_file_bytes=index_bytes)

    def moved_bytes(self, src: str, dst: str, nbytes: int, seconds: float, src_read: bool = True) -> None:
        """Count a transfer between a tier pair and the wall time it took. ``src_read=False``:
        the bytes came from a buffer already read (a promotion), not from ``src`` again."""
        self.moved[f"{src}->{dst}"] += nbytes
        self.moved_s[f"{src}->{dst}"] += seconds
        if src != "caller" and src_read:
            self.tier_read[src] += nbytes
        if dst != "caller":
            self.tier_written[dst] += nbytes
