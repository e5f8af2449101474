"""The store's splice: an edited prompt's pages past the edit, moved from the cached ones.

For ``tokens`` with ``tokens[start:end]`` replaced by ``replacement`` (``delta = len(replacement)
- (end - start)`` positions of shift), the edited prompt's pages are in three parts:

- pages ``[0, start // P)`` (``P`` tokens a page): before the edit, the same tokens at the
  same positions: their exact keys are unchanged and they stay cached as they are;
- tokens ``[start // P * P, first * P)``: the replacement, and the rest of the page it ends
  in: the engine prefills them (``prefill_from``, ``prefill_to``) as usual, exact pages;
  none for a deletion;
- pages ``[first, ...)`` with ``first = ceil((start + len(replacement)) / P)`` (for a
  deletion, ``start // P``: the page the edit is in): no replacement token in them. Each
  token past the edit is the token ``delta`` positions earlier in the cached prompt, each
  before it the same token in place: rows copied from the cached pages (across page
  boundaries when ``delta`` is not a multiple of ``P``), keys rotated by ``delta``
  positions (:mod:`tierkv.splice.rope`), and stored as *derived* pages under keys of their
  own (:func:`tierkv.keys.derived_seed`), as far as the cached prompt's exact pages reach.
  So a deletion needs no prefill but the prompt's last partial page: an engine that
  loads only a prefix (vLLM) takes the exact pages and the derived ones as one run.

A derived page is never returned where exact ones were asked for (``accept="exact"``, the
default), and keys are salted per tenant, so tenants never share one. Each one's origin
(the edit, ``delta``, the cached pages its rows come from) is recorded before it is
stored (:class:`tierkv.store.derived.Origin`, ``Store.origins``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tierkv.errors import InputError
from tierkv.keys import Tokens, as_token_array
from tierkv.splice.rope import Rope, move_tokens
from tierkv.store import derived
from tierkv.tiers.aligned import aligned_empty

if TYPE_CHECKING:
    from tierkv.store.api import Store


@dataclass(frozen=True)
class SpliceResult:
    """What a splice made: the edited prompt's ``tokens``; ``prefill_from`` to ``prefill_to``
    (token indices) are what the engine prefills and puts as exact pages; derived pages
    ``first_derived`` to ``first_derived + derived`` were moved, and the leading ``stored``
    of them are held by the store now (fewer where it had no room); ``delta``: the
    positions they moved by."""

    tokens: np.ndarray
    prefill_from: int
    prefill_to: int
    first_derived: int
    derived: int
    stored: int
    delta: int


def splice(store: Store, tokens: Tokens, start: int, end: int, replacement: Tokens, *, rope: Rope,
           tenant: str | bytes = "") -> SpliceResult:
    """:meth:`tierkv.store.api.Store.splice` (module docstring)."""
    old = as_token_array(tokens)
    rep = as_token_array(replacement)
    for name, v in (("start", start), ("end", end)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InputError(f"splice: {name} must be a token index, got {v!r}")
    if not 0 <= start <= end <= old.size:
        raise InputError(f"splice: need 0 <= start <= end <= {old.size} (the prompt's tokens), got {start} and {end}")
    layout = store.layout
    tpp = layout.tokens_per_page
    new = np.concatenate([old[:start], rep, old[end:]])
    delta = int(rep.size) - (end - start)
    edit_end = start + int(rep.size)                   # the first token past the replacement, edited
    # The first page holding no replacement token: every row of it is cached (before the
    # edit, in place; after it, moved). For a deletion, the page the edit is in.
    first = start // tpp if not rep.size else -(-edit_end // tpp)
    # The cached prompt's exact pages, as far as they reach: the rows the moved pages come from.
    cached = store.lookup(old, tenant, count=False).cached_pages
    new_pages = new.size // tpp
    # Derived page j's token i = j*tpp + t comes from old token i (before the edit) or
    # i - delta (after it): all of it cached.
    last = min(new_pages, (cached * tpp + delta) // tpp)
    result = SpliceResult(new, start // tpp * tpp, min(first * tpp, new.size), first, 0, 0, delta)
    if last <= first or (start == end and not rep.size):   # nothing past the edit cached; or no edit at all
        return result
    # The cached pages the derived rows come from: the edit's own page (its rows before
    # the edit, for a deletion) and those from the first moved row on, not the span removed.
    new_idx = np.arange(first * tpp, last * tpp)
    old_idx = np.where(new_idx < start, new_idx, new_idx - delta)
    pages = np.unique(old_idx // tpp)
    runs = np.split(pages, np.flatnonzero(np.diff(pages) > 1) + 1)
    src = aligned_empty(pages.size * layout.page_bytes).reshape(pages.size, layout.page_bytes)
    at = 0
    for run in runs:
        got = derived.read_exact(store, old[:(int(run[-1]) + 1) * tpp], tenant, int(run[0]), src[at:at + run.size])
        if got < run.size:   # evicted since the lookup: as far as the rows are here
            missing = int(run[0]) + got
            bad = np.flatnonzero(old_idx // tpp >= missing)
            last = min(last, first + (int(bad[0]) // tpp if bad.size else last - first))
            break
        at += run.size
    if last <= first:
        return result
    n = last - first
    new_idx, old_idx = new_idx[:n * tpp], old_idx[:n * tpp]
    row_of = {int(p): i for i, p in enumerate(pages)}
    src_rows = np.array([row_of[int(p)] for p in old_idx // tpp], np.int64) * tpp + old_idx % tpp
    dst = aligned_empty(n * layout.page_bytes).reshape(n, layout.page_bytes)
    move_tokens(src, src_rows, old_idx, dst, new_idx - first * tpp, new_idx, layout, rope)
    mode = "truncate" if not rep.size else "insert" if start == end else "replace"
    origins = derived.origins_of(mode, delta, start, end, first, old_idx, store._keys(old, tenant), tpp)
    stored = derived.put_derived(store, new[:last * tpp], tenant, first, dst, origins)
    return SpliceResult(new, result.prefill_from, result.prefill_to, first, n, stored, delta)
