"""A Hugging Face transformers KV cache backed by a tierkv store.

:class:`TierKVCache` binds a store to one decoder model. ``load(tokens)`` returns a
transformers ``DynamicCache`` already holding the KV of the longest cached prefix of
``tokens`` (whole pages, read from whichever tier holds them), so the model only
processes the rest; ``save(cache, tokens)`` writes the cache's full pages that the
store does not hold yet. Both go through the engine adapter
(:mod:`tierkv.integrations.adapter` and :mod:`tierkv.integrations.worker`), with the
cache's sequence positions as engine blocks: block ``i`` is tokens
``[i * tokens_per_page, (i + 1) * tokens_per_page)``.

Copies are exact: pages hold K (after RoPE, as the cache keeps it) and V in the
store's layout dtype, which must equal the model's, so a reused prefix gives the
model bit-identical attention inputs at the same positions. Batch size 1, full
attention in every layer. Called by :mod:`tierkv.integrations.chat`, ``tierkv demo``
and the tests; not thread-safe (one generation at a time per instance).
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from tierkv.store.api import Store
from tierkv.errors import CapacityError, ConfigError, InputError, TierIOError
from tierkv.integrations import MissingDependencyError
from tierkv.integrations.adapter import OffloadScheduler
from tierkv.integrations.worker import OffloadWorker, TransferResult
from tierkv.keys import Tokens, as_token_array
from tierkv.layout import DType, KVLayout, LayoutKind
from tierkv.splice.ops import SpliceResult
from tierkv.splice.rope import Rope
from tierkv.lossy.alloc import Calibration, Importance

try:
    from transformers import DynamicCache
except ImportError as exc:  # pragma: no cover - exercised where the demo extra is absent
    raise MissingDependencyError(f"tierkv.integrations.hf needs transformers ({exc}); "
                                 "install the demo extra: pip install 'tierkv[demo]'") from None


class CacheBlocks:
    """Per-layer K and V tensors ``[1, kv_heads, seq, head_dim]`` seen as engine blocks.

    Block ``i`` is sequence positions ``[i*T, (i+1)*T)`` of every layer (``T`` =
    ``tokens_per_page``). ``scatter`` writes in place, so the tensors must be contiguous.
    """

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], tokens_per_page: int) -> None:
        self.keys = list(keys)
        self.values = list(values)
        self.tokens_per_page = tokens_per_page

    def _blocks(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` [1, H, S, D] as a view [H, S // T, T, D] of its full blocks."""
        h, s, d = t.shape[1], t.shape[2], t.shape[3]
        n = s // self.tokens_per_page
        return t[0, :, : n * self.tokens_per_page].view(h, n, self.tokens_per_page, d)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        for layer, planes in enumerate(zip(self.keys, self.values)):
            for plane, t in enumerate(planes):
                # [H, n, T, D] -> [n, T, H, D]
                out[: ids.numel(), layer, plane] = self._blocks(t).index_select(1, ids).permute(1, 2, 0, 3)

    def scatter(self, pages: torch.Tensor, block_ids: Sequence[int]) -> None:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        for layer, planes in enumerate(zip(self.keys, self.values)):
            for plane, t in enumerate(planes):
                self._blocks(t).index_copy_(1, ids, pages[: ids.numel(), layer, plane].permute(2, 0, 1, 3))


@dataclass(frozen=True)
class LoadedPrefix:
    """A cache holding the first ``tokens`` tokens, ``tokens_per_tier`` of them by serving tier."""

    cache: DynamicCache
    tokens: int
    tokens_per_tier: dict[str, int]
    seconds: float
    derived_tokens: int = 0   # of them, from derived pages (load(accept="derived")), the last ones
    lossy_tokens: int = 0     # of them, from lossy pages (load(accept_lossy=...)), the last ones
    #: Of those, evicted by their coding: the cache holds ``tokens - evicted_tokens``
    #: entries, and the model must run what follows at positions from ``tokens`` on
    #: (``position_ids``), not from the cache's length.
    evicted_tokens: int = 0


@dataclass(frozen=True)
class SavedPrefix:
    """``pages_stored`` new pages written; the cache's first ``tokens`` tokens are now in the store."""

    pages_stored: int
    tokens: int
    seconds: float


def model_layout(model: torch.nn.Module, tokens_per_page: int = 16) -> KVLayout:
    """The KV layout a decoder model's cache has, from its config and parameter dtype.

    Raises ConfigError for models this cache does not handle (sliding-window layers).
    """
    cfg = _text_config(model)
    heads = int(getattr(cfg, "num_attention_heads"))
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or int(getattr(cfg, "hidden_size")) // heads)
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(cfg, "use_sliding_window", False):
        raise ConfigError(f"{type(model).__name__} has sliding-window layers ({sorted(set(layer_types))}); "
                          "TierKVCache handles full attention only")
    dtype = next(model.parameters()).dtype
    return KVLayout(num_layers=int(getattr(cfg, "num_hidden_layers")), num_kv_heads=kv_heads, head_dim=head_dim,
                    dtype=DType.parse(str(dtype).removeprefix("torch.")), tokens_per_page=tokens_per_page)


def _text_config(model: torch.nn.Module) -> object:
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ConfigError(f"{type(model).__name__} has no transformers config")
    get_text = getattr(cfg, "get_text_config", None)
    return get_text(decoder=True) if callable(get_text) else cfg


#: Prefixes wrappers add to parameter names (torch.compile, DDP/DataParallel).
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def _plain_name(name: str) -> str:
    while name.startswith(_WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def model_fingerprint(model: torch.nn.Module) -> str:
    """16 hex digits that tell models apart by their weights: every parameter's name
    (without ``torch.compile``/DDP prefixes), shape and dtype and 256 of its elements
    spread over it. Two checkpoints with one layout (a base model and its instruct tune,
    say) differ; one checkpoint loaded again, in any process, wrapped or not, does not.
    Costs one small read per parameter. Weights on the meta device (offloaded) cannot be
    read: ConfigError, and ``TierKVCache(fingerprint=...)`` names the model instead."""
    h = xxhash.xxh3_64()
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: _plain_name(kv[0])):
            if param.device.type == "meta":
                raise ConfigError(f"parameter {name} is on the meta device (offloaded): its weights cannot be "
                                  "fingerprinted; pass TierKVCache(..., fingerprint=...) naming this checkpoint")
            name = _plain_name(name)
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // 256)
            sample = flat[::step][:256].to("cpu", copy=True).contiguous()
            h.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
            h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class TierKVCache:
    """Loads and saves a decoder model's KV cache through a store, one page at a time.

    ``store.layout`` must match the model's KV layout (layers, KV heads, head dim,
    dtype); a mismatch raises ConfigError naming both. ``tenant`` salts every key, and
    so does the model's :func:`model_fingerprint`: a store shared by two models of one
    layout never hands one of them the other's KV (the store's ``model_id`` names the
    model but cannot check it). ``fingerprint`` overrides it (a checkpoint name or hash,
    for weights that cannot be read, e.g. offloaded to the meta device).
    """

    def __init__(self, store: Store, model: torch.nn.Module, *, tenant: str = "",
                 fingerprint: str | None = None) -> None:
        if store.read_only:
            raise ConfigError("TierKVCache needs the store's writer (it pins pages while loading and saves "
                              "new ones); this store was opened read_only=True")
        want = model_layout(model, store.layout.tokens_per_page)
        have = store.layout
        if have.kind is not LayoutKind.KV or have != want:
            raise ConfigError(f"the store's layout ({_describe(have)}) does not match the model's ({_describe(want)})")
        self.store = store
        self.layout = have
        self.tenant = tenant
        if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
            raise InputError(f"fingerprint must be a non-empty string naming the checkpoint, got {fingerprint!r}")
        self.fingerprint = fingerprint or model_fingerprint(model)
        self._salt = f"{tenant}\x00model:{self.fingerprint}"     # what keys are salted with
        self.scheduler = OffloadScheduler(store)
        self._dtype = getattr(torch, have.dtype.torch_name)
        self._device = next(model.parameters()).device
        self._requests = itertools.count(1)
        self._request: str | None = None        # the last load's request: its save is the same request
        self._model = model
        self._rope: Rope | None = None          # the model's rotary embedding, for splices
        # Caches loaded with derived or lossy pages: an approximation, never saved (by identity:
        # the model extends the same object in place).
        self._approximate: weakref.WeakSet[DynamicCache] = weakref.WeakSet()

    def load(self, tokens: Tokens, *, accept: str = "exact", accept_lossy: float | None = None) -> LoadedPrefix:
        """A DynamicCache holding the longest cached prefix of ``tokens`` (whole pages).

        At least the last token is left for the model to process. Pages that fail to
        load (a miss, a checksum failure) shorten the prefix; they are never wrong data.
        ``accept="derived"``: where the exact pages end, go on with derived pages (moved
        there by :meth:`splice`; an approximation past the first layer, docs/splice.md);
        ``LoadedPrefix.derived_tokens`` says how many. ``accept_lossy=budget``: the same
        with lossy pages (:meth:`save_lossy`, docs/lossy.md); tokens their coding evicted
        are left out of the cache (``LoadedPrefix.evicted_tokens``): run what follows with
        ``position_ids`` from ``LoadedPrefix.tokens`` on.
        """
        if accept not in ("exact", "derived"):
            raise InputError(f"load(accept=...) must be 'exact' or 'derived', got {accept!r}")
        if accept == "derived" or accept_lossy is not None:
            if accept == "derived" and accept_lossy is not None:
                raise InputError("load: accept='derived' and accept_lossy= cannot be asked together")
            loaded = self._load_beyond_exact(tokens, accept_lossy)
            if loaded.derived_tokens or loaded.lossy_tokens:
                self._approximate.add(loaded.cache)
            return loaded
        t0 = time.perf_counter()
        arr = as_token_array(tokens)
        cache = DynamicCache()
        hit = self.scheduler.lookup(arr, self._salt)
        self._request = f"hf-{next(self._requests)}"
        spec = self.scheduler.prepare_load(arr, range(hit.cached_pages), self._salt,   # counts misses too
                                           request_id=self._request)
        if spec is None:
            return LoadedPrefix(cache, 0, {}, time.perf_counter() - t0)
        shape = (1, self.layout.num_kv_heads, spec.num_pages * self.layout.tokens_per_page, self.layout.head_dim)
        keys = [torch.empty(shape, dtype=self._dtype) for _ in range(self.layout.num_layers)]
        values = [torch.empty(shape, dtype=self._dtype) for _ in range(self.layout.num_layers)]
        try:
            result = OffloadWorker(self.store, CacheBlocks(keys, values, self.layout.tokens_per_page)).transfer(spec)
        finally:
            self.scheduler.complete_load(spec)
        n = result.pages * self.layout.tokens_per_page
        if n:
            for layer in range(self.layout.num_layers):
                cache.update(keys[layer][:, :, :n].to(self._device), values[layer][:, :, :n].to(self._device), layer)
        return LoadedPrefix(cache, n, dict(result.tokens_per_tier), time.perf_counter() - t0)

    def splice(self, tokens: Tokens, start: int, end: int, replacement: Tokens) -> SpliceResult:
        """An edit directive: ``tokens[start:end]`` (cached) became ``replacement``. The
        pages past the edit are moved into derived pages (:meth:`Store.splice
        <tierkv.store.api.Store.splice>`, with this model's rotary embedding); the model
        prefills ``SpliceResult.prefill_from`` to ``prefill_to`` of the edited prompt as
        usual (:meth:`load`, then the model, then :meth:`save`), after which
        ``load(edited, accept="derived")`` holds all of it but its last partial page."""
        if self._rope is None:
            self._rope = Rope.from_model(self._model)
        return self.store.splice(tokens, start, end, replacement, rope=self._rope, tenant=self._salt)

    def save_lossy(self, cache: DynamicCache, tokens: Tokens, budget: float, *, importance: Importance | None = None,
                   calibration: Calibration | None = None, evict: bool = True) -> SavedPrefix:
        """Store the full pages of ``cache`` coded lossy at ``budget`` bits an element
        (:meth:`Store.put_lossy <tierkv.store.api.Store.put_lossy>`; ``importance`` over
        the cache's tokens, e.g. :func:`tierkv.lossy.scoring.prefill`'s): only
        ``load(..., accept_lossy=budget)`` returns them. Never save a cache that was
        loaded lossy (exact keys would hold an approximation)."""
        t0 = time.perf_counter()
        arr, keys, values, n_pages = self._to_save(cache, tokens, "save_lossy")
        tpp = self.layout.tokens_per_page
        pages = torch.empty((n_pages, *self.layout.page_shape), dtype=self._dtype)
        CacheBlocks([k.to("cpu", self._dtype) for k in keys], [v.to("cpu", self._dtype) for v in values],
                    tpp).gather(range(n_pages), pages)
        res = self.store.put_lossy(arr[:n_pages * tpp], pages, budget, self._salt, importance=importance,
                                   calibration=calibration, evict=evict)
        return SavedPrefix(res.stored, (res.stored + res.already_present) * tpp, time.perf_counter() - t0)

    def _load_beyond_exact(self, tokens: Tokens, budget: float | None = None) -> LoadedPrefix:
        t0 = time.perf_counter()
        arr = as_token_array(tokens)
        tpp = self.layout.tokens_per_page
        pages = max(0, (arr.size - 1) // tpp)   # the last token is left for the model
        cache = DynamicCache()
        if not pages:
            return LoadedPrefix(cache, 0, {}, time.perf_counter() - t0)
        buf = torch.empty((pages, *self.layout.page_shape), dtype=self._dtype)
        if budget is None:
            res = self.store.get(arr[:pages * tpp], buf, self._salt, accept="derived")
        else:
            res = self.store.get(arr[:pages * tpp], buf, self._salt, accept_lossy=budget)
        n = res.pages * tpp
        evicted = 0
        if n:
            shape = (1, self.layout.num_kv_heads, n, self.layout.head_dim)
            keys = [torch.empty(shape, dtype=self._dtype) for _ in range(self.layout.num_layers)]
            values = [torch.empty(shape, dtype=self._dtype) for _ in range(self.layout.num_layers)]
            CacheBlocks(keys, values, tpp).scatter(buf[:res.pages], range(res.pages))
            keep = None
            if res.evicted is not None and res.evicted.any():   # tokens the coding dropped leave the cache
                keep = torch.from_numpy(~res.evicted.reshape(-1)[:n])
                evicted = int(res.evicted.sum())
            for layer in range(self.layout.num_layers):
                k, v = keys[layer], values[layer]
                if keep is not None:
                    k, v = k[:, :, keep], v[:, :, keep]
                cache.update(k.to(self._device), v.to(self._device), layer)
        per_tier: dict[str, int] = {}
        for kind in res.tiers:
            per_tier[kind.value] = per_tier.get(kind.value, 0) + tpp
        return LoadedPrefix(cache, n, per_tier, time.perf_counter() - t0, derived_tokens=res.derived * tpp,
                            lossy_tokens=res.lossy * tpp, evicted_tokens=evicted)

    def save(self, cache: DynamicCache, tokens: Tokens) -> SavedPrefix:
        """Store the full pages of ``cache``; ``tokens`` are the ids whose KV it holds, in order.

        ``tokens`` may run past the cache (e.g. the last generated token, not yet
        processed); only the first ``cache.get_seq_length()`` count. A cache longer than
        every tier together stores its leading pages that fit. A cache :meth:`load` filled
        with derived or lossy pages is refused (InputError): it holds an approximation, and
        with evicted tokens its entries no longer line up with ``tokens``.
        """
        t0 = time.perf_counter()
        arr, keys, values, n_pages = self._to_save(cache, tokens, "save")
        seq = keys[0].shape[2] if keys else 0
        if keys and keys[0].dtype != self._dtype:
            raise InputError(f"save: the cache holds {keys[0].dtype}, the store's layout {self.layout.dtype.value}")
        request, self._request = self._request, None
        spec = self.scheduler.prepare_store(arr[:n_pages * self.layout.tokens_per_page], range(n_pages), self._salt,
                                            request_id=request)
        if spec is None:
            return SavedPrefix(0, n_pages * self.layout.tokens_per_page, time.perf_counter() - t0)
        result: TransferResult | None = None
        try:
            result = OffloadWorker(self.store, CacheBlocks(keys, values, self.layout.tokens_per_page)).transfer(spec)
        finally:
            self.scheduler.complete_store(spec, success=result is not None and result.success)
        if not result.success:
            err = CapacityError if isinstance(result.exception, CapacityError) else TierIOError
            raise err(f"save: storing {len(spec.block_ids)} pages failed: {result.error}") from result.exception
        stored_tokens = self.store.lookup(arr[:seq], self._salt, count=False).cached_tokens
        return SavedPrefix(result.pages, stored_tokens, time.perf_counter() - t0)

    def _to_save(self, cache: DynamicCache, tokens: Tokens,
                 what: str) -> tuple[np.ndarray, list[torch.Tensor], list[torch.Tensor], int]:
        """What :meth:`save` and :meth:`save_lossy` store of ``cache``: its token ids, K and
        V tensors per layer, and how many full pages (as many as the store holds)."""
        if cache in self._approximate:
            raise InputError(f"{what}: this cache was loaded with derived or lossy pages (an approximation); "
                             "save only what the model computed from exact pages")
        arr = as_token_array(tokens)
        keys, values = _cache_tensors(cache, self.layout.num_layers)
        seq = keys[0].shape[2] if keys else 0
        if arr.size < seq:
            raise InputError(f"{what}: the cache holds {seq} tokens but only {arr.size} token ids were given")
        return arr, keys, values, min(seq // self.layout.tokens_per_page, self._capacity_pages())

    def _capacity_pages(self) -> int:
        return sum(t.capacity_slots for t in self.store.stats().tiers.values())


def _cache_tensors(cache: DynamicCache, num_layers: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ConfigError("this transformers version's DynamicCache has no per-layer objects; "
                          "TierKVCache needs transformers >= 4.56")
    if len(layers) != num_layers:
        raise InputError(f"save: the cache has {len(layers)} layers, the store's layout {num_layers}")
    keys, values = [], []
    for i, layer in enumerate(layers):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4:
            raise InputError(f"save: layer {i} of the cache holds no [batch, heads, seq, dim] tensors")
        if k.shape[0] != 1:
            raise InputError(f"save: batch size {k.shape[0]}; TierKVCache handles batch size 1")
        keys.append(k.contiguous())
        values.append(v.contiguous())
    return keys, values


def _describe(layout: KVLayout) -> str:
    return (f"{layout.num_layers} layers, {layout.num_kv_heads} KV heads, head_dim {layout.head_dim}, "
            f"{layout.dtype.value}, kind {layout.kind.value}, page_order {layout.page_order.value}")
