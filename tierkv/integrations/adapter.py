"""The engine adapter, scheduler side: what is cached, what to load, what to store, and events.

Shaped after vLLM's offloading connector so that a vLLM ``KVConnectorBase_V1`` or an
SGLang HiCache storage backend is a thin shim (docs/integration.md maps them method by
method). A serving engine's scheduler calls :class:`OffloadScheduler`; it decides and
hands out frozen :class:`LoadSpec` / :class:`StoreSpec` objects, and the engine's worker
executes them with :class:`tierkv.integrations.worker.OffloadWorker`. Nothing here moves
bytes.

The protocol, per request:

1. ``lookup(tokens)``: how many leading tokens the store can serve, in whole pages, and
   from which tiers. It never offers the whole prompt: the engine must compute at
   least the last token to get its logits.
2. ``prepare_load(tokens, block_ids)``, once per scheduled request even when the
   lookup found nothing: it pins the pages to load (no policy evicts them while the
   worker copies) and returns a :class:`LoadSpec`, or ``None`` when there is nothing to
   load. It is where the request counts in ``Store.stats()`` (its pages requested,
   misses included) and is shown to the eviction policy. After the worker's transfer,
   ``complete_load(spec)`` unpins them.
3. ``prepare_store(tokens, block_ids)`` pins the pages the store already holds and
   returns a :class:`StoreSpec` for the rest (``None`` when there is nothing to store);
   after the worker's transfer, ``complete_store(spec, success)`` unpins, and on
   success records what became loadable. ``success=False`` rolls back: the store
   publishes a page only after its bytes are written, so a failed transfer leaves
   misses, never wrong data.
4. ``take_events()``: :class:`OffloadEvent` records of pages that became loadable
   (``STORED``) and of pages that stopped being loadable (``REMOVED``, evicted from the
   last tier or dropped) since the previous call.

Engine block ``i`` of a spec holds the tokens of page ``first_page + i`` of the prompt;
an engine block holds exactly ``tokens_per_page`` tokens. Thread-safety: the methods
may be called from any thread (the store serializes them); specs are immutable.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from tierkv.store.api import LookupResult, Store
from tierkv.errors import InputError
from tierkv.keys import PageKey, Tokens, as_token_array, namespace_digest, page_keys

# Stored prefixes followed for REMOVED events; the oldest are forgotten past this.
DEFAULT_TRACKED_PREFIXES = 4096
# Request ids prepare_load remembers for their prepare_store; the oldest are forgotten past this
# (a forgotten one only means that request's store is shown to the policy again).
REMEMBERED_REQUESTS = 4096


class EventKind(enum.Enum):
    """What happened to the pages of an :class:`OffloadEvent`."""

    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class OffloadEvent:
    """Pages ``first_page ..`` of a prompt under ``tenant`` became loadable, or stopped being.

    ``keys`` are tierkv page keys (16 bytes each, see :mod:`tierkv.keys`), in page order.
    A page counts as loadable while a prefix lookup reaches it, so a page behind an
    evicted one is reported REMOVED too: no prompt can load it any more.
    """

    kind: EventKind
    tenant: str
    first_page: int
    keys: tuple[PageKey, ...]
    tokens_per_page: int


@dataclass(frozen=True, eq=False)
class LoadSpec:
    """Load pages ``0 .. num_pages-1`` of ``tokens`` into ``block_ids`` (one block per page).

    ``tokens`` (read-only uint32) covers exactly those pages. The pages are pinned until
    ``complete_load``. ``request_tokens`` are the full pages of the request's whole
    prompt and ``requested_pages`` how many of them it could have loaded: the worker
    passes both to ``Store.get`` so that the request's misses are counted and the
    policy sees its whole prompt once.
    """

    job_id: int
    tenant: str
    tokens: np.ndarray = field(repr=False)
    block_ids: tuple[int, ...]
    request_tokens: np.ndarray | None = field(default=None, repr=False)
    requested_pages: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True, eq=False)
class StoreSpec:
    """Store pages ``first_page .. num_pages-1`` of ``tokens`` from ``block_ids``.

    Pages before ``first_page`` are already in the store and pinned until
    ``complete_store``; ``block_ids[i]`` holds page ``first_page + i``. ``announced``:
    the request was shown to the eviction policy by its ``prepare_load`` (same
    ``request_id``), so the store does not show it again.
    """

    job_id: int
    tenant: str
    tokens: np.ndarray = field(repr=False)
    first_page: int
    block_ids: tuple[int, ...]
    announced: bool = False

    @property
    def num_pages(self) -> int:
        """Pages ``tokens`` covers, the already stored ones included."""
        return self.first_page + len(self.block_ids)


@dataclass
class _Tracked:
    tenant: str
    tokens: np.ndarray
    keys: list[PageKey]


class OffloadScheduler:
    """The scheduler half of the adapter over one open :class:`~tierkv.store.api.Store`.

    The store must stay open while the scheduler is used; closing it is the caller's.
    """

    def __init__(self, store: Store, *, tracked_prefixes: int = DEFAULT_TRACKED_PREFIXES) -> None:
        if tracked_prefixes < 1:
            raise InputError(f"tracked_prefixes must be >= 1, got {tracked_prefixes}")
        self.store = store
        self.tokens_per_page = store.layout.tokens_per_page
        self._lock = threading.Lock()
        self._job_ids = itertools.count(1)
        self._loads: dict[int, LoadSpec] = {}
        self._stores: dict[int, StoreSpec] = {}
        self._namespaces: dict[str, bytes] = {}
        self._tracked: OrderedDict[PageKey, _Tracked] = OrderedDict()
        self._tracked_limit = tracked_prefixes
        self._announced: set[PageKey] = set()
        self._events: list[OffloadEvent] = []
        self._loaded_requests: OrderedDict[str, None] = OrderedDict()   # request ids prepare_load has seen

    # -- lookups ------------------------------------------------------------------------
    def lookup(self, tokens: Tokens, tenant: str = "", *, leave_last_token: bool = True) -> LookupResult:
        """The leading pages of ``tokens`` the store can serve. Does no I/O.

        With ``leave_last_token`` (the default) at most ``(len(tokens) - 1) //
        tokens_per_page`` pages, so the engine still computes the last token's logits;
        engines that apply that rule themselves (SGLang's radix cache) pass False.
        """
        return self._lookup(as_token_array(tokens), tenant, leave_last_token, count=True)

    def _lookup(self, arr: np.ndarray, tenant: str, leave_last_token: bool, count: bool) -> LookupResult:
        full = self.store.lookup(arr, tenant, count=count)
        usable = min(full.cached_pages, self._usable_pages(arr, leave_last_token))
        return LookupResult(usable, usable * self.tokens_per_page, full.total_pages, full.tier_ranks[:usable])

    def _usable_pages(self, arr: np.ndarray, leave_last_token: bool) -> int:
        """Pages of ``arr`` an engine may load: all full pages, or all but the last token's."""
        return (max(arr.size - 1, 0) if leave_last_token else arr.size) // self.tokens_per_page

    def page_keys(self, tokens: Tokens, tenant: str = "") -> list[PageKey]:
        """The store's keys of every full page of ``tokens`` under ``tenant``."""
        ns = self._namespaces.get(tenant)
        if ns is None:
            ns = self._namespaces[tenant] = namespace_digest(self.store.config.model_id, self.store.layout, tenant)
        return page_keys(tokens, self.store.layout, ns)

    # -- loads ----------------------------------------------------------------------------
    def prepare_load(self, tokens: Tokens, block_ids: Sequence[int], tenant: str = "", *,
                     leave_last_token: bool = True, request_id: str | None = None) -> LoadSpec | None:
        """Pin the leading cached pages of ``tokens`` (at most ``len(block_ids)``) for loading.

        Returns ``None`` when no page can be loaded. The spec may cover fewer pages than
        ``lookup`` reported if some were evicted in between. ``leave_last_token`` as in
        :meth:`lookup`. Call it once per scheduled request, also when the lookup found
        nothing: a request with nothing to load is counted here (its pages are misses).
        With the engine's ``request_id``, the ``prepare_store`` of the same request (any
        thread, its prompt possibly grown by what it generated) is not shown to the
        eviction policy a second time.
        """
        if request_id is not None:
            with self._lock:
                self._loaded_requests[request_id] = None
                while len(self._loaded_requests) > REMEMBERED_REQUESTS:
                    self._loaded_requests.popitem(last=False)
        arr = as_token_array(tokens)
        whole = _frozen(arr[: arr.size // self.tokens_per_page * self.tokens_per_page])
        requested = self._usable_pages(arr, leave_last_token)
        n = min(len(block_ids), self._lookup(arr, tenant, leave_last_token, count=False).cached_pages)
        pinned = self.store.pin(arr[: n * self.tokens_per_page], tenant) if n else 0
        if pinned == 0:
            if whole.size:  # nothing to load: count the request's misses, show it to the policy
                self.store.get(whole, np.empty((0, self.store.layout.page_bytes), np.uint8), tenant,
                               requested=requested)
            return None
        spec = LoadSpec(next(self._job_ids), tenant, _frozen(arr[: pinned * self.tokens_per_page]),
                        tuple(int(b) for b in block_ids[:pinned]), whole, requested)
        with self._lock:
            self._loads[spec.job_id] = spec
        return spec

    def complete_load(self, spec: LoadSpec) -> None:
        """The worker is done with ``spec`` (loaded or not): unpin its pages."""
        with self._lock:
            if self._loads.pop(spec.job_id, None) is None:
                raise InputError(f"load job {spec.job_id} is not pending (completed twice, or not from this scheduler)")
        self.store.unpin(spec.tokens, spec.tenant)

    # -- stores ---------------------------------------------------------------------------
    def prepare_store(self, tokens: Tokens, block_ids: Sequence[int], tenant: str = "", *,
                      request_id: str | None = None) -> StoreSpec | None:
        """Plan storing the full pages of ``tokens`` held in ``block_ids`` (block ``i`` = page ``i``).

        Pages the store already holds are pinned and skipped; returns ``None`` when every
        page is already stored (or ``tokens`` holds no full page). ``request_id`` as in
        :meth:`prepare_load`.
        """
        announced = False
        if request_id is not None:
            with self._lock:
                announced = request_id in self._loaded_requests
                self._loaded_requests.pop(request_id, None)
        arr = as_token_array(tokens)
        n = min(arr.size // self.tokens_per_page, len(block_ids))
        if n == 0:
            return None
        prefix = arr[: n * self.tokens_per_page]
        present = self.store.pin(prefix, tenant)
        if present == n:
            self.store.unpin(prefix, tenant)
            return None
        spec = StoreSpec(next(self._job_ids), tenant, _frozen(prefix), present,
                         tuple(int(b) for b in block_ids[present:n]), announced)
        with self._lock:
            self._stores[spec.job_id] = spec
        return spec

    def complete_store(self, spec: StoreSpec, success: bool = True) -> None:
        """The worker is done with ``spec``: unpin the present pages; on success record events.

        ``success=False`` rolls back: nothing is announced, and any page the worker did
        not publish stays a miss.
        """
        with self._lock:
            if self._stores.pop(spec.job_id, None) is None:
                raise InputError(f"store job {spec.job_id} is not pending (completed twice, or not from this scheduler)")
        if spec.first_page:
            self.store.unpin(spec.tokens[: spec.first_page * self.tokens_per_page], spec.tenant)
        if success:
            self._track(spec)

    # -- events ---------------------------------------------------------------------------
    def take_events(self) -> list[OffloadEvent]:
        """Events since the last call: pages stored, then pages no longer loadable.

        Removals are found by one key lookup per tracked prefix (no I/O). Only the last
        ``tracked_prefixes`` stored prefixes are followed; pages only older ones reach
        are forgotten without a REMOVED event.
        """
        with self._lock:
            visible: set[PageKey] = set()
            followed = list(self._tracked.items())
            for last, t in followed:
                n = self.store.lookup(t.tokens, t.tenant, count=False).cached_pages
                visible.update(t.keys[:n])
                if n == 0:
                    del self._tracked[last]
            gone = self._announced - visible
            events, self._events = self._events, []
            for _, t in followed:
                if not gone:
                    break
                idx = [i for i, k in enumerate(t.keys) if k in gone]
                if idx:
                    events.append(OffloadEvent(EventKind.REMOVED, t.tenant, idx[0],
                                               tuple(t.keys[i] for i in idx), self.tokens_per_page))
                    gone.difference_update(t.keys[i] for i in idx)
            self._announced &= visible
            return events

    def _track(self, spec: StoreSpec) -> None:
        keys = self.page_keys(spec.tokens, spec.tenant)
        n = self.store.lookup(spec.tokens, spec.tenant, count=False).cached_pages
        with self._lock:
            new = [(i, k) for i, k in enumerate(keys[:n]) if k not in self._announced]
            if new:
                self._events.append(OffloadEvent(EventKind.STORED, spec.tenant, new[0][0],
                                                 tuple(k for _, k in new), self.tokens_per_page))
                self._announced.update(k for _, k in new)
            # A longer prefix replaces the tracked prefixes it extends.
            for k in keys[:-1]:
                self._tracked.pop(k, None)
            self._tracked[keys[-1]] = _Tracked(spec.tenant, spec.tokens, keys)
            self._tracked.move_to_end(keys[-1])
            while len(self._tracked) > self._tracked_limit:
                self._tracked.popitem(last=False)

    def pending(self) -> tuple[int, int]:
        """Loads and stores prepared but not completed."""
        with self._lock:
            return len(self._loads), len(self._stores)


def external_key_tokens(key: str | bytes, tokens_per_page: int) -> np.ndarray:
    """One page of stand-in token ids naming a page by an engine's own key.

    For engines whose storage interface passes page keys instead of token ids (SGLang's
    HiCache storage: hex digests already chained over the prefix). Store each such
    page as a one-page prompt of these tokens: its tierkv key is then a function of the
    engine's key alone. The first four ids carry an xxh3-128 digest of ``key``; the
    rest are zero.
    """
    if tokens_per_page < 4:
        raise InputError(f"external keys need pages of at least 4 tokens, got {tokens_per_page}")
    raw = key.encode() if isinstance(key, str) else bytes(key)
    out = np.zeros(tokens_per_page, dtype=np.uint32)
    out[:4] = np.frombuffer(xxhash.xxh3_128_digest(raw), dtype="<u4")
    return out


def _frozen(tokens: np.ndarray) -> np.ndarray:
    out = np.array(tokens, dtype=np.uint32, copy=True)
    out.setflags(write=False)
    return out
