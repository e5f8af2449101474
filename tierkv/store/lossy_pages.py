"""Lossy pages in the store (issue 26): put under keys of their own, returned only when asked.

:meth:`Store.put_lossy <tierkv.store.api.Store.put_lossy>` codes a prompt's pages at a
budget (average bits an element, :mod:`tierkv.lossy`) and stores each blob as a page:
the blob at the start of a page-sized row, zeros after it. Their keys chain from
:func:`tierkv.keys.lossy_seed` (the tenant's namespace and the budget), so no exact
lookup or get, no other budget and no other tenant ever sees one.
``get(..., accept_lossy=budget)`` goes on with them where the exact pages end, decodes
each into the caller's row (values in the layout's dtype; an evicted token's rows zero,
named in :attr:`GetResult.evicted <tierkv.store.results.GetResult.evicted>`), and
``lookup(..., accept_lossy=budget)`` counts them. Checked like every page (the row's
checksum), and decoded only after the blob's own checksum passes.

What this saves today: bytes on a tier that codes pages (``codec = "lossless"`` or
``"auto"`` on NVMe, NVMe-oF: the zeros after the blob cost nearly nothing there) and on
the wire of such a tier; a DRAM slot still holds a whole page. Only standard-order
(``page_order = "standard"``), K/V layouts of bf16, fp16 or fp32 pages.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from tierkv.errors import CorruptPageError, InputError
from tierkv.keys import KEY_BYTES, Tokens, as_token_array, chain_keys, lossy_seed, split_keys, tenant_salt
from tierkv.layout import LayoutKind, PageOrder
from tierkv.lossy.quant import from_bf16_bits, to_bf16_bits
from tierkv.store.pages import PageSource, page_list, page_rows
from tierkv.store.results import GetResult, PutResult

if TYPE_CHECKING:
    from tierkv.lossy.alloc import Calibration, Importance
    from tierkv.store.api import Store

_DTYPES = ("bf16", "fp16", "fp32")


def check_budget(budget: object, what: str) -> float:
    """``budget`` as bits an element: a number from 1 up to (not including) 16; InputError."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) \
            or not 1.0 <= float(budget) < 16.0:
        raise InputError(f"{what}: a lossy budget is bits an element, at least 1 and under 16, got {budget!r}")
    return float(budget)


def _check_layout(store: Store, what: str) -> str:
    lay = store.layout
    if lay.kind is not LayoutKind.KV or lay.page_order is not PageOrder.STANDARD or lay.dtype.value not in _DTYPES:
        raise InputError(f"{what}: lossy pages need a K/V layout of bf16, fp16 or fp32 pages in the standard order; "
                         f"this store's is {lay.kind.value}, {lay.page_order.value}, {lay.dtype.value}")
    return str(lay.dtype.value)


def lossy_blob(store: Store, tokens: Tokens, tenant: str | bytes, budget: float) -> bytes:
    """The lossy keys of ``tokens``' pages at ``budget``."""
    seed = lossy_seed(store._namespace(tenant_salt(tenant)), budget)
    return chain_keys(as_token_array(tokens), store.layout.tokens_per_page, seed)


def to_float(rows: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Page rows (``uint8 [n, page_bytes]``) of ``dtype`` as float32 ``[n, *shape]``."""
    n = rows.shape[0]
    if dtype == "bf16":
        return from_bf16_bits(np.ascontiguousarray(rows).view(np.uint16)).reshape(n, *shape)
    if dtype == "fp16":
        return np.ascontiguousarray(rows).view(np.float16).astype(np.float32).reshape(n, *shape)
    return np.ascontiguousarray(rows).view(np.float32).reshape(n, *shape).copy()


def from_float(page: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 page as the bytes of ``dtype`` (uint8, flat)."""
    if dtype == "bf16":
        return to_bf16_bits(page).view(np.uint8).reshape(-1)
    if dtype == "fp16":
        return page.astype(np.float16).view(np.uint8).reshape(-1)
    return np.ascontiguousarray(page, np.float32).view(np.uint8).reshape(-1)


def put_lossy(store: Store, tokens: Tokens, pages: PageSource, tenant: str | bytes, budget: float,
              importance: Importance | None, calibration: Calibration | None, evict: bool) -> PutResult:
    """:meth:`Store.put_lossy <tierkv.store.api.Store.put_lossy>` (module docstring)."""
    from tierkv.lossy.alloc import Importance, allocate
    from tierkv.lossy.format import encode

    budget = check_budget(budget, "put_lossy")
    dtype = _check_layout(store, "put_lossy")
    lay = store.layout
    tpp = lay.tokens_per_page
    blob = lossy_blob(store, tokens, tenant, budget)
    keys = split_keys(blob)
    src = (page_list(pages, lay, "put_lossy(pages=...)", len(keys)) if isinstance(pages, (list, tuple)) else
           page_rows(pages, lay, "put_lossy(pages=...)", len(keys), lists=True))  # type: ignore[arg-type]
    n = src.shape[0]
    if importance is not None and importance.a2.shape[2] < n * tpp:
        raise InputError(f"put_lossy: the importance covers {importance.a2.shape[2]} tokens, the pages {n * tpp}")
    out = np.zeros((n, lay.page_bytes), np.uint8)
    shape = lay.page_shape
    for i in range(n):
        page = to_float(np.asarray(src[i]).reshape(1, -1), dtype, shape)[0]
        imp = None if importance is None else Importance(importance.a2[:, :, i * tpp:(i + 1) * tpp], importance.qe)
        coded = encode(page, allocate(page, budget, imp, calibration, evict=evict), dtype, budget)
        assert len(coded) < lay.page_bytes   # the budget counts every byte, and is under 16 bits an element
        out[i, :len(coded)] = np.frombuffer(coded, np.uint8)
    with store._lock:
        store._check_writable_open("put_lossy needs")
        with store._placing(blob, tenant):
            stored, new = store._store(keys[:n], out, 0)
    return PutResult(stored, n - new, new - stored)


def lossy_levels(store: Store, lblob: bytes) -> bytes:
    """The levels of the leading cached lossy pages of ``lblob`` (lock held)."""
    from tierkv.store.derived import derived_levels
    return derived_levels(store, lblob)   # the same walk: cached, and not on a degraded tier


def get_lossy(store: Store, tokens: Tokens, rows: np.ndarray, tenant: str | bytes, res: GetResult,
              budget: float) -> GetResult:
    """``res`` (an exact get into ``rows``) continued with lossy pages at ``budget``,
    decoded into ``rows`` (takes the lock)."""
    from tierkv.lossy.format import decode

    dtype = _check_layout(store, "get(accept_lossy=...)")
    first = res.pages
    if first >= rows.shape[0]:
        return res
    lay = store.layout
    tpp = lay.tokens_per_page
    lblob = lossy_blob(store, tokens, tenant, budget)
    with store._lock:
        store._check_open()
        lead = store._lead(lblob[first * KEY_BYTES:], rows.shape[0] - first)
        if not len(lead):
            return res
        raw = np.zeros((len(lead), lay.page_bytes), np.uint8)
        got = store._read_lead(lead, raw)
    evicted = np.zeros((first + got, tpp), bool)
    n = 0
    for i in range(got):
        try:
            dec = decode(memoryview(raw[i]))
        except CorruptPageError:   # checked as a page, yet not a lossy one: a miss from here
            break
        if dec.page.shape != lay.page_shape or dec.budget != budget:
            break
        rows[first + i] = from_float(dec.page, dtype)
        evicted[first + i] = ~dec.kept
        n += 1
    with store._lock:
        store._counters.events["lossy_pages"] += n
    total = first + n
    kinds = tuple(map(store._kinds.__getitem__, lead.levels[:n].tolist()))
    return GetResult(total, total * tpp, res.tiers + kinds, lossy=n, evicted=evicted[:total] if n else None)
