"""Lossy pages in the store (issue 26): put under keys of their own, returned only when asked.

:meth:`Store.put_lossy <tierkv.store.api.Store.put_lossy>` codes a prompt's pages at a
budget (average bits an element, :mod:`tierkv.lossy`) and stores each blob as a page:
the blob at the start of a page-sized row, zeros after it. Their keys are the exact
keys hashed with the budget (:func:`tierkv.keys.lossy_keys`), so no exact lookup or get,
no other budget and no other tenant ever sees one.
``get(..., accept_lossy=budget)`` goes on with them where the exact pages end, decodes
each into the caller's row (values in the layout's dtype; an evicted token's rows zero,
named in :attr:`GetResult.evicted <tierkv.store.results.GetResult.evicted>`), and
``lookup(..., accept_lossy=budget)`` counts them. Checked like every page (the row's
checksum), and decoded only after the blob's own checksum passes.

What this saves today: bytes on a tier that codes pages (``codec = "lossless"`` or
``"auto"`` on NVMe, NVMe-oF: the zeros after the blob cost nearly nothing there) and on
the wire of such a tier; a DRAM slot still holds a whole page. K/V layouts of bf16,
fp16 or fp32 pages, in the standard order or one of vLLM's CPU orders (``page_order =
"vllm_cpu"`` or ``"vllm_cpu_amx"``: coded as the same page in the standard order, decoded
back into its own).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from tierkv.errors import CorruptPageError, InputError
from tierkv.keys import KEY_BYTES, Tokens, as_token_array, lossy_keys, split_keys
from tierkv.layout import KVLayout, LayoutKind, from_standard_order, to_standard_order
from tierkv.lossy.quant import from_bf16_bits, to_bf16_bits
from tierkv.store.pages import PageSource, page_list, page_rows
from tierkv.store.results import GetResult, PutResult

if TYPE_CHECKING:
    from tierkv.lossy.alloc import Calibration, Importance
    from tierkv.store.api import Store

_DTYPES = ("bf16", "fp16", "fp32")


def check_budget(budget: object, what: str) -> float:
    """``budget`` as bits an element: a number from 1 up to (not including) 16; InputError."""
    if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, (int, float, np.integer, np.floating)) \
            or not math.isfinite(budget) or not 1.0 <= float(budget) < 16.0:
        raise InputError(f"{what}: a lossy budget is bits an element, at least 1 and under 16, got {budget!r}")
    return float(budget)


def layout_dtype(lay: KVLayout, what: str) -> str:
    """The dtype name of ``lay``'s pages; InputError where lossy pages cannot code them."""
    if lay.kind is not LayoutKind.KV or lay.dtype.value not in _DTYPES:
        raise InputError(f"{what}: lossy pages need a K/V layout of bf16, fp16 or fp32 pages; this store's is "
                         f"{lay.kind.value}, {lay.dtype.value}")
    return str(lay.dtype.value)


def standard_shape(lay: KVLayout) -> tuple[int, int, int, int, int]:
    """A K/V page's shape in the standard order, what lossy pages code."""
    return (lay.num_layers, 2, lay.tokens_per_page, lay.num_kv_heads, lay.head_dim)


def lossy_blob(store: Store, tokens: Tokens, tenant: str | bytes, budget: float, first: int = 0) -> bytes:
    """The lossy keys of ``tokens``' pages from page ``first`` on, at ``budget``."""
    return lossy_keys(store._keys(tokens, tenant)[first * KEY_BYTES:], budget)


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


def code_rows(layout: KVLayout, pages: PageSource, n_max: int, budget: float, importance: Importance | None,
              calibration: Calibration | None, evict: bool, what: str) -> np.ndarray:
    """``pages`` (exact, at most ``n_max``) coded lossy at ``budget``: rows ``uint8 [n,
    page_bytes]`` of a blob each, then zeros. Pure: a daemon's clients code their own."""
    from tierkv.lossy.alloc import Importance, allocate
    from tierkv.lossy.format import encode

    budget = check_budget(budget, what)
    dtype = layout_dtype(layout, what)
    tpp = layout.tokens_per_page
    src = (page_list(pages, layout, f"{what}(pages=...)", n_max) if isinstance(pages, (list, tuple)) else
           page_rows(pages, layout, f"{what}(pages=...)", n_max, lists=True))  # type: ignore[arg-type]
    n = src.shape[0]
    if importance is not None and importance.a2.shape[2] < n * tpp:
        raise InputError(f"{what}: the importance covers {importance.a2.shape[2]} tokens, the pages {n * tpp}")
    out = np.zeros((n, layout.page_bytes), np.uint8)
    for i in range(n):
        page = to_standard_order(to_float(np.asarray(src[i]).reshape(1, -1), dtype, layout.page_shape), layout)[0]
        imp = None if importance is None else Importance(importance.a2[:, :, i * tpp:(i + 1) * tpp], importance.qe)
        coded = encode(page, allocate(page, budget, imp, calibration, evict=evict), dtype, budget)
        assert len(coded) < layout.page_bytes   # the budget counts every byte, and is under 16 bits an element
        out[i, :len(coded)] = np.frombuffer(coded, np.uint8)
    return out


def check_rows(layout: KVLayout, rows: np.ndarray, budget: float, what: str) -> None:
    """InputError unless every row is a lossy blob of ``layout``'s pages at ``budget``,
    then zeros (what :func:`code_rows` makes; a daemon checks what its clients send)."""
    from tierkv.lossy.format import header
    from tierkv.tiers.blocks import lossy_length

    lay = layout
    want = (lay.num_layers, lay.tokens_per_page, lay.num_kv_heads, lay.head_dim)
    for i in range(rows.shape[0]):
        if not lossy_length(rows[i]):
            raise InputError(f"{what}: row {i} is not a lossy page's blob followed by zeros")
        _, L, T, H, D, _, got, _ = header(rows[i].tobytes())
        if (L, T, H, D) != want or got != np.float32(budget):
            raise InputError(f"{what}: row {i} codes a {L}x{T}x{H}x{D} page at {got} bits, this store's pages are "
                             f"{'x'.join(map(str, want))} and the budget {budget}")


def put_lossy(store: Store, tokens: Tokens, pages: PageSource, tenant: str | bytes, budget: float,
              importance: Importance | None, calibration: Calibration | None, evict: bool) -> PutResult:
    """:meth:`Store.put_lossy <tierkv.store.api.Store.put_lossy>` (module docstring)."""
    n_max = len(as_token_array(tokens)) // store.layout.tokens_per_page
    rows = code_rows(store.layout, pages, n_max, budget, importance, calibration, evict, "put_lossy")
    return put_coded(store, tokens, rows, tenant, budget)


def put_coded(store: Store, tokens: Tokens, rows: np.ndarray, tenant: str | bytes, budget: float) -> PutResult:
    """Store rows :func:`code_rows` made under ``tokens``' lossy keys at ``budget``."""
    blob = lossy_blob(store, tokens, tenant, check_budget(budget, "put_lossy"))
    keys = split_keys(blob)
    n = rows.shape[0]
    if n > len(keys):
        raise InputError(f"put_lossy: {n} pages given but the tokens hold only {len(keys)} full pages")
    with store._lock:
        store._check_writable_open("put_lossy needs")
        with store._placing(blob, tenant):
            stored, new = store._store(keys[:n], rows, 0)
    return PutResult(stored, n - new, new - stored)


def read_lossy(store: Store, tokens: Tokens, rows: np.ndarray, tenant: str | bytes, first: int,
               budget: float) -> tuple[int, tuple[int, ...]]:
    """Read the lossy pages at ``budget`` from page ``first`` on into ``rows[first:]``, as
    stored (blobs; takes the lock): how many, and each one's level."""
    layout_dtype(store.layout, "get(accept_lossy=...)")
    if first >= rows.shape[0]:
        return 0, ()
    lblob = lossy_blob(store, tokens, tenant, budget, first)
    with store._lock:
        store._check_open()
        lead = store._lead(lblob, rows.shape[0] - first)
        if not len(lead):
            return 0, ()
        got = store._read_lead(lead, rows[first:])
        store._counters.events["lossy_pages"] += got
    return got, tuple(lead.levels[:got].tolist())


def decode_rows(layout: KVLayout, rows: np.ndarray, first: int, n: int, budget: float) -> tuple[int, np.ndarray]:
    """Decode the lossy blobs in ``rows[first:first + n]`` in place into pages of the
    layout's dtype: how many decoded (a blob that does not, or is of another geometry or
    budget, ends the run) and ``evicted`` ``bool [first + that, tokens_per_page]``."""
    from tierkv.lossy.format import decode

    dtype = layout_dtype(layout, "get(accept_lossy=...)")
    evicted = np.zeros((first + n, layout.tokens_per_page), bool)
    done = 0
    for i in range(first, first + n):
        try:
            dec = decode(rows[i].tobytes())
        except CorruptPageError:
            break
        if dec.page.shape != standard_shape(layout) or dec.budget != np.float32(budget):
            break
        rows[i] = from_float(from_standard_order(dec.page[None], layout)[0], dtype)
        evicted[i] = ~dec.kept
        done += 1
    return done, evicted[:first + done]


def get_lossy_raw(store: Store, tokens: Tokens, rows: np.ndarray, tenant: str | bytes, res: GetResult,
                  budget: float) -> GetResult:
    """``res`` continued with lossy pages at ``budget`` read into ``rows`` as stored (a
    daemon's: its client decodes them, :func:`decode_rows`)."""
    got, levels = read_lossy(store, tokens, rows, tenant, res.pages, budget)
    total = res.pages + got
    return GetResult(total, total * store.layout.tokens_per_page,
                     res.tiers + tuple(map(store._kinds.__getitem__, levels)), lossy=got)


def get_lossy(store: Store, tokens: Tokens, rows: np.ndarray, tenant: str | bytes, res: GetResult,
              budget: float) -> GetResult:
    """``res`` (an exact get into ``rows``) continued with lossy pages at ``budget``,
    decoded into ``rows``."""
    got, levels = read_lossy(store, tokens, rows, tenant, res.pages, budget)
    if not got:
        return res
    n, evicted = decode_rows(store.layout, rows, res.pages, got, budget)
    total = res.pages + n
    kinds = tuple(map(store._kinds.__getitem__, levels[:n]))
    return GetResult(total, total * store.layout.tokens_per_page, res.tiers + kinds, lossy=n,
                     evicted=evicted if n else None)
