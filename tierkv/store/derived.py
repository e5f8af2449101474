"""Derived pages in the store: their keys, reads and writes, and where each came from.

A *derived* page (:mod:`tierkv.splice`) holds KV rows a splice moved from cached exact
pages to new positions: an approximation beyond the first layer, so it has keys of its
own (the chain continued through :func:`tierkv.keys.derived_seed` from the exact page
before it) that no exact get or lookup reaches. The :class:`~tierkv.store.api.Store`
methods that read or write them (``lookup``/``get`` with ``accept="derived"``,
``splice``, ``origins``) call the functions here with the store's lock held where they
say so.

Each derived page's *origin* (:class:`Origin`: the edit, the positions it moved by, the
cached pages its rows were copied from, when) is recorded by :class:`Provenance`: in
memory, and in the store's LMDB index (database ``derived:origins``, records sealed like
the page records) where the store has one. A splice records its pages' origins, durably,
*before* it stores them, so a page a crash leaves behind is never without one; origins
of pages the store no longer holds are dropped when it reopens and, while it runs, once
there are twice as many as at the last count (never fewer than :data:`PRUNE_MIN`).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from tierkv.errors import CorruptPageError, TierIOError
from tierkv.keys import KEY_BYTES, PageKey, Tokens, as_token_array, chain_keys, derived_seed, split_keys, tenant_salt
from tierkv.store.results import GetResult

if TYPE_CHECKING:
    from tierkv.store.api import Store
    from tierkv.store.index import PersistentIndex

log = logging.getLogger(__name__)

#: The edits a derived page can come from, by their code in a record.
MODES = ("truncate", "replace", "insert")
_ORIGIN = struct.Struct("<BqQQQdB")   # mode, delta, start, end, page, created, sources
_SOURCE = struct.Struct("<Q")          # a source page's index (its key before it)
_SEAL = struct.Struct("<Q")
#: Origins kept before the first count of which pages are still held.
PRUNE_MIN = 4096


@dataclass(frozen=True)
class Origin:
    """Where derived page ``page`` of an edited prompt came from: ``mode`` (``truncate``,
    ``replace`` or ``insert``) of the cached prompt's tokens ``start:end``, rows moved
    by ``delta`` positions from its pages ``sources`` (indices in the cached prompt;
    ``source_keys`` their exact keys), recorded at ``created`` (Unix seconds)."""

    page: int
    mode: str
    delta: int
    start: int
    end: int
    sources: tuple[int, ...]
    source_keys: tuple[PageKey, ...]
    created: float

    def pack(self, key: bytes) -> bytes:
        """The sealed record of this origin under derived page ``key``."""
        body = _ORIGIN.pack(MODES.index(self.mode), self.delta, self.start, self.end, self.page, self.created,
                            len(self.sources))
        body += b"".join(k + _SOURCE.pack(i) for k, i in zip(self.source_keys, self.sources))
        return body + _SEAL.pack(xxhash.xxh3_64_intdigest(key + body))

    @classmethod
    def unpack(cls, key: bytes, value: bytes) -> Origin:
        """Decode a record; CorruptPageError if its length, mode or seal is wrong."""
        item = KEY_BYTES + _SOURCE.size
        n = value[_ORIGIN.size - 1] if len(value) >= _ORIGIN.size else -1
        if n < 0 or len(value) != _ORIGIN.size + n * item + _SEAL.size:
            raise CorruptPageError(f"an origin record of {len(value)} bytes")
        body = value[:-_SEAL.size]
        if _SEAL.unpack(value[-_SEAL.size:])[0] != xxhash.xxh3_64_intdigest(key + body):
            raise CorruptPageError(f"the origin record of page {key.hex()} fails its seal")
        mode, delta, start, end, page, created, _ = _ORIGIN.unpack_from(body)
        if mode >= len(MODES):
            raise CorruptPageError(f"the origin record of page {key.hex()} has mode {mode}")
        at = [_ORIGIN.size + i * item for i in range(n)]
        return cls(page, MODES[mode], delta, start, end, tuple(_SOURCE.unpack_from(body, a + KEY_BYTES)[0] for a in at),
                   tuple(PageKey(bytes(body[a:a + KEY_BYTES])) for a in at), created)

    def to_dict(self) -> dict[str, object]:
        return {"page": self.page, "mode": self.mode, "delta": self.delta, "start": self.start, "end": self.end,
                "sources": list(self.sources), "source_keys": [k.hex() for k in self.source_keys],
                "created": self.created}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Origin:
        """The inverse of :meth:`to_dict` (a daemon's reply)."""
        def num(name: str) -> int:
            v = d[name]
            assert isinstance(v, int)
            return v
        sources, keys, created, mode = d["sources"], d["source_keys"], d["created"], d["mode"]
        assert isinstance(sources, list) and isinstance(keys, list) and isinstance(created, (int, float))
        assert isinstance(mode, str)
        return cls(num("page"), mode, num("delta"), num("start"), num("end"), tuple(int(s) for s in sources),
                   tuple(PageKey(bytes.fromhex(str(k))) for k in keys), float(created))


class Provenance:
    """The origins of a store's derived pages (module docstring). A writer keeps them in
    memory and in ``index`` (where there is one); a reader (``read_only``) reads the index
    at each call, as it reads page records. Not thread-safe: the store's lock serializes it."""

    def __init__(self, index: PersistentIndex | None, held: Callable[[bytes], list[bool]], *,
                 read_only: bool = False) -> None:
        self._index, self._held, self._read_only = index, held, read_only
        self._origins: dict[bytes, Origin] = {}
        self._prune_at = PRUNE_MIN
        if index is not None and not read_only:
            self._load(index)

    def _load(self, index: PersistentIndex) -> None:
        """Read the index's origins and drop those of pages not held (and unreadable ones:
        their pages are kept, their origins unknown). An origins database that cannot be
        read at all is cleared: derived pages are served as before, their origins None."""
        try:
            records = index.origins()
        except TierIOError as exc:
            log.warning("derived pages' origins could not be read (%s): they are forgotten, the pages kept", exc)
            index.clear_origins()
            return
        odd = [key for key, _ in records if len(key) != KEY_BYTES]
        for key, value in records:
            if len(key) == KEY_BYTES:
                try:
                    self._origins[key] = Origin.unpack(key, value)
                except CorruptPageError:
                    self._origins[key] = _UNREADABLE
        if odd:
            index.write_origins(delete=odd)
        if self._origins:
            self.prune()

    def __len__(self) -> int:
        return len(self._origins)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is a derived page's whose origin is recorded (a writer's)."""
        return key in self._origins

    def record(self, keys: Sequence[bytes], origins: Sequence[Origin]) -> None:
        """Record ``origins[i]`` for derived page ``keys[i]`` (durable on return where the
        store has an index: call before the pages are stored); TierIOError if that fails."""
        if len(self._origins) + len(keys) > self._prune_at:
            self.prune()   # before: these pages are not held yet
        if self._index is not None:
            self._index.write_origins(put=[(k, o.pack(k)) for k, o in zip(keys, origins)])
        self._origins.update(zip(keys, origins))

    def forget(self, keys: Iterable[bytes]) -> None:
        """Drop the origins of ``keys`` (pages a splice could not store)."""
        gone = [k for k in keys if self._origins.pop(k, None) is not None]
        if gone and self._index is not None:
            self._index.write_origins(delete=gone)

    def prune(self) -> int:
        """Drop the origins of pages no tier holds (and unreadable records); how many."""
        keys = list(self._origins)
        held = self._held(b"".join(keys)) if keys else []
        gone = [k for k, h in zip(keys, held) if not h or self._origins[k] is _UNREADABLE]
        for k in gone:
            del self._origins[k]
        if gone and self._index is not None:
            self._index.write_origins(delete=gone)
        self._prune_at = max(PRUNE_MIN, 2 * len(self._origins))
        return len(gone)

    def of(self, keys: Sequence[bytes]) -> list[Origin | None]:
        """The recorded origin of each derived page in ``keys`` (None: none recorded)."""
        if not self._read_only:
            return [self._origins.get(k) for k in keys]
        found: dict[bytes, Origin] = {}
        if self._index is not None:
            for key, value in self._index.origins(keys):
                try:
                    found[key] = Origin.unpack(key, value)
                except CorruptPageError:
                    pass
        return [found.get(k) for k in keys]


# An origin record that failed to decode (its page is kept, as any derived page; the record goes).
_UNREADABLE = Origin(-1, "truncate", 0, 0, 0, (), (), 0.0)


def origins_of(mode: str, delta: int, start: int, end: int, first: int, old_idx: np.ndarray,
               old_keys: bytes, tpp: int) -> list[Origin]:
    """The origins of derived pages ``first ..`` whose rows come from tokens ``old_idx``
    (one per row, page by page) of the cached prompt with exact keys ``old_keys``."""
    now = time.time()
    pages = old_idx.reshape(-1, tpp) // tpp
    out = []
    for j, src in enumerate(pages):
        sources = tuple(int(p) for p in np.unique(src))
        keys = tuple(PageKey(old_keys[p * KEY_BYTES:(p + 1) * KEY_BYTES]) for p in sources)
        out.append(Origin(first + j, mode, delta, start, end, sources, keys, now))
    return out


# -- the store's side (callers hold or take the store's lock as each says) -----------------
def derived_blob(store: Store, tokens: Tokens, tenant: str | bytes, blob: bytes, first: int) -> bytes:
    """The derived keys of ``tokens``' pages from ``first`` on (``blob``: its exact keys)."""
    salt = tenant_salt(tenant)
    previous = blob[(first - 1) * KEY_BYTES:first * KEY_BYTES] if first else store._namespace(salt)
    tpp = store.layout.tokens_per_page
    return chain_keys(as_token_array(tokens)[first * tpp:], tpp, derived_seed(previous))


def derived_levels(store: Store, dblob: bytes) -> bytes:
    """The levels of the leading cached pages of derived keys ``dblob`` (lock held), as a
    lookup counts them: up to the first whose fastest copy is on a degraded tier."""
    if store.read_only:
        return store._lead(dblob, len(dblob) // KEY_BYTES).levels.tobytes()  # type: ignore[no-any-return]
    m = store._manager
    levels: bytes = m.resident.prefix_values(dblob)
    down = m.unavailable_levels()
    if down:
        levels = levels[:next((i for i, v in enumerate(levels) if v in down), len(levels))]
    return levels


def get_derived(store: Store, tokens: Tokens, rows: np.ndarray, tenant: str | bytes, res: GetResult) -> GetResult:
    """``res`` (an exact get into ``rows``) continued with derived pages (takes the lock)."""
    with store._lock:
        store._check_open()
        blob = store._keys(tokens, tenant)
        first = res.pages
        if first >= rows.shape[0]:
            return res
        lead = store._lead(derived_blob(store, tokens, tenant, blob, first), rows.shape[0] - first)
        if not len(lead):
            return res
        got = store._read_lead(lead, rows[first:])
        store._counters.events["derived_pages"] += got
        n = first + got
        kinds = tuple(map(store._kinds.__getitem__, lead.levels[:got].tolist()))
        return GetResult(n, n * store.layout.tokens_per_page, res.tiers + kinds, derived=got)


def read_exact(store: Store, tokens: Tokens, tenant: str | bytes, first: int, rows: np.ndarray) -> int:
    """The exact pages ``first ..`` of ``tokens`` into ``rows`` (for a splice: the cached
    rows a moved suffix comes from), as far as they are cached; how many (takes the lock)."""
    with store._lock:
        store._check_open()
        blob = store._keys(tokens, tenant)
        lead = store._lead(blob[first * KEY_BYTES:], rows.shape[0])
        return store._read_lead(lead, rows, serve=False) if len(lead) else 0


def put_derived(store: Store, tokens: Tokens, tenant: str | bytes, first: int, rows: np.ndarray,
                origins: Sequence[Origin]) -> int:
    """Store ``rows[i]`` as derived page ``first + i`` of ``tokens``, its origin
    ``origins[i]`` recorded first (takes the lock); how many the store holds now. Their
    parents are the exact pages before ``first``. A page held already keeps its bytes and
    so its origin (two edits can make the same derived page from different rows)."""
    with store._lock:
        store._check_writable_open("splice needs")
        blob = store._keys(tokens, tenant)
        chain = blob[:first * KEY_BYTES] + derived_blob(store, tokens, tenant, blob, first)
        dblob = chain[first * KEY_BYTES:]
        keys = split_keys(dblob)
        new = [i for i, h in enumerate(store._manager.held(dblob)) if not h]
        store._provenance.record([keys[i] for i in new], [origins[i] for i in new])
        try:
            with store._placing(chain, tenant):   # tagged with the tenant, as any page of its request
                store._store(split_keys(chain), rows, first)
        finally:   # the origins of pages not stored (no room, or a failure) go again
            held = store._manager.held(dblob)
            store._provenance.forget(keys[i] for i in new if not held[i])
        return next((i for i, h in enumerate(held) if not h), len(held))


def origins(store: Store, tokens: Tokens, tenant: str | bytes) -> list[Origin | None]:
    """The origins of the derived pages a ``lookup(tokens, tenant, accept="derived")``
    would count, in page order (takes the lock)."""
    blob = store._keys(tokens, tenant)
    res = store._lookup(blob, tenant, False)
    if res.cached_pages >= res.total_pages:
        return []
    dblob = derived_blob(store, tokens, tenant, blob, res.cached_pages)
    with store._lock:
        store._check_open()
        n = len(derived_levels(store, dblob))
        return store._provenance.of(split_keys(dblob[:n * KEY_BYTES]))
