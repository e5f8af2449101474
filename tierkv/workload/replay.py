"""Replay of a serving workload through a real :class:`~tierkv.store.api.Store`.

For each request, in the order given (arrival order; timestamps are not waited for):
``lookup`` its full pages, ``get`` the cached leading pages into a reused buffer,
*prefill* the missing pages with bytes determined by their block ids, and ``put`` the
whole prefix back. With ``verify`` every page a ``get`` returns is compared with the
bytes its block must hold: a mismatch raises :class:`ReplayVerifyError`, because a
store must never return wrong data. Called by ``tierkv replay`` and the tests.

One page per workload block: the layout's ``tokens_per_page`` is the block size.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar

import numpy as np

from tierkv.store.api import Store, StoreStats
from tierkv.store.stats import TierStats
from tierkv.config import DramConfig, NvmeConfig, StoreConfig
from tierkv.errors import CapacityError, ConfigError, CorruptPageError
from tierkv.layout import DType, KVLayout
from tierkv.policy import DEFAULT_POLICY
from tierkv.progress import task_progress
from tierkv.workload.trace import MOONCAKE_BLOCK_TOKENS, Request, _mix64, request_tokens

#: Default replay page size: small enough that an hour of trace replays in minutes.
DEFAULT_PAGE_BYTES = 64 << 10
#: Default tier sizes as shares of the workload's distinct full blocks (see default_capacities).
DRAM_SHARE = 0.04
NVME_SHARE = 0.40

_U64 = np.uint64


class ReplayVerifyError(CorruptPageError):
    """A page loaded by ``get`` does not hold the bytes its block was stored with."""


# --------------------------------------------------------------------------------------
# Configuration helpers


def replay_layout(page_bytes: int, tokens_per_page: int = MOONCAKE_BLOCK_TOKENS) -> KVLayout:
    """The replay's layout: 1 layer, 1 KV head, bf16, ``head_dim`` sized to ``page_bytes``.

    ``page_bytes`` must be a positive multiple of ``4 * tokens_per_page`` (K and V,
    2 bytes each, per token); raises ConfigError otherwise.
    """
    per_dim = 2 * DType.BF16.itemsize * tokens_per_page
    if isinstance(page_bytes, bool) or page_bytes <= 0 or page_bytes % per_dim:
        raise ConfigError(f"page size must be a positive multiple of {per_dim} bytes (K+V x 2-byte bf16 x "
                          f"{tokens_per_page} tokens), got {page_bytes}; e.g. {DEFAULT_PAGE_BYTES}")
    return KVLayout(num_layers=1, num_kv_heads=1, head_dim=page_bytes // per_dim, dtype=DType.BF16,
                    tokens_per_page=tokens_per_page)


def default_capacities(requests: Sequence[Request], page_bytes: int,
                       block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> tuple[int, int]:
    """``(dram_bytes, nvme_bytes)`` that make a replay of ``requests`` use both tiers.

    DRAM holds ``DRAM_SHARE`` of the distinct full blocks and NVMe ``NVME_SHARE``, but
    DRAM at least twice and NVMe at least four times the largest request, so that one
    request always fits.
    """
    distinct: set[int] = set()
    largest = 1
    for req in requests:
        n = req.full_blocks(block_tokens)
        distinct.update(req.blocks[:n])
        largest = max(largest, n)
    dram_pages = max(int(len(distinct) * DRAM_SHARE), 2 * largest)
    nvme_pages = max(int(len(distinct) * NVME_SHARE), 4 * largest)
    return dram_pages * page_bytes, nvme_pages * page_bytes


def replay_config(workdir: str | Path, page_bytes: int, dram_bytes: int, nvme_bytes: int | None) -> StoreConfig:
    """The embedded default: DRAM + a file-backed O_DIRECT NVMe tier under ``workdir``.

    ``nvme_bytes`` of None or 0 disables the NVMe tier.
    """
    return StoreConfig(path=str(workdir), model_id="replay", layout=replay_layout(page_bytes),
                       dram=DramConfig(capacity_bytes=dram_bytes),
                       nvme=NvmeConfig(capacity_bytes=nvme_bytes, o_direct=True, io_threads=4) if nvme_bytes else None,
                       policy=DEFAULT_POLICY)


# --------------------------------------------------------------------------------------
# Result


_V = TypeVar("_V")


def _frozen(mapping: Mapping[str, _V]) -> Mapping[str, _V]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class ReplayResult:
    """What a replay measured. Rates are shares in [0, 1]; bandwidths are GB/s (1e9 B/s).

    ``prefix_hit_rate`` counts a block as served only when ``get`` returned it, which
    needs every earlier block of the request cached too; ``tier_hit_rate[t]`` splits it
    by the tier that served the block, so the tier rates sum to it. ``pages_refused``
    are new pages a ``put`` found no room for; ``puts_rejected`` counts whole ``put``
    calls refused with CapacityError (a prefix larger than all tiers together).
    ``unbounded_hit_rate`` is what an unbounded cache would reach on the same requests
    (the name ``tierkv plan`` uses too). ``bandwidth_gbps[pair]``
    divides the bytes moved between a pair by the time the store spent in those
    transfers (``io_s``); ``store["tiers"][t]["io_gbps"]`` is a tier's bytes over the
    time spent in its own I/O.
    """

    requests: int
    blocks_requested: int
    blocks_hit: int
    prefix_hit_rate: float
    unbounded_hit_rate: float
    tier_hit_rate: Mapping[str, float]
    prompt_tokens: int
    tokens_from_cache: int
    prefill_tokens_from_cache_frac: float
    pages_stored: int
    pages_already_present: int
    pages_refused: int
    puts_rejected: int
    pages_verified: int
    bytes_moved: Mapping[str, int]
    bandwidth_gbps: Mapping[str, float]
    io_s: Mapping[str, float]
    store: Mapping[str, object]
    timings_s: Mapping[str, float]
    wall_s: float
    config: Mapping[str, object]

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict of every field (mappings become plain dicts)."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _jsonable(value: object) -> object:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return value


# --------------------------------------------------------------------------------------
# Page contents


class PagePattern:
    """The bytes a block's page holds: a fixed random row XOR a per-block 64-bit word.

    Cheap to make and to check, and it catches a page of another block, a page shifted
    within a slot, a torn or a zeroed page.
    """

    def __init__(self, page_bytes: int) -> None:
        if page_bytes % 8:
            raise ConfigError(f"replay page size must be a multiple of 8 bytes, got {page_bytes}")
        with np.errstate(over="ignore"):
            self._base = _mix64(np.arange(page_bytes // 8, dtype=_U64) + _U64(0x5EED))

    def _words(self, block_ids: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return _mix64(block_ids.astype(_U64) ^ _U64(0xA5A5_5A5A_C3C3_3C3C))

    def fill(self, rows: np.ndarray, block_ids: np.ndarray) -> None:
        """Write the pages of ``block_ids`` into the uint8 rows ``rows`` (one per id)."""
        if len(block_ids):
            np.bitwise_xor(self._base[None, :], self._words(block_ids)[:, None], out=rows.view(_U64))

    def mismatches(self, rows: np.ndarray, block_ids: np.ndarray) -> np.ndarray:
        """Indices of rows that do not hold their block's page."""
        if not len(block_ids):
            return np.zeros(0, dtype=np.int64)
        got = rows.view(_U64) ^ self._base[None, :]
        bad = (got != self._words(block_ids)[:, None]).any(axis=1)
        return np.flatnonzero(bad)



# --------------------------------------------------------------------------------------
# The replay loop


class _Tally:
    """Mutable counters of one replay (internal)."""

    def __init__(self, tier_names: Iterable[str]) -> None:
        self.requests = self.blocks_requested = self.blocks_hit = self.unbounded_hits = 0
        self.prompt_tokens = self.tokens_from_cache = 0
        self.stored = self.already_present = self.dropped = self.rejected = self.verified = 0
        self.tier_blocks: dict[str, int] = {name: 0 for name in tier_names}
        self.timings = {"lookup": 0.0, "get": 0.0, "put": 0.0, "prefill": 0.0, "verify": 0.0}
        self.seen: set[tuple[str, int]] = set()   # (tenant, block): tenants never share pages


class _Replayer:
    """Drives one request at a time through ``store`` (internal)."""

    def __init__(self, store: Store, layout: KVLayout, verify: bool) -> None:
        self.store = store
        self.verify = verify
        self.layout = layout
        self.block = self.layout.tokens_per_page
        self.pattern = PagePattern(self.layout.page_bytes)
        stats = store.stats()
        self.start_stats = stats
        self.tally = _Tally(stats.tiers)
        self.buf = np.empty((0, self.layout.page_bytes), dtype=np.uint8)

    def _buffer(self, n: int) -> np.ndarray:
        if self.buf.shape[0] < n:
            self.buf = np.empty((max(n, 2 * self.buf.shape[0]), self.layout.page_bytes), dtype=np.uint8)
        return self.buf[:n]

    def _unbounded(self, tenant: str, blocks: Sequence[int]) -> None:
        t = self.tally
        lead = 0
        while lead < len(blocks) and (tenant, blocks[lead]) in t.seen:
            lead += 1
        t.unbounded_hits += lead
        t.seen.update((tenant, b) for b in blocks)

    def run(self, index: int, req: Request) -> None:
        t = self.tally
        n = req.full_blocks(self.block)
        t.requests += 1
        t.prompt_tokens += req.input_tokens
        t.blocks_requested += n
        self._unbounded(req.tenant, req.blocks[:n])
        if n == 0:
            return
        tokens = request_tokens(req, self.block)
        ids = np.array(req.blocks[:n], dtype=_U64)
        pages = self._buffer(n)
        t0 = time.perf_counter()
        cached = self.store.lookup(tokens, tenant=req.tenant).cached_pages
        t.timings["lookup"] += time.perf_counter() - t0
        hit = self._get(index, req, tokens, ids, pages, min(cached, n)) if cached else 0
        t0 = time.perf_counter()
        self.pattern.fill(pages[hit:], ids[hit:])
        t.timings["prefill"] += time.perf_counter() - t0
        self._put(req, tokens, pages)

    def _get(self, index: int, req: Request, tokens: np.ndarray, ids: np.ndarray,
             pages: np.ndarray, cached: int) -> int:
        t = self.tally
        t0 = time.perf_counter()
        got = self.store.get(tokens, pages[:cached], tenant=req.tenant)
        t.timings["get"] += time.perf_counter() - t0
        hit = got.pages
        for kind in got.tiers[:hit]:
            name = kind.value
            t.tier_blocks[name] = t.tier_blocks.get(name, 0) + 1
        t.blocks_hit += hit
        t.tokens_from_cache += hit * self.block
        if self.verify and hit:
            t0 = time.perf_counter()
            bad = self.pattern.mismatches(pages[:hit], ids[:hit])
            t.timings["verify"] += time.perf_counter() - t0
            if len(bad):
                i = int(bad[0])
                tier = got.tiers[i].value if i < len(got.tiers) else "?"
                raise ReplayVerifyError(
                    f"request {index} (arrival {req.arrival_s:.3f} s): page {i} of {hit} loaded from the {tier} "
                    f"tier does not hold block {int(ids[i])}'s bytes ({len(bad)} bad pages in this get)")
            t.verified += hit
        return hit

    def _put(self, req: Request, tokens: np.ndarray, pages: np.ndarray) -> None:
        t = self.tally
        t0 = time.perf_counter()
        try:
            result = self.store.put(tokens, pages, tenant=req.tenant)
        except CapacityError:
            # A store that cannot take a prefix drops it; the engine goes on uncached.
            t.rejected += 1
            return
        finally:
            t.timings["put"] += time.perf_counter() - t0
        t.stored += result.stored
        t.already_present += result.already_present
        t.dropped += result.dropped


def run_replay(requests: Iterable[Request], cfg: StoreConfig, *, progress: bool,
               verify: bool = True) -> ReplayResult:
    """Replay ``requests`` in the order given through a store opened from ``cfg``.

    The block size is ``cfg.layout.tokens_per_page``; a page's bytes are determined by
    its block id (:class:`PagePattern`). Runs as fast as the store allows, single
    threaded. ``progress`` shows a rich progress bar on stderr. Raises
    :class:`ReplayVerifyError` on the first wrong page when ``verify``; a ``put`` the
    store refuses for capacity is counted in ``puts_rejected`` and skipped. The store is
    closed on return (its directory is left in place).
    """
    total = len(requests) if isinstance(requests, Sequence) else None
    t_start = time.perf_counter()
    with Store.open(cfg) as store:
        rp = _Replayer(store, cfg.layout, verify)
        with task_progress("replay", total, progress) as advance:
            for index, req in enumerate(requests):
                rp.run(index, req)
                advance()
        end_stats = store.stats()
    return _result(rp, end_stats, cfg, time.perf_counter() - t_start)


def _delta(end: Mapping[str, int], start: Mapping[str, int]) -> dict[str, int]:
    return {k: v - start.get(k, 0) for k, v in sorted(end.items()) if v - start.get(k, 0)}


def _rate(num: float, den: float) -> float:
    return num / den if den else 0.0


def _result(rp: _Replayer, end: StoreStats, cfg: StoreConfig, wall_s: float) -> ReplayResult:
    t = rp.tally
    start = rp.start_stats
    moved = _delta(end.bytes_moved, start.bytes_moved)
    pair_s = {pair: end.seconds_moved.get(pair, 0.0) - start.seconds_moved.get(pair, 0.0) for pair in moved}
    bandwidth = {pair: _rate(n / 1e9, pair_s[pair]) for pair, n in moved.items()}
    store: dict[str, object] = {
        name: getattr(end, name) - getattr(start, name)
        for name in ("evictions", "promotions", "pages_dropped", "corrupt_pages", "pages_stored")}
    store["tiers"] = {name: _tier_json(ts, start.tiers.get(name)) for name, ts in end.tiers.items()}
    return ReplayResult(
        requests=t.requests, blocks_requested=t.blocks_requested, blocks_hit=t.blocks_hit,
        prefix_hit_rate=_rate(t.blocks_hit, t.blocks_requested),
        unbounded_hit_rate=_rate(t.unbounded_hits, t.blocks_requested),
        tier_hit_rate=_frozen({k: _rate(v, t.blocks_requested) for k, v in t.tier_blocks.items()}),
        prompt_tokens=t.prompt_tokens, tokens_from_cache=t.tokens_from_cache,
        prefill_tokens_from_cache_frac=_rate(t.tokens_from_cache, t.prompt_tokens),
        pages_stored=t.stored, pages_already_present=t.already_present, pages_refused=t.dropped,
        puts_rejected=t.rejected,
        pages_verified=t.verified, bytes_moved=_frozen(moved), bandwidth_gbps=_frozen(bandwidth),
        io_s=_frozen(pair_s), store=_frozen(store),
        timings_s=_frozen(t.timings), wall_s=wall_s, config=_frozen(_config_json(cfg)))


def _tier_json(end: TierStats, start: TierStats | None) -> dict[str, object]:
    """One tier's counters over the replay; ``io_gbps`` is its bytes over its own I/O time."""
    hits, read, written, io_s = (getattr(end, f) - (getattr(start, f) if start else 0)
                                 for f in ("hits", "bytes_read", "bytes_written", "io_seconds"))
    return {"capacity_slots": end.capacity_slots, "used_slots": end.used_slots, "hits": hits,
            "bytes_read": read, "bytes_written": written, "io_s": io_s, "io_gbps": _rate((read + written) / 1e9, io_s)}


def _config_json(cfg: StoreConfig) -> dict[str, object]:
    out = _jsonable(cfg)
    assert isinstance(out, dict)
    out["page_bytes"] = cfg.layout.page_bytes
    out["dram_pages"] = cfg.dram.capacity_bytes // cfg.layout.page_bytes if cfg.dram else 0
    out["nvme_pages"] = cfg.nvme.capacity_bytes // cfg.layout.page_bytes if cfg.nvme else 0
    return out
