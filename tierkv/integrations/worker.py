"""The engine adapter, worker side: copy pages between the store and engine blocks by block id.

:class:`OffloadWorker` executes the :class:`~tierkv.integrations.adapter.LoadSpec` and
:class:`~tierkv.integrations.adapter.StoreSpec` objects the scheduler hands out. The
engine's KV memory is reached through :class:`KVBlocks`: ``gather`` copies engine
blocks into store-layout pages, ``scatter`` copies pages into engine blocks. One engine
block holds one page's tokens of every layer. :class:`PagedKV` implements it for
per-layer paged caches shaped like vLLM's FlashAttention cache; the transformers cache
has its own (:mod:`tierkv.integrations.hf`).

A transfer never raises for a store or copy failure: it returns a failed
:class:`TransferResult` naming the error and the engine blocks that hold no loaded
data, so the engine recomputes them. ``transfer`` runs in the caller's thread;
``submit`` runs transfers one at a time on a background thread and returns futures.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, Self

import torch

from tierkv.store.api import Store
from tierkv.errors import InputError, LayoutError, StoreClosedError, TierKVError
from tierkv.integrations.adapter import LoadSpec, StoreSpec
from tierkv.layout import PageOrder

log = logging.getLogger(__name__)


class KVBlocks(Protocol):
    """An engine's KV memory addressed by block id, one page of tokens per block.

    Pages are ``[n, *layout.page_shape]`` = ``[n, layers, 2, tokens_per_page, kv_heads,
    head_dim]`` CPU tensors in the layout's dtype. Copies must be exact (no conversion).
    """

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy engine blocks ``block_ids`` into ``out[0 .. len(block_ids)-1]``."""
        ...

    def scatter(self, pages: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copy ``pages[i]`` into engine block ``block_ids[i]``."""
        ...


class PagedKV:
    """Per-layer paged caches ``[2, num_blocks, block_size, kv_heads, head_dim]`` (K, V planes).

    That is vLLM's FlashAttention layout; ``block_size`` must equal the store's
    ``tokens_per_page``. The caches may live on any torch device; pages are CPU tensors.
    """

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        if not layers:
            raise InputError("PagedKV needs at least one layer")
        shape = tuple(layers[0].shape)
        if len(shape) != 5 or shape[0] != 2:
            raise InputError(f"PagedKV expects [2, num_blocks, block_size, kv_heads, head_dim] per layer, got {list(shape)}")
        for i, t in enumerate(layers):
            if tuple(t.shape) != shape or t.dtype != layers[0].dtype:
                raise InputError(f"layer {i} is {t.dtype} {list(t.shape)}; layer 0 is {layers[0].dtype} {list(shape)}")
        self.layers = list(layers)
        self.num_blocks = shape[1]

    def _check(self, block_ids: Sequence[int], pages: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise InputError(f"block ids must lie in [0, {self.num_blocks}), got {list(block_ids)}")
        want = (len(self.layers), *self.layers[0].shape[0:1], *self.layers[0].shape[2:])
        if tuple(pages.shape[1:]) != want or pages.dtype != self.layers[0].dtype:
            raise InputError(f"pages must be {self.layers[0].dtype} [n, {', '.join(map(str, want))}], "
                             f"got {pages.dtype} {list(pages.shape)}")
        return ids

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        ids = self._check(block_ids, out)
        for layer, cache in enumerate(self.layers):
            # [2, n, T, H, D] -> [n, 2, T, H, D]
            out[: ids.numel(), layer] = cache.index_select(1, ids.to(cache.device)).transpose(0, 1).to("cpu")

    def scatter(self, pages: torch.Tensor, block_ids: Sequence[int]) -> None:
        ids = self._check(block_ids, pages)
        for layer, cache in enumerate(self.layers):
            cache.index_copy_(1, ids.to(cache.device), pages[: ids.numel(), layer].transpose(0, 1).to(cache.device))


@dataclass(frozen=True)
class TransferResult:
    """How one load or store went.

    ``pages`` were loaded into engine blocks (load) or newly stored (store).
    ``tokens_per_tier`` counts loaded tokens by the tier that served them.
    ``failed_block_ids`` are the engine blocks of a load that hold no loaded data.
    """

    job_id: int
    kind: str
    success: bool
    pages: int
    seconds: float
    tokens_per_tier: dict[str, int] = field(default_factory=dict)
    failed_block_ids: tuple[int, ...] = ()
    error: str | None = None
    exception: BaseException | None = field(default=None, repr=False, compare=False)


class OffloadWorker:
    """Executes load and store specs against one store and one engine's :class:`KVBlocks`.

    ``close()`` waits for submitted transfers; it does not close the store.
    """

    def __init__(self, store: Store, blocks: KVBlocks) -> None:
        if store.layout.page_order is not PageOrder.STANDARD:
            raise LayoutError(f"the store's pages are in page_order {store.layout.page_order.value!r}; "
                              "OffloadWorker reads and writes the 'standard' order")
        self.store = store
        self.blocks = blocks
        self._layout = store.layout
        self._dtype = getattr(torch, store.layout.dtype.torch_name)
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._finished: list[TransferResult] = []

    def transfer(self, spec: LoadSpec | StoreSpec) -> TransferResult:
        """Run ``spec`` now, in this thread."""
        t0 = time.perf_counter()
        kind = "load" if isinstance(spec, LoadSpec) else "store"
        try:
            if isinstance(spec, LoadSpec):
                return self._load(spec, t0)
            return self._store(spec, t0)
        except (TierKVError, OSError, RuntimeError) as exc:
            log.warning("tierkv %s job %d failed: %s", kind, spec.job_id, exc)
            failed = spec.block_ids if isinstance(spec, LoadSpec) else ()
            return TransferResult(spec.job_id, kind, False, 0, time.perf_counter() - t0,
                                  failed_block_ids=failed, error=f"{type(exc).__name__}: {exc}", exception=exc)

    def _load(self, spec: LoadSpec, t0: float) -> TransferResult:
        staging = torch.empty((spec.num_pages, *self._layout.page_shape), dtype=self._dtype)
        if spec.request_tokens is not None:     # the whole prompt: its misses count, the policy sees it once
            got = self.store.get(spec.request_tokens, staging, spec.tenant,
                                 requested=max(spec.requested_pages, spec.num_pages))
        else:
            got = self.store.get(spec.tokens, staging, spec.tenant)
        if got.pages:
            self.blocks.scatter(staging[: got.pages], spec.block_ids[: got.pages])
        per_tier: dict[str, int] = {}
        for kind in got.tiers:
            per_tier[kind.value] = per_tier.get(kind.value, 0) + self._layout.tokens_per_page
        return TransferResult(spec.job_id, "load", got.pages == spec.num_pages, got.pages,
                              time.perf_counter() - t0, per_tier, spec.block_ids[got.pages:],
                              None if got.pages == spec.num_pages else
                              f"{spec.num_pages - got.pages} of {spec.num_pages} pages were not served")

    def _store(self, spec: StoreSpec, t0: float) -> TransferResult:
        # Rows before first_page stay unfilled: those pages are pinned in the store, so
        # put skips them and never reads these rows.
        staging = torch.empty((spec.num_pages, *self._layout.page_shape), dtype=self._dtype)
        self.blocks.gather(spec.block_ids, staging[spec.first_page:])
        put = self.store.put(spec.tokens, staging, spec.tenant, announce=not spec.announced,
                             unfilled=spec.first_page)
        return TransferResult(spec.job_id, "store", True, put.stored, time.perf_counter() - t0)

    def submit(self, spec: LoadSpec | StoreSpec) -> Future[TransferResult]:
        """Run ``spec`` on the worker's background thread; the result also goes to ``get_finished``.

        StoreClosedError once ``close()`` has begun (``transfer`` still runs a spec inline).
        """
        with self._lock:  # held across the submit, so close() cannot shut the pool in between
            if self._closed:
                raise StoreClosedError(f"this OffloadWorker is closed; job {spec.job_id} was not submitted "
                                       f"(run it with transfer(), or make a new worker)")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierkv-worker")
            return self._pool.submit(self._run_and_record, spec)

    def _run_and_record(self, spec: LoadSpec | StoreSpec) -> TransferResult:
        result = self.transfer(spec)
        with self._lock:
            self._finished.append(result)
        return result

    def get_finished(self) -> list[TransferResult]:
        """Results of submitted transfers finished since the last call."""
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def close(self) -> None:
        """Wait for submitted transfers and stop the background thread; later submits are refused."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
