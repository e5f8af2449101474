"""The Python API serving engines use: open a store, then lookup, get, put, prefetch, pin.

``Store.open(config)`` builds the tiers (HBM, DRAM, NVMe), the LMDB index and the
block manager (:mod:`tierkv.store.opening`) from a :class:`~tierkv.config.StoreConfig` or a
TOML file. All public methods
are thread-safe (one store lock); I/O runs on the tiers' thread pools. A second
process can open the same store with ``read_only=True`` and read what the writer has
committed; only one writer at a time holds the store.

Pages are keyed by their tokens (see :mod:`tierkv.keys`), so callers pass token ids
and page tensors, never keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
import logging
import os
import threading
import time
from dataclasses import dataclass
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tierkv.config import StoreConfig, load_config
from tierkv.errors import ConfigError, InputError, StoreClosedError, TierIOError
from tierkv.store.index_check import mark_clean
from tierkv.keys import (KEY_BYTES, PageKey, Tokens, as_token_array, chain_stretches, chain_token_keys, lossy_keys,
                         namespace_digest, split_keys, tenant_salt, token_ids)
from tierkv.layout import KVLayout
from tierkv.store.opening import open_store_parts, release_dir
from tierkv.store.pages import PageBatch, PageSource, Rows, page_list, page_rows
from tierkv.store import derived, lossy_pages
from tierkv.store.derived import Origin, Provenance
from tierkv.store.lossy_tier import Converter, open_converter
from tierkv.store.peering import Peering, Publishing, Route
from tierkv.store.pins import PinLedger
from tierkv.store.landed import LAYERS, PAGES, check_record, layer_groups, publish, reset
from tierkv.store.moves import NO_PARENT, NO_SOURCE, Lead, MovePlan, NewPages, Placed
from tierkv.store.results import GetResult as GetResult
from tierkv.store.results import Lent as Lent
from tierkv.store.results import LookupResult as LookupResult
from tierkv.store.results import PutResult as PutResult
from tierkv.store.stats import Counters, StoreStats
from tierkv.tiers.base import TierKind
from tierkv.tiers.aligned import ALIGN, aligned_empty, is_aligned
from tierkv.tiers.dram import DramTier
from tierkv.tiers.blocks import BlockPageTier
from tierkv.store.transfer import Transfers, gather_rows
from tierkv.store.validate import GET_LIST_MESSAGE, check_requested, check_unfilled

if TYPE_CHECKING:
    from tierkv.lossy.alloc import Calibration, Importance
    from tierkv.serve.client import RemoteStore
    from tierkv.splice.ops import SpliceResult
    from tierkv.splice.rope import Rope

log = logging.getLogger(__name__)

#: Name prefix of the prefetch worker thread (close() called on it must not join it).
_PREFETCH_THREAD = "tierkv-prefetch"


#: Copies of at least this many bytes into or out of the DRAM tier run without the
#: store's lock, so that threads (and the node service's clients) copy at once; smaller
#: ones are not worth releasing it for.
UNLOCKED_COPY_BYTES = 1 << 20

#: Gets of pages from tiers below DRAM read them into a buffer of the store's own first
#: (checked, promoted, then copied out); one such buffer up to this size is kept.
PRIVATE_ROWS_BYTES = 128 << 20

#: What a get or lookup may return: exact pages only, or derived ones (moved by a splice) after them.
ACCEPT = ("exact", "derived")

#: How often a DualPath push waiting for this store's lock looks again at why it waits.
PUSH_LOCK_POLL_S = 0.02


@dataclass
class _Begun:
    """A put whose DRAM pages are yet to be written (``placed``: reserved, unpublished)."""

    plan: MovePlan
    placed: Placed
    row_of: np.ndarray   # the row of the put's pages for each page the plan was asked to place
    stored: int
    new: int
    removed: int         # the manager's count of removed copies when the plan was made


class Store:
    """A tiered KV page store. Use ``Store.open(...)`` and close it (or use ``with``)."""

    #: Seconds a close waits for open lends (:meth:`lend`) to end before ending them itself.
    CLOSE_LEND_GRACE_S = 5.0

    def __init__(self, config: StoreConfig, *, read_only: bool = False) -> None:
        self.config = config
        self.layout: KVLayout = config.layout
        self.read_only = read_only
        self._lock = threading.RLock()
        self._closed = False
        self._released = threading.Event()  # set once close() has released everything
        # Large copies into and out of the DRAM tier run without the lock (docs/design.md,
        # "Copies without the store's lock"): how many are running, and a condition close()
        # waits on until none are.
        self._copying = 0
        self._copies_done = threading.Condition(self._lock)
        self._lends: set[int] = set()   # of those, lends (tokens): their borrowers end them
        self._namespaces: dict[bytes, bytes] = {}
        self._private: np.ndarray | None = None   # see _private_rows
        # Per calling thread, the key blob of its last get until its put: engines that serve
        # requests on several threads interleave their gets and puts.
        self._announced = threading.local()
        self._counters = Counters()
        self._dir = Path(config.path)
        parts = open_store_parts(config, read_only)
        self._lockfile, self._index, self._manager = parts.lock_fd, parts.index, parts.manager
        self._kinds = tuple(t.kind for t in self._manager.tiers)   # by level
        top = self._manager.tiers[0]
        # The tier whose large copies run without the store's lock: the DRAM tier, when it
        # is the fastest (its slots are held back from reuse while such copies run).
        self._fast: DramTier | None = top if isinstance(top, DramTier) and not read_only else None
        self._pins = PinLedger(self._manager)  # what each pin call took
        self._transfers = Transfers(self._manager, self._counters, self.layout.page_bytes,
                                    deferred_sync=self._index is not None and self._index.deferred,
                                    read_only=read_only)
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=_PREFETCH_THREAD)
        self._peering: Peering | None = None
        self._converter: Converter | None = None
        try:
            self._provenance = Provenance(self._index, self._manager.held, read_only=read_only)
            if config.peers is not None and not read_only:
                self._peering = Peering(config.peers, self._manager, self.layout.page_bytes, self._load_for_push)
            self._converter = open_converter(self)
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, config: StoreConfig | str | os.PathLike[str], *, read_only: bool = False) -> Store:
        """Open (creating if needed) the store that ``config`` (or a TOML path) describes."""
        cfg = config if isinstance(config, StoreConfig) else load_config(config)
        return cls(cfg, read_only=read_only)

    @staticmethod
    def connect(socket_path: str | os.PathLike[str], *, timeout_s: float = 60.0) -> RemoteStore:
        """A client of the store a ``tierkv serve`` daemon serves at ``socket_path``
        (:mod:`tierkv.serve.client`): the same methods, results and errors as an open
        store, for any number of processes at once. ``timeout_s`` bounds connecting and
        sending; a daemon that is not there, or goes away during a call, raises
        ``StoreUnavailableError``, and the next call connects again."""
        from tierkv.serve.client import RemoteStore
        return RemoteStore(socket_path, timeout_s=timeout_s)

    # -- keys ----------------------------------------------------------------------------
    def _namespace(self, salt: bytes) -> bytes:
        """The chain seed of a tenant's pages (its salt's): this store's model and layout."""
        ns = self._namespaces.get(salt)
        if ns is None:
            ns = self._namespaces[salt] = namespace_digest(self.config.model_id, self.layout, salt)
        return ns

    def _keys(self, tokens: Tokens, tenant: str | bytes) -> bytes:
        return chain_token_keys(tokens, self.layout.tokens_per_page, self._namespace(tenant_salt(tenant)))

    @property
    def peer_address(self) -> tuple[str, int] | None:
        """Where this store serves its DRAM pages to other nodes (``[peers] serve``), or None."""
        return self._peering.address if self._peering is not None else None

    def identity(self) -> str:
        """This store's random identity (hex): its index's, or for a store without a
        persistent tier one kept in its directory (``node.id``), made on first use."""
        self._check_open()
        if self._index is not None:
            return self._index.store_id().hex()
        path = self._dir / "node.id"
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            ident = os.urandom(16).hex()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(ident + "\n")
            return ident

    def set_cluster_peers(self, endpoints: list[tuple[str, int]]) -> None:
        """The nodes whose DRAM pages this store may fetch besides ``[peers] fetch``: the
        cluster's members of this model and layout (the node service keeps it current,
        docs/cluster.md). ConfigError without a ``[peers]`` table (fetching needs its secret)."""
        if self._peering is None:
            raise ConfigError("fetching from the cluster's nodes needs a [peers] table with its secret_file")
        self._peering.set_cluster_peers(endpoints)

    def set_cluster_directory(self, publisher: Publishing | None, route: Route | None) -> None:
        """The cluster's page directory (docs/cluster.md): ``publisher`` is told the pages
        this store serves to other nodes; ``route(chain)`` names the members holding a
        chain's leading pages, so a get or lookup asks those (None: every member is asked).
        ConfigError without a ``[peers]`` table."""
        if self._peering is None:
            raise ConfigError("the cluster's page directory needs a [peers] table with its secret_file")
        self._peering.set_directory(publisher, route)

    def fetch_peers(self) -> list[tuple[str, int]]:
        """The peers a get asks, in order, for pages it does not find here (``[peers] fetch``,
        then the cluster's)."""
        return self._peering.peers if self._peering is not None else []

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the store at {self._dir} is closed")

    def _lead(self, blob: bytes, limit: int) -> Lead:
        """The leading cached pages of a key blob, at most ``limit``, column by column."""
        if self.read_only:
            return self._lead_from_index(blob, limit)
        return self._manager.lead(blob, limit)

    def _lead_from_index(self, blob: bytes, limit: int) -> Lead:
        """Read-only stores ask LMDB directly, so they see what the writer committed since."""
        assert self._index is not None
        tier = next(t for t in self._manager.tiers if t.persistent)
        slots: list[object] = []
        sums: list[int] = []
        for rec in self._index.get_many(tier.name, split_keys(blob[:limit * KEY_BYTES])):
            if rec is None:
                break
            slot: object = rec.slot
            if isinstance(tier, BlockPageTier):  # a coded tier: read at the record's blocks
                bpp = tier.blocks_per_page
                try:
                    slot = tier.view(rec.extents or ((rec.slot * bpp, bpp),))
                except InputError:
                    break  # a record that cannot be a page of this tier: a miss
            slots.append(slot)
            sums.append(rec.checksum)
        n = len(slots)
        return Lead(blob[:n * KEY_BYTES], np.full(n, self._manager.levels[tier.name], dtype=np.uint8), slots, sums)

    # -- the API ---------------------------------------------------------------------------
    def lookup(self, tokens: Tokens, tenant: str | bytes = "", *, count: bool = True,
               accept: str = "exact", accept_lossy: float | None = None) -> LookupResult:
        """How many leading full pages of ``tokens`` the store can serve, and from which tiers.

        Reads no page. The pages cached here are found in the index (no I/O). Where
        ``[peers] fetch`` lists peers and the run cached here ends before the prompt does,
        the run goes on with the pages those peers hold, as a ``get`` would fetch them,
        reported as ``TierKind.PEER``: each peer is asked once, all at once and without
        the store's lock, and one that is not connected, down or slower than
        :data:`tierkv.store.peering.LOOKUP_TIMEOUT_S` (50 ms) is a miss, never an error.
        A store without peers asks nobody. ``count=False`` leaves it out of
        ``stats().lookups`` (bookkeeping, not an engine's query). ``accept="derived"``:
        the run goes on with derived pages where the exact ones end (as :meth:`get`
        would load them; here only, not on peers), counted in the result's ``derived``.
        ``accept_lossy=budget``: the same with lossy pages coded at that budget
        (:meth:`put_lossy`), counted in ``lossy``. Exact lookups on a store without peers
        hash the prompt's keys a stretch at a time and stop at the first miss, so that a
        lookup costs what the cached prefix costs (every id is checked all the same).
        """
        budget = self._accepting(accept, accept_lossy, "lookup")
        self._check_open()
        if accept == "exact" and budget is None and self._peering is None:
            return self._lookup_leading(tokens, tenant, count)
        blob = self._keys(tokens, tenant)   # hashed without the lock
        res = self._lookup(blob, tenant, count)
        if (accept == "exact" and budget is None) or res.cached_pages == res.total_pages:
            return res
        more = (derived.derived_blob(self, tokens, tenant, blob, res.cached_pages) if budget is None else
                lossy_keys(blob[res.cached_pages * KEY_BYTES:], budget))
        with self._lock:
            self._check_open()
            levels = derived.derived_levels(self, more)
        n = res.cached_pages + len(levels)
        return LookupResult(n, n * self.layout.tokens_per_page, res.total_pages,
                            res.tier_ranks + levels.translate(self._manager.kind_ranks),
                            derived=len(levels) if budget is None else 0, lossy=len(levels) if budget is not None else 0)

    def _accepting(self, accept: str, accept_lossy: float | None, what: str) -> float | None:
        """Check a call's ``accept`` and ``accept_lossy`` (and that this store's layout can
        have lossy pages) before anything is read; the lossy budget or None."""
        if accept not in ACCEPT:
            raise InputError(f"{what}(accept=...) must be one of {', '.join(ACCEPT)}, got {accept!r}")
        if accept_lossy is None:
            return None
        if accept != "exact":
            raise InputError(f"{what}: accept={accept!r} and accept_lossy= cannot be asked together")
        lossy_pages.layout_dtype(self.layout, f"{what}(accept_lossy=...)")
        return lossy_pages.check_budget(accept_lossy, f"{what}(accept_lossy=...)")

    def lookup_keys(self, keys: bytes, *, count: bool = True) -> LookupResult:
        """:meth:`lookup` of a prompt given as its page keys (16 bytes each, back to back, as
        :func:`tierkv.keys.chain_keys` makes them for this store's model, layout and tenant)."""
        if not isinstance(keys, bytes) or len(keys) % KEY_BYTES:
            raise InputError(f"lookup_keys: keys must be bytes, {KEY_BYTES} per page")
        return self._lookup(keys, None, count)

    def _lookup_arriving(self, tokens: np.ndarray, tenant: str | bytes, ready: Callable[[int], None], *,
                         count: bool = True, accept: str = "exact", accept_lossy: float | None = None) -> LookupResult:
        """:meth:`lookup` of uint32 ids that another process is still writing (a node
        service's client narrows a long prompt's ids into shared memory while the daemon
        looks them up): ``ready(n)`` returns once the first ``n`` are in place, or raises
        to abandon the lookup. An exact lookup on a store without peers waits for each
        stretch's ids only when it gets there (a new prompt's answer goes back before its
        last ids are written); any other waits for them all first."""
        if accept == "exact" and accept_lossy is None and self._peering is None:
            self._check_open()
            return self._lookup_leading(tokens, tenant, count, ready)
        ready(tokens.size)
        return self.lookup(tokens, tenant, count=count, accept=accept, accept_lossy=accept_lossy)

    def _lookup_leading(self, tokens: Tokens, tenant: str | bytes, count: bool,
                        ready: Callable[[int], None] | None = None) -> LookupResult:
        """:meth:`lookup` of exact pages on a store without peers: the keys are hashed a
        stretch at a time (without the lock), each stretch looked up before the next is
        hashed, so that a prompt costs what its cached prefix costs (a new 128K-token
        prompt: one stretch of 64 pages, not 8,192 keys). Each stretch is one snapshot
        of the index; as any lookup, the answer is a hint that ``get`` checks again.
        ``ready``: as in :meth:`_lookup_arriving`."""
        ids = token_ids(tokens)
        tpp = self.layout.tokens_per_page
        levels = b""
        for i, blob in enumerate(chain_stretches(ids, tpp, self._namespace(tenant_salt(tenant)), ready=ready)):
            got = self._levels(blob, count and i == 0)
            levels += got
            if len(got) < len(blob) // KEY_BYTES:
                break
        n = len(levels)
        return LookupResult(n, n * tpp, ids.size // tpp, levels.translate(self._manager.kind_ranks))

    def _levels(self, blob: bytes, count: bool) -> bytes:
        """The tier levels of the leading pages of a key blob cached here (a miss where
        the fastest copy is on a degraded tier); ``count``: one more lookup in stats."""
        with self._lock:
            self._check_open()
            if count:
                self._counters.events["lookups"] += 1
            m = self._manager
            if self.read_only:
                return self._lead(blob, len(blob) // KEY_BYTES).levels.tobytes()
            levels = m.resident.prefix_values(blob)
            down = m.unavailable_levels()
        if down:  # pages whose fastest copy is on a degraded tier are misses for now
            levels = levels[:next((i for i, v in enumerate(levels) if v in down), len(levels))]
        return levels

    def _lookup(self, blob: bytes, tenant: str | bytes | None, count: bool) -> LookupResult:
        """:meth:`lookup` of a key blob; ``tenant``: whose keys they are, when known."""
        total = len(blob) // KEY_BYTES
        levels = self._levels(blob, count)
        peering = self._peering
        n, ranks = len(levels), levels.translate(self._manager.kind_ranks)
        if peering is not None and n < total:   # the pages a get would fetch from peers
            more = peering.lookup(split_keys(blob), n, None if tenant is None else tenant_salt(tenant))
            n, ranks = n + more, ranks + bytes((TierKind.PEER.rank,)) * more
        return LookupResult(n, n * self.layout.tokens_per_page, total, ranks)

    def get(self, tokens: Tokens, out: PageBatch, tenant: str | bytes = "", *,
            requested: int | None = None, landed: np.ndarray | None = None, accept: str = "exact",
            accept_lossy: float | None = None) -> GetResult:
        """Load the leading cached pages of ``tokens`` into ``out`` (up to its length).

        ``accept="derived"``: where the exact pages end, go on with *derived* pages (moved
        there by :meth:`splice`: an approximation beyond the first layer, docs/splice.md);
        the result's ``derived`` says how many. ``accept_lossy=budget``: go on with *lossy*
        pages coded at that budget (:meth:`put_lossy`, docs/lossy.md), decoded into
        ``out``; the result's ``lossy`` says how many and ``evicted`` which of their tokens
        the coding dropped. The defaults never return either.
        """
        budget = self._accepting(accept, accept_lossy, "get")
        if (accept == "derived" or budget is not None) and landed is not None:
            raise InputError("get(accept='derived' or accept_lossy=...) loads whole pages: it takes no landing record")
        res = self._get_exact(tokens, out, tenant, requested=requested, landed=landed)
        if accept == "exact" and budget is None:
            return res
        rows = page_rows(out, self.layout, "get(out=...)", len(as_token_array(tokens)) // self.layout.tokens_per_page)
        if budget is not None:
            return lossy_pages.get_lossy(self, tokens, rows, tenant, res, budget)
        return derived.get_derived(self, tokens, rows, tenant, res)

    def put_lossy(self, tokens: Tokens, pages: PageSource, budget: float, tenant: str | bytes = "", *,
                  importance: Importance | None = None, calibration: Calibration | None = None,
                  evict: bool = True) -> PutResult:
        """Store ``pages`` (exact KV of ``tokens``' full pages, as :meth:`put` takes them)
        coded lossy at ``budget`` bits an element (docs/lossy.md): allocated by
        :func:`tierkv.lossy.alloc.allocate` with ``importance`` (a2 ``[layers, heads,
        tokens]`` over the pages' tokens, qe ``[layers, heads, head_dim]``; flat where None),
        the model's ``calibration`` and ``evict`` (False keeps every token). They go under
        keys of their own: only ``get``/``lookup`` with ``accept_lossy=budget`` return
        them, never an exact call, another budget or another tenant."""
        return lossy_pages.put_lossy(self, tokens, pages, tenant, budget, importance, calibration, evict)

    def _get_exact(self, tokens: Tokens, out: PageBatch, tenant: str | bytes = "", *,
                   requested: int | None = None, landed: np.ndarray | None = None) -> GetResult:
        """:meth:`get` of exact pages only.

        Stops at the first page that is not cached or fails verification. Only the
        first ``pages`` rows of the result hold pages; rows past them may have been
        written (pages are read, then checked). Hits on slower tiers are promoted when
        the config says so. ``requested`` is how many pages the request needed, for
        ``stats()`` (default: the rows of ``out``); an adapter that loads only what a
        lookup found passes the prompt's pages, so that its misses are counted.
        ``landed``: a landing record (:mod:`tierkv.store.landed`): the pages are read
        layer by layer across all of them, each layer announced in the record as it
        lands, for a consumer that starts on the first layers meanwhile (DRAM pages are
        then copied with the lock held).
        """
        with self._lock:
            self._check_open()
            blob = self._keys(tokens, tenant)
            total = len(blob) // KEY_BYTES
            if isinstance(out, (list, tuple)):
                raise InputError(GET_LIST_MESSAGE)
            rows = page_rows(out, self.layout, "get(out=...)", max(total, 0))
            if not rows.flags.writeable:
                raise InputError("get(out=...): the output buffer is read-only")
            want = rows.shape[0]
            check_requested(requested, want)
            if requested is None:
                requested = want
            self._announce(blob, from_get=True)
            lead = self._lead(blob, want)
            if landed is not None:
                return self._get_rest(blob, tenant, rows, want, requested, lead, 0, check_record(landed))
            fast = self._fast_lead(lead)
            if not fast:
                return self._get_rest(blob, tenant, rows, want, requested, lead, 0)
            assert self._fast is not None
            slots = lead.slots[:fast]
            token = self._begin_unlocked(self._fast, slots)
        # The leading DRAM pages, copied without the lock (their slots are held back from
        # reuse until the copy ends), then the rest under it as before.
        start = time.perf_counter()
        try:
            self._fast.read(slots, rows[:fast])
        except BaseException:
            with self._lock:
                self._end_unlocked(self._fast, token)
            raise
        seconds = time.perf_counter() - start
        with self._lock:
            self._end_unlocked(self._fast, token)
            self._transfers.count_served(self._fast.name, lead.keys_of(0, fast), seconds)
            # The pages copied are the result where a close waited for this copy, and where
            # they are all the get wanted (most gets: nothing below DRAM to look up or read).
            if self._closed or fast == want:
                self._counters.events["pages_requested"] += requested
                self._counters.events["pages_hit"] += fast
                return GetResult(fast, fast * self.layout.tokens_per_page, (self._fast.kind,) * fast)
            rest = self._lead(blob[fast * KEY_BYTES:], want - fast)
            return self._get_rest(blob, tenant, rows, want, requested, rest, fast)

    def lend(self, tokens: Tokens, tenant: str | bytes = "", *, want: int,
             requested: int | None = None, whole: bool = False) -> Lent:
        """Lend the leading pages of ``tokens`` (up to ``want``) that lie in the DRAM tier,
        in place: the result names their rows in the tier's buffer (``DramTier.lend_fd``
        shares it), which keep these pages' bytes until :meth:`end_lend` (a page evicted
        meanwhile leaves its row to the borrower until then). For a reader that copies
        pages straight out of the store's memory instead of having them copied to it
        (``tierkv serve`` clients on the same machine). Counted as a get's hits; pages
        below DRAM are not lent (the run stops at the first), nor is anything by a store
        whose DRAM tier is not shared (page-locked) or not on top (``pages`` 0).
        ``whole``: all ``want`` pages or none, and nothing counted when none (a caller
        that gets them all another way then).
        """
        with self._lock:
            self._check_open()
            blob = self._keys(tokens, tenant)
            total = len(blob) // KEY_BYTES
            if isinstance(want, bool) or not isinstance(want, int) or not 0 <= want <= total:
                raise InputError(f"lend: want must be a page count in [0, {total}] (the full pages of the tokens), "
                                 f"got {want!r}")
            check_requested(requested, want)
            self._announce(blob, from_get=True)
            lead = self._lead(blob, want)
            n = lead.run_until(lead.levels != 0)
            if self._fast is None or self._fast.lend_fd() < 0:
                n = 0
            pool = self._fast.lend_id if self._fast is not None else 0   # a borrower's mapping stays current
            if whole and n < want:
                return Lent(0, 0, (), -1, pool)
            self._counters.events["pages_requested"] += want if requested is None else requested
            self._counters.events["pages_hit"] += n
            if not n or self._fast is None:
                return Lent(0, 0, (), -1, pool)
            slots = tuple(int(x) for x in lead.slots[:n])
            token = self._begin_unlocked(self._fast, slots)
            self._lends.add(token)
            self._transfers.count_served(self._fast.name, lead.keys_of(0, n), 0.0)
            return Lent(n, n * self.layout.tokens_per_page, slots, token, self._fast.lend_id)

    def lend_pool(self) -> tuple[int, int, int, int]:
        """``(memfd, slots, slot_bytes, pool)``: the DRAM tier's buffer whose rows :meth:`lend`
        names, for a reader in another process to map, and its identity (which every
        :class:`Lent` carries: a reader holding another buffer's mapping, a restarted
        daemon's, must map this one first); ``(-1, 0, 0, 0)`` when this store lends nothing
        (no DRAM tier on top, or a page-locked one)."""
        with self._lock:
            self._check_open()
            tier = self._fast
            fd = tier.lend_fd() if tier is not None else -1
            return (fd, tier.num_slots, tier.slot_bytes, tier.lend_id) if tier is not None and fd >= 0 else (-1, 0, 0, 0)

    def end_lend(self, token: int) -> None:
        """The borrower of :meth:`lend`'s ``token`` is done with its rows (once per lend;
        InputError for a token not lent). A close waits up to :attr:`CLOSE_LEND_GRACE_S`
        for open lends to end, then ends them itself (a borrower's mapping keeps the bytes:
        nothing writes the rows once the store is closed); ending one after that is a no-op."""
        with self._lock:
            if token < 0 or (self._closed and token not in self._lends):   # no pages; or ended by close
                return
            if self._fast is None or token not in self._lends or not self._fast.lent(token):
                raise InputError(f"end_lend: no lend {token} is open")
            self._lends.discard(token)
            self._end_unlocked(self._fast, token)

    def _fast_lead(self, lead: Lead) -> int:
        """How many leading pages of ``lead`` to copy out of the DRAM tier without the lock:
        all of its leading run there, when that run is worth unlocking for."""
        if self._fast is None or not len(lead):
            return 0
        n = lead.run_until(lead.levels != 0)
        return n if n * self.layout.page_bytes >= UNLOCKED_COPY_BYTES else 0

    def _begin_unlocked(self, tier: DramTier, slots: Sequence[int]) -> int:
        """With the lock held: a copy of ``slots`` of ``tier`` is about to run without it."""
        self._copying += 1
        return tier.begin_copy(slots)

    def _end_unlocked(self, tier: DramTier, token: int) -> None:
        """With the lock held again: the copy ``token`` is done (slots freed meanwhile may
        be reused from here on, so whatever checks them happened before)."""
        tier.end_copy(token)
        self._copying -= 1
        self._copies_done.notify_all()   # close waits for copies apart from lends, then for lends

    def _private_rows(self, n: int, width: int) -> np.ndarray:
        """``n`` rows of ``width`` bytes of the store's own (with the lock held): one buffer
        kept from get to get up to PRIVATE_ROWS_BYTES, since a fresh one costs page faults
        on every byte (about a third of a 47 MB NVMe get's time here), a fresh one past that."""
        need = n * width
        if need > PRIVATE_ROWS_BYTES:
            return aligned_empty(need).reshape(n, width)
        if self._private is None or self._private.size < need:   # on huge pages: tiers read into it
            self._private = aligned_empty(max(need, 0 if self._private is None else min(2 * self._private.size,
                                                                                          PRIVATE_ROWS_BYTES)),
                                          huge=True)
        return self._private[:need].reshape(n, width)

    def _get_rest(self, blob: bytes, tenant: str | bytes, rows: np.ndarray, want: int, requested: int,
                  lead: Lead, first: int, landed: np.ndarray | None = None) -> GetResult:
        """The part of a get after its first ``first`` pages (copied from the DRAM tier
        already): ``lead`` is of the pages from there on. With the lock held."""
        # Pages from a tier below DRAM are verified against their checksums, and may be
        # promoted: both from a buffer of the store's own, then copied out, so that a
        # caller writing into ``out`` meanwhile (a client's shared buffer, another thread)
        # can neither fail a good page's check nor become a page's cached copy.
        private = bool((lead.levels != 0).any())
        promotes = not self.read_only and self.config.promote_on_hit
        if landed is not None:
            # Layer by layer, straight into the caller's rows unless pages will be promoted
            # from them (a client could change them between the check and the copy) or they
            # are not aligned for O_DIRECT (then each group is copied out); a page
            # that fails its check there is read again into the store's own row before it is
            # quarantined (Transfers.read_layered).
            read_from = [self._manager.tiers[int(v)] for v in np.unique(lead.levels) if v != NO_SOURCE]
            on_disk = [t for t in read_from if t.persistent]
            unaligned = bool(on_disk) and not (rows.shape[1] % ALIGN == 0
                                               and is_aligned(rows, max(t.mem_align for t in on_disk)))
            private = len(lead) > 0 and (private and promotes or unaligned)
        dst = self._private_rows(len(lead), rows.shape[1]) if private else rows[first:]
        if landed is not None:
            got = self._read_layered(lead, dst, rows[first:] if private else None, landed)
        else:
            got = self._transfers.read(lead, dst)
            if private:
                rows[first:first + got] = dst[:got]
        levels = lead.levels[:got]
        loaded = first + got
        tiers = (self._kinds[0],) * first + tuple(map(self._kinds.__getitem__, levels.tolist()))
        if got and promotes and levels.any():
            with self._placing(blob, tenant):
                self._promote(lead, levels, dst, blob[:first * KEY_BYTES])
        if self._peering is not None and loaded == first + len(lead) and loaded < want:
            # The pages that follow the local ones, from another node's DRAM: checked
            # against the peer's checksum (in a buffer of the store's own), then kept here.
            keys = split_keys(blob)
            fetched = aligned_empty((want - loaded) * rows.shape[1]).reshape(want - loaded, rows.shape[1])
            got = self._peering.fetch(keys[:want], loaded, fetched, tenant_salt(tenant))
            if got:
                rows[loaded:loaded + got] = fetched[:got]
                self._counters.tier_hits[TierKind.PEER.value] += got
                # Kept here as far as this store holds them with their prefix; the
                # caller has every fetched page either way.
                room = sum(t.num_slots for t in self._manager.tiers) - loaded
                if room > 0:
                    with self._placing(blob, tenant):
                        self._store(keys, fetched[:min(got, room)], loaded)
                    if first:   # the first pages were copied without the lock: one may have left since
                        self._manager.drop_orphans(keys[loaded:loaded + min(got, room)])
                tiers += (TierKind.PEER,) * got
                loaded += got
        self._counters.events["pages_requested"] += requested
        self._counters.events["pages_hit"] += loaded
        return GetResult(loaded, loaded * self.layout.tokens_per_page, tiers)

    def _read_lead(self, lead: Lead, rows: np.ndarray, *, serve: bool = True) -> int:
        """Read ``lead`` into ``rows`` (through the store's own rows where a page comes from
        below DRAM, checked there first, as any get); how many leading pages. ``serve=False``:
        the store's own read, not counted as served. Lock held."""
        below = bool((lead.levels != 0).any())
        dst = self._private_rows(len(lead), rows.shape[1]) if below else rows
        got = self._transfers.read(lead, dst, serve=serve)
        if below:
            rows[:got] = dst[:got]
        return got

    def splice(self, tokens: Tokens, start: int, end: int, replacement: Tokens, *, rope: Rope,
               tenant: str | bytes = "") -> SpliceResult:
        """An agent's edit of a cached prompt: ``tokens[start:end]`` replaced by
        ``replacement`` (empty: a deletion; ``start == end``: an insertion). The pages
        past the edit (for a deletion, from the page it is in) are moved from the cached
        ones to their new positions, keys rotated by ``rope`` (the model's,
        :meth:`Rope.from_model`), and stored as *derived* pages of the edited prompt,
        which only ``get(accept="derived")`` and ``lookup(accept="derived")`` return. The
        pages before the edit keep their keys; the engine prefills the tokens between them
        and the derived pages as usual (:attr:`SpliceResult.prefill_from` to
        ``prefill_to``; none for a deletion) and puts them. See :func:`tierkv.splice.ops.splice`."""
        from tierkv.splice.ops import splice
        self._check_writable_open("splice needs")
        return splice(self, tokens, start, end, replacement, rope=rope, tenant=tenant)

    def origins(self, tokens: Tokens, tenant: str | bytes = "") -> list[Origin | None]:
        """Where each derived page of ``tokens`` came from (:class:`~tierkv.store.derived.Origin`:
        the splice, the positions moved, the cached pages its rows were copied from), for
        the pages ``lookup(tokens, tenant, accept="derived")`` counts as derived, in
        order; None for one whose origin was not recorded. Reads no page."""
        self._check_open()
        return derived.origins(self, tokens, tenant)

    def truncate(self, tokens: Tokens, start: int, end: int, *, rope: Rope, tenant: str | bytes = "") -> SpliceResult:
        """:meth:`splice` deleting ``tokens[start:end]`` (history trimmed, a tool output dropped)."""
        return self.splice(tokens, start, end, np.zeros(0, np.uint32), rope=rope, tenant=tenant)

    def insert(self, tokens: Tokens, at: int, inserted: Tokens, *, rope: Rope, tenant: str | bytes = "") -> SpliceResult:
        """:meth:`splice` inserting ``inserted`` before ``tokens[at]``."""
        return self.splice(tokens, at, at, inserted, rope=rope, tenant=tenant)

    def _load_for_push(self, chain: Sequence[PageKey], start: int, rows: np.ndarray, salt: bytes,
                       deadline: float) -> int:
        """DualPath's helper (:mod:`tierkv.dualpath.push`): load ``chain[start:]`` (up to the
        rows of ``rows``) for another node, from this store's tiers and then its peers, into
        ``rows``; how many leading pages. The pages are not kept here (this store need not
        hold their prefix), promoted or counted as this store's hits. Waits for the store's
        lock until ``deadline``, but finds nothing at once where the lock's holder is a
        get of this node's waiting on a helper's push (two nodes that are each other's
        helper, each waiting on the other's push with its lock held)."""
        while not self._lock.acquire(timeout=PUSH_LOCK_POLL_S):
            peering = self._peering
            if time.monotonic() >= deadline or (peering is not None and peering.awaiting_push()):
                return 0
        try:
            self._check_open()
            keys = list(chain[start:start + rows.shape[0]])
            lead = self._lead(b"".join(keys), len(keys))
            got = self._read_lead(lead, rows) if len(lead) else 0
            if got == len(lead) < len(keys) and self._peering is not None:
                got += self._peering.fetch(chain[:start + len(keys)], start + got, rows[got:], salt, dualpath=False,
                                           deadline=deadline)
            self._counters.events["pages_loaded_for_peers"] += got
            return got
        finally:
            self._lock.release()

    def _read_layered(self, lead: Lead, dst: np.ndarray, out: np.ndarray | None, landed: np.ndarray) -> int:
        """Read ``lead`` into ``dst`` a layer at a time across its pages, announcing each in
        ``landed``; ``out``: the caller's rows, when ``dst`` is the store's own (each layer
        is copied out as it lands). With the lock held."""
        per = self.layout.page_bytes // self.layout.num_layers
        groups = layer_groups(self.layout.num_layers)
        ranges = [(a * per, b * per) for a, b in groups]
        n = lead.sourced()
        reset(landed)
        publish(landed, PAGES, n)

        def after(k: int) -> None:
            if out is not None:
                a, b = ranges[k]
                out[:n, a:b] = dst[:n, a:b]
            publish(landed, LAYERS, groups[k][1])

        return self._transfers.read_layered(lead, dst, ranges, after, shared=out is None)

    def _announce(self, blob: bytes, *, from_get: bool, keys: list[PageKey] | None = None) -> None:
        """Show the policies every page a request needs (cached or not), once per request:
        an engine's get then put of the same prompt (on one thread) is one request; a put
        whose request a get has shown already in any other way passes ``announce=False``.
        Lookups are not announced: engines repeat them while a request waits."""
        if self.read_only:
            return
        if not from_get and blob == getattr(self._announced, "blob", None):
            self._announced.blob = None
            return
        self._manager.note_request(split_keys(blob) if keys is None else keys)
        self._announced.blob = blob if from_get else None

    def _promote(self, lead: Lead, levels: np.ndarray, rows: np.ndarray, before: bytes = b"") -> int:
        """Copy the first ``len(levels)`` pages of ``lead``, read into ``rows`` from the tiers
        ``levels`` name, up into the fastest tier, one plan per tier they came from.
        ``before``: the keys of the request's pages ahead of ``lead`` (loaded already),
        which the promotions must not evict either."""
        m = self._manager
        top = m.tiers[0].name
        keys = split_keys(lead.keys_of(0, len(levels)))
        protect = set(keys) | set(split_keys(before))
        promoted = 0
        for lvl in sorted(set(levels.tolist()) - {0}):
            idx = np.flatnonzero(levels == lvl).tolist()
            picked = [keys[i] for i in idx]
            plan = m.plan_promote(picked, top, protect)
            promoted += self._transfers.run(plan, rows, dict(zip(picked, idx)), source=m.tiers[lvl].name)
            self._count_plan(plan)
        self._counters.events["promotions"] += promoted
        return promoted

    def put(self, tokens: Tokens, pages: PageSource, tenant: str | bytes = "", *,
            announce: bool = True, unfilled: int = 0) -> PutResult:
        """Store ``pages[i]`` as the KV of the ``i``-th full page of ``tokens``.

        ``pages`` is one batch, or a list (or tuple) of separate pages, each a tensor
        ``[*layout.page_shape]`` in the layout's dtype or raw bytes ``uint8 [page_bytes]``:
        the DRAM and uncoded NVMe tiers copy those from where they are, without a stacked
        batch in between.

        Pages already cached are skipped. Room is made by the policy: victims are
        demoted to the next tier down or dropped. Raises CapacityError when the batch
        is larger than all tiers together. ``announce=False``: this put belongs to a
        request a ``get`` already showed the eviction policy (an engine adapter that
        knows its requests), possibly grown by what it generated, so it is not shown as
        another request. ``unfilled``: the first rows hold no data, because the caller
        pinned those pages as stored; if one of them has gone since (it failed its
        checksum under another request), nothing is stored, since its row is no page.
        """
        result = self._put(tokens, pages, tenant, announce, unfilled)
        # Outside the lock: where the index's commits fall behind, the next window is
        # bounded by waiting for the one being applied (tierkv.store.commits). Read once:
        # a close meanwhile drops the group (whose throttle then returns at once).
        group = self._index.group if self._index is not None else None
        if group is not None:
            group.throttle()
        return result

    def _put(self, tokens: Tokens, pages: PageSource, tenant: str | bytes, announce: bool,
             unfilled: int) -> PutResult:
        with self._lock:
            self._check_open()
            if self.read_only:
                raise InputError(f"the store at {self._dir} was opened read-only; put needs the writer")
            blob = self._keys(tokens, tenant)
            keys = split_keys(blob)
            rows: Rows = (page_list(pages, self.layout, "put(pages=...)", len(keys))
                          if isinstance(pages, (list, tuple)) else
                          page_rows(pages, self.layout, "put(pages=...)", len(keys), lists=True))  # type: ignore[arg-type]
            check_unfilled(unfilled, rows.shape[0])
            if announce:
                self._announce(blob, from_get=False, keys=keys)
            held = self._manager.held(blob[:unfilled * KEY_BYTES]) if unfilled else []
            gone = next((j for j, h in enumerate(held) if not h), None)
            if gone is not None:
                log.warning("put: page %d was pinned as stored but has gone; its row holds no data, nothing is "
                            "stored", gone)
                return PutResult(0, gone, 0)
            with self._placing(blob, tenant):
                begun = self._store_begin(keys, rows)
            if isinstance(begun, tuple):
                stored, new = begun
                return PutResult(stored, rows.shape[0] - new, new - stored)
            assert self._fast is not None
            slots = begun.placed.slots
            token = self._begin_unlocked(self._fast, slots)
        # The new pages bound for the DRAM tier, written without the lock into the slots
        # reserved for them; published under it once written, if still theirs.
        start = time.perf_counter()
        wrote = False
        try:
            self._fast.write(slots, gather_rows(rows, begun.row_of[begun.placed.index]))
            wrote = True
        finally:
            with self._lock:
                try:
                    with self._placing(blob, tenant):
                        done = self._transfers.finish_deferred(begun.plan, begun.placed,
                                                               time.perf_counter() - start, wrote, begun.removed)
                finally:
                    self._end_unlocked(self._fast, token)
                stored = begun.stored + done
                self._counters.events["pages_stored"] += done
                self._count_plan(begun.plan)
        return PutResult(stored, rows.shape[0] - begun.new, begun.new - stored)

    def _placing(self, blob: bytes, tenant: str | bytes) -> contextlib.AbstractContextManager[None]:
        """Pages placed meanwhile among ``blob``'s keys are the tenant's (for the peer server)."""
        if self._peering is None:
            return contextlib.nullcontext()
        return self._peering.placing(blob, tenant_salt(tenant))

    def _store_begin(self, keys: list[PageKey], rows: Rows) -> tuple[int, int] | _Begun:
        """:meth:`_store` of a put: done, (stored, new); or, where enough new pages go to
        the DRAM tier, everything but their write, which the caller makes without the lock."""
        plan, row_of, new = self._plan_new(keys, rows, 0)
        removed = self._manager.removed
        if self._fast is None or len(new) * self.layout.page_bytes < UNLOCKED_COPY_BYTES:
            stored = self._transfers.run(plan, rows, row_of)
            self._counters.events["pages_stored"] += stored
            self._count_plan(plan)
            return stored, len(new)
        stored, placed = self._transfers.run_deferring(plan, rows, row_of, self._fast.name)
        if placed is None or not len(placed):
            self._counters.events["pages_stored"] += stored
            self._count_plan(plan)
            return stored, len(new)
        self._counters.events["pages_stored"] += stored
        return _Begun(plan, placed, row_of, stored, len(new), removed)

    def _plan_new(self, keys: list[PageKey], rows: Rows, first: int) -> tuple[MovePlan, np.ndarray, NewPages]:
        """The plan that stores ``rows[i]`` as page ``first + i`` of ``keys`` where not cached:
        (plan, the row of each new page in the order planned, the new pages)."""
        n = rows.shape[0]
        mine = keys[first:first + n]
        blob = b"".join(mine)
        held = self._manager.held_mask(blob)
        # Each page's parent is the key before it: the page ahead of ``first``, then ours.
        parents = ((keys[first - 1] if 0 < first <= len(keys) else NO_PARENT) + blob)[:len(blob)]
        has = np.ones(len(mine), dtype=bool)
        has[:1] = 0 < first <= len(keys)
        if not held.any():   # all new: a put's usual case
            fresh = np.arange(len(mine), dtype=np.int64)
            new = NewPages(mine, blob, parents, has)
            prefix = keys[:first]
        else:
            fresh = np.flatnonzero(~held)
            new = NewPages(mine, blob, parents, has).take(~held)
            prefix = keys[:first] + [k for k, h in zip(mine, held.tolist()) if h]
        return self._manager.plan_new(new, self.layout.page_bytes, prefix=prefix), fresh, new

    def _store(self, keys: list[PageKey], rows: Rows, first: int) -> tuple[int, int]:
        """Store ``rows[i]`` as page ``first + i`` of ``keys`` unless cached; (stored, new)."""
        plan, row_of, new = self._plan_new(keys, rows, first)
        stored = self._transfers.run(plan, rows, row_of)
        self._counters.events["pages_stored"] += stored
        self._count_plan(plan)
        return stored, len(new)

    def _count_plan(self, plan: MovePlan) -> None:
        """Count the pages a plan evicted, and those it dropped from the store."""
        self._counters.events["pages_dropped"] += plan.dropped
        self._counters.events["evictions"] += plan.evicted

    def prefetch(self, tokens: Tokens, tenant: str | bytes = "") -> Future[int]:
        """Promote the leading cached pages of ``tokens`` to the fastest tier, in the background.

        The future's result is how many of those pages reside in the fastest tier afterwards.
        """
        with self._lock:
            self._check_open()
            blob = self._keys(tokens, tenant)
        try:
            return self._prefetcher.submit(self._prefetch, blob, tenant)
        except RuntimeError:  # closed between the check and the submit
            self._check_open()
            raise

    def _prefetch(self, blob: bytes, tenant: str | bytes) -> int:
        with self._lock:
            self._check_open()
            if self.read_only:
                return 0
            lead = self._lead(blob, len(blob) // KEY_BYTES)
            slow = lead.take(lead.levels != 0)
            if len(slow):
                staging = np.empty((len(slow), self.layout.page_bytes), dtype=np.uint8)
                loaded = self._transfers.read(slow, staging, serve=False)
                with self._placing(blob, tenant):
                    self._promote(slow, slow.levels[:loaded], staging)
            return int((self._lead(blob, len(lead)).levels == 0).sum())

    def pin(self, tokens: Tokens, tenant: str | bytes = "", *, owner: int | None = None) -> int:
        """Pin the leading cached pages so no policy evicts them; returns how many were pinned.

        Each call is remembered until an ``unpin`` of the same tokens (or tokens that
        extend the pages it pinned) by the same ``owner`` releases it. ``owner``: for a
        service pinning on behalf of its clients (``tierkv serve``: one per connection),
        so that one client's unpin, or its end (:meth:`release_pins`), never releases
        another's pin; None, the default, is the store's own callers.
        """
        with self._lock:
            self._check_writable_open()
            return self._pins.pin(self._manager.leading(self._keys(tokens, tenant), 1 << 62), owner)

    def unpin(self, tokens: Tokens, tenant: str | bytes = "", *, owner: int | None = None) -> int:
        """Release one earlier ``pin`` of these tokens by ``owner``; returns how many pages it
        unpinned.

        Exactly the pages that pin took are released: not pages cached since, nor pins
        other holders took on longer prompts. Of the pins ``owner`` has outstanding whose
        pages are a prefix of ``tokens``' pages, the longest is released (see
        :mod:`tierkv.store.pins`). A page that has left the store since (one that failed
        its checksum, say) took its pins with it and is not counted, even if it was
        stored again. Returns 0 when no such pin is outstanding.
        """
        with self._lock:
            self._check_writable_open()
            return self._pins.unpin(self._keys(tokens, tenant), owner)

    def release_pins(self, owner: int) -> int:
        """Release every pin ``owner`` holds (a client of a service that went away);
        returns how many pages that unpinned."""
        with self._lock:
            self._check_writable_open()
            return self._pins.release(owner)

    def _check_writable_open(self, what: str = "pin/unpin need") -> None:
        self._check_open()
        if self.read_only:
            raise InputError(f"{what} the writer; the store at {self._dir} was opened read-only")

    def stats(self) -> StoreStats:
        """A snapshot of the per-tier and store-wide counters."""
        with self._lock:
            dualpath = self._peering.dualpath_stats() if self._peering is not None else None
            conv = self._converter
            table_bytes, policy_bytes = self._manager.memory_bytes()
            index_bytes = self._index.file_bytes() if self._index is not None and not self._closed else 0
            return self._counters.snapshot(self._manager.tiers, dualpath,
                                           lossy=(conv.pending, conv.waiting) if conv is not None else (0, 0),
                                           memory=(table_bytes, policy_bytes, index_bytes))

    def wait_converted(self, timeout_s: float | None = None) -> int:
        """Wait until the lossy tier (``lossy_bits``, docs/lossy.md) has converted the pages
        queued for it, or ``timeout_s`` (seconds, None: no limit) passes; returns how many
        are left, those kept back (cached children or pins need them exact) included.
        0 without a lossy tier."""
        self._check_open()
        return self._converter.wait(timeout_s) if self._converter is not None else 0

    def flush(self) -> None:
        """A durability barrier: every page that a ``put`` (or an eviction) had written to a
        persistent tier before this call is durable when it returns.

        With ``durability = "window"`` this runs the group commit now (the tiers'
        ``fdatasync``, then one index commit) instead of waiting for the window; with
        "put" everything is durable already. Pages held only in DRAM stay there (they
        reach NVMe when evicted, or at close). Raises TierIOError if that commit, or a
        window since the last ``flush``, failed: some of those pages are then not
        durable (misses after a restart, never wrong bytes). Read-only stores: no-op.
        """
        with self._lock:
            self._check_open()
            if self._index is not None and not self.read_only:
                self._index.sync()

    def close(self) -> None:
        """Finish background work, flush and release every tier, the index and the lock.

        Everything is released even when the write-back of volatile pages or the last
        group commit (:meth:`flush`) fails (that error is raised afterwards, and the
        store is not marked cleanly closed, so the next open checks its records). Safe
        to call from a prefetch future's callback.
        A close that finds another one running waits for it to release everything
        (except on the prefetch worker, which that close may be waiting for).
        """
        on_prefetcher = threading.current_thread().name.startswith(_PREFETCH_THREAD)
        with self._lock:
            first = not self._closed
            self._closed = True
        if not first:
            if not on_prefetcher:
                self._released.wait()
            return
        try:
            self._close()
        finally:
            self._released.set()

    def _close(self) -> None:
        # From a prefetch callback this runs on the prefetch worker, which cannot join itself.
        self._prefetcher.shutdown(wait=not threading.current_thread().name.startswith(_PREFETCH_THREAD))
        if self._peering is not None:  # stop serving before the DRAM tier goes away
            self._peering.close()
        if self._converter is not None:
            self._converter.stop()
        with self._lock:
            self._wait_for_copies()   # puts and gets copying without the lock finish first
            failed: BaseException | None = None
            try:
                if self.config.persist_on_close and not self.read_only:
                    self._write_back()
            except BaseException as exc:  # noqa: BLE001 - raised below, once everything is released
                failed = exc
            if self._converter is not None:   # what waits for conversion (the write-back's pages too)
                self._converter.save()
            try:
                self._release(clean=failed is None)
            finally:
                if failed is not None:
                    raise failed

    def _wait_for_copies(self) -> None:
        """With the lock held: until no copy runs without it (close waits here). Copies
        are short; lends last as long as their borrowers: after CLOSE_LEND_GRACE_S the
        ones still open are ended here, with a warning (a borrower that never calls
        end_lend must not hang the close)."""
        while self._copying > len(self._lends):
            self._copies_done.wait()
        deadline = time.monotonic() + self.CLOSE_LEND_GRACE_S
        while self._lends and time.monotonic() < deadline:
            self._copies_done.wait(deadline - time.monotonic())
        if self._lends and self._fast is not None:
            log.warning("close: %d lend(s) of DRAM rows still open after %.0f s; ending them (their borrowers' "
                        "mappings keep the bytes as they are)", len(self._lends), self.CLOSE_LEND_GRACE_S)
            for token in sorted(self._lends):
                self._end_unlocked(self._fast, token)
            self._lends.clear()
        while self._copying:   # copies begun meanwhile
            self._copies_done.wait()

    def _write_back(self) -> None:
        """Copy the pages only volatile tiers hold down to the persistent tier, for the next
        open. Writes that fail (a full disk, an I/O error) cost those pages, as in a put, and
        are logged as they happen; afterwards TierIOError says how many were lost, so that a
        close that persisted less than it could does not return as if it had."""
        plan = self._manager.plan_writeback()
        before = self._counters.events["demotions"]
        self._transfers.run(plan)
        lost = plan.moved - (self._counters.events["demotions"] - before)
        if lost > 0:
            raise TierIOError(f"close: {lost} of the {plan.moved} pages held only in volatile tiers could not be "
                              f"written back to {plan.moves[0].dst} (the warnings above say why); they are lost, "
                              "every page written before is durable")

    def _release(self, clean: bool) -> None:
        synced: TierIOError | None = None
        if self._index is not None and not self.read_only:
            try:
                self._index.sync()  # the last group commit, while the tiers are open
            except TierIOError as exc:
                log.warning("the last index commit at close failed: %s", exc)
                synced, clean = exc, False
        for t in self._manager.tiers:
            try:
                t.flush()
            except TierIOError as exc:  # a degraded fabric tier: its committed pages stay indexed
                log.warning("flush of the %s tier at close failed: %s", t.name, exc)
            try:
                t.close()
            except Exception:  # noqa: BLE001 - the other tiers, the index and the lock still go
                log.exception("closing the %s tier failed", t.name)
        try:
            if self._index is not None:
                self._index.close()
                if not self.read_only and clean:
                    mark_clean(self._dir, True)
        finally:
            release_dir(self._lockfile)
            self._lockfile = None
        if synced is not None:
            raise synced

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        tiers = ", ".join(f"{t.name}:{t.num_slots}" for t in self._manager.tiers)
        return f"Store({str(self._dir)!r}, {tiers}, {'closed' if self._closed else 'open'})"
