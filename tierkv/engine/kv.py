"""Batched copies between a serving engine's paged KV and store pages: gather and scatter.

:class:`EngineKV` registers an engine's per-layer KV tensors once (declared layout,
checked shapes, strides and base addresses), then moves blocks by index:
``gather(block_ids)`` builds store pages from engine blocks, ``scatter(pages,
block_ids)`` writes pages back into engine blocks. Pages are a ``uint8 [rows,
>= page_bytes]`` tensor on the engine's device (e.g. HBM tier slots) or on the host
(pinned DRAM tier slots); ``rows`` picks which of its rows take part, ``layers`` a
contiguous range of layers (the layer-wise loader copies one at a time).

Two paths (:class:`CopyPath`), chosen per registration:

- ``KERNEL``: one CUDA launch per call covering every layer, block and plane
  (:mod:`tierkv.engine.cuda`); host pages must be pinned (they are read or written
  in place through unified addressing, no staging). On CPU, the same descriptors run
  through a host emulation: slow, for tests only.
- ``TORCH``: ``index_select`` / ``index_copy_`` per layer on the engine's device.
  Host pages with a CUDA engine are staged through a device buffer (one copy per run
  of consecutive rows). The only path on CPU; the CUDA fallback without CuPy.

Copies are stream-ordered on the current CUDA stream and return at once (synchronize,
or run them under :class:`~tierkv.engine.streams.CopyStream` for a future); on CPU they
complete before returning. Arguments are checked before anything moves: block ids and
rows in range, no duplicate destinations, dtype, shapes and devices (InputError); at
registration, that no two (layer, block, K/V plane) chunks share bytes (0.4 s once for
100,000 blocks of 32 layer-interleaved layers, milliseconds for separate tensors).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tierkv.engine import cuda
from tierkv.engine.geometry import EngineLayout, EngineLayoutKind, PageGeometry
from tierkv.engine.rows import CopyPath, Indices, as_indices, check_rows, check_rows_tensor, copy_runs, parse_path
from tierkv.errors import InputError
from tierkv.layout import KVLayout


class EngineKV:
    """An engine's paged KV (one tensor per layer) registered for batched copies to store pages.

    ``layers[l]`` has shape ``layout.layer_shape(num_blocks)`` and the layout's dtype;
    the innermost block (``[block_size, heads, head_dim]`` or ``[block_size, latent]``)
    must be contiguous, the block and K/V strides may be anything (views of one
    allocation are fine) but equal across layers. The tensors stay owned by the engine;
    keep them alive while this object is used. Copies on disjoint blocks and rows may
    run concurrently; the object itself holds no mutable state after construction.
    """

    def __init__(self, layout: EngineLayout, layers: Sequence[torch.Tensor], store: KVLayout,
                 path: CopyPath | str | None = None, max_ctas: int | None = None) -> None:
        self.layout = layout
        self.geometry: PageGeometry = layout.geometry(store)
        self._layers = list(layers)
        self.num_blocks, block_stride, plane_stride = _check_layers(layout, self._layers)
        self.device = self._layers[0].device
        self.path = parse_path(path, self.device)
        if self.path is CopyPath.KERNEL and self.device.type == "cuda" and not cuda.kernel_available():
            raise InputError("CopyPath.KERNEL needs CuPy on a CUDA machine; use CopyPath.TORCH")
        if max_ctas is not None and (isinstance(max_ctas, bool) or not isinstance(max_ctas, int) or max_ctas < 1):
            raise InputError(f"max_ctas must be a positive integer or None, got {max_ctas!r}")
        self.max_ctas = max_ctas
        item = layout.dtype.itemsize
        self._block_stride, self._plane_stride = block_stride * item, plane_stride * item
        self._layer_addrs = np.array([t.data_ptr() for t in self._layers], dtype=np.int64)
        _check_disjoint(self._layer_addrs, self.num_blocks, layout.planes, layout.chunk_bytes,
                        self._block_stride, self._plane_stride)
        self._chunks = [torch.as_strided(t.view(torch.uint8), (self.num_blocks, layout.planes, layout.chunk_bytes),
                                         (self._block_stride, self._plane_stride, 1),
                                         t.storage_offset() * item) for t in self._layers]

    @property
    def page_bytes(self) -> int:
        return self.geometry.page_bytes

    def empty_pages(self, n: int, device: str | torch.device | None = None, pin: bool = False) -> torch.Tensor:
        """A ``uint8 [n, page_bytes]`` page buffer on ``device`` (default: the engine's), pinned if asked."""
        dev = torch.device(device) if device is not None else self.device
        return torch.empty((n, self.page_bytes), dtype=torch.uint8, device=dev, pin_memory=pin)

    # -- the two operations ---------------------------------------------------------------
    def gather(self, block_ids: Indices, out: torch.Tensor | None = None, rows: Indices | None = None,
               layers: range | None = None) -> torch.Tensor:
        """Copy engine blocks into pages: page ``i`` (row ``rows[i]`` of ``out``) takes blocks
        ``block_ids[i*k:(i+1)*k]``, ``k = tokens_per_page // block_size``. Returns ``out``
        (a new ``[n, page_bytes]`` tensor on the engine's device when not given)."""
        ids = self._ids(block_ids, unique=False)
        n = len(ids) // self.geometry.blocks_per_page
        pages = out if out is not None else self.empty_pages(n)
        rows_np = self._rows(pages, rows, n, unique=True)
        self._copy(ids, pages, rows_np, self._layer_range(layers), to_pages=True)()
        return pages

    def scatter(self, pages: torch.Tensor, block_ids: Indices, rows: Indices | None = None,
                layers: range | None = None) -> None:
        """Copy pages into engine blocks (the inverse of :meth:`gather`); other blocks are untouched."""
        ids = self._ids(block_ids, unique=True)
        rows_np = self._rows(pages, rows, len(ids) // self.geometry.blocks_per_page, unique=False)
        self._copy(ids, pages, rows_np, self._layer_range(layers), to_pages=False)()

    def layer_copies(self, pages: torch.Tensor, block_ids: Indices,
                     rows: Indices | None = None) -> list[Callable[[], None]]:
        """Checked scatter of every layer as one callable per layer, to be run in order
        (by :func:`tierkv.engine.layerwise.load_layers` on a copy stream)."""
        ids = self._ids(block_ids, unique=True)
        rows_np = self._rows(pages, rows, len(ids) // self.geometry.blocks_per_page, unique=False)
        if self.path is CopyPath.KERNEL and self._reachable(pages):
            return self._kernel_layers(ids, pages, rows_np)
        if pages.device != self.device:
            stage: list[torch.Tensor] = []  # host pages on a TORCH-path CUDA engine: stage once, then per layer

            def first() -> None:
                stage.append(self._stage_in(pages, rows_np))
                self._torch_copy(ids, stage[0], np.arange(len(rows_np)), range(0, 1), to_pages=False)

            def later(j: int) -> None:
                self._torch_copy(ids, stage[0], np.arange(len(rows_np)), range(j, j + 1), to_pages=False)
            return [first, *(functools.partial(later, j) for j in range(1, self.geometry.num_layers))]
        return [functools.partial(self._torch_copy, ids, pages, rows_np, range(j, j + 1), False)
                for j in range(self.geometry.num_layers)]

    def descriptors(self, block_ids: np.ndarray, pages_addr: int, pitch: int, rows: np.ndarray,
                    layers: range, to_pages: bool) -> np.ndarray:
        """The kernel's batch: ``int64 [units, 2]`` (source, destination) addresses, layer-major.

        Unit ``(layer j, page i, sub-block b, plane p)`` moves one chunk between engine
        block ``block_ids[i*k+b]`` of layer ``j`` and page row ``rows[i]`` at the offsets of
        :class:`PageGeometry`. Arguments must already be checked.
        """
        g = self.geometry
        lay = np.arange(layers.start, layers.stop, dtype=np.int64)[:, None, None, None]
        ids = block_ids.reshape(len(rows), g.blocks_per_page)[None, :, :, None]
        sub = np.arange(g.blocks_per_page, dtype=np.int64)[None, None, :, None]
        plane = np.arange(g.planes, dtype=np.int64)[None, None, None, :]
        engine = self._layer_addrs[lay] + ids * self._block_stride + plane * self._plane_stride
        page = (pages_addr + rows.astype(np.int64)[None, :, None, None] * pitch + lay * g.layer_page_bytes
                + sub * g.chunk_bytes + plane * g.plane_page_bytes)
        engine, page = np.broadcast_arrays(engine, page)
        src, dst = (engine, page) if to_pages else (page, engine)
        return np.stack([src.ravel(), dst.ravel()], axis=1)

    # -- checks -----------------------------------------------------------------------------
    def _ids(self, block_ids: Indices, unique: bool) -> np.ndarray:
        ids = as_indices(block_ids, "block_ids")
        k = self.geometry.blocks_per_page
        if len(ids) % k:
            raise InputError(f"{len(ids)} block ids do not fill whole pages of {k} blocks each")
        check_rows(ids, self.num_blocks, "block id", unique)
        return ids

    def _rows(self, pages: torch.Tensor, rows: Indices | None, n: int, unique: bool) -> np.ndarray:
        check_rows_tensor(pages, self.page_bytes, "pages")
        if pages.device != self.device and not (pages.device.type == "cpu" and self.device.type == "cuda"):
            raise InputError(f"pages on {pages.device} cannot be copied to or from an engine on {self.device}")
        rows_np = np.arange(n, dtype=np.int64) if rows is None else as_indices(rows, "rows")
        if len(rows_np) != n:
            raise InputError(f"{n} pages of block ids but {len(rows_np)} rows")
        check_rows(rows_np, pages.shape[0], "page row", unique)
        return rows_np

    def _layer_range(self, layers: range | None) -> range:
        total = self.geometry.num_layers
        if layers is None:
            return range(total)
        if not isinstance(layers, range) or layers.step != 1 or not 0 <= layers.start <= layers.stop <= total:
            raise InputError(f"layers must be a contiguous range inside [0, {total}), got {layers}")
        return layers

    def _reachable(self, pages: torch.Tensor) -> bool:
        """Whether the kernel can address ``pages`` in place (device memory, or pinned host memory)."""
        return pages.device.type == self.device.type or pages.is_pinned()

    # -- the paths ----------------------------------------------------------------------------
    def _copy(self, ids: np.ndarray, pages: torch.Tensor, rows: np.ndarray, layers: range,
              to_pages: bool) -> Callable[[], None]:
        if self.path is CopyPath.KERNEL and self._reachable(pages):
            def kernel() -> None:
                desc = self.descriptors(ids, cuda.device_address(pages) if self.device.type == "cuda"
                                        else pages.data_ptr(), pages.stride(0), rows, layers, to_pages)
                cuda.copy_batch(desc, self.geometry.chunk_bytes, self.device, self.max_ctas)
            return kernel
        if pages.device == self.device:
            return lambda: self._torch_copy(ids, pages, rows, layers, to_pages)
        return lambda: self._staged(ids, pages, rows, layers, to_pages)

    def _kernel_layers(self, ids: np.ndarray, pages: torch.Tensor, rows: np.ndarray) -> list[Callable[[], None]]:
        g = self.geometry
        addr = cuda.device_address(pages) if self.device.type == "cuda" else pages.data_ptr()
        desc = self.descriptors(ids, addr, pages.stride(0), rows, range(g.num_layers), to_pages=False)
        per = len(desc) // g.num_layers
        if self.device.type == "cpu":
            return [functools.partial(cuda.emulate, desc[j * per:(j + 1) * per], g.chunk_bytes)
                    for j in range(g.num_layers)]
        vec = cuda.vector_bytes(desc, g.chunk_bytes)
        ctas = self.max_ctas or cuda.default_ctas(self.device)
        held: list[torch.Tensor] = []

        def launch(j: int) -> None:
            if not held:  # one upload on the stream the copies run on, by the first layer's copy
                held.append(cuda.upload(desc, self.device))
            cuda.launch(held[0][j * per:(j + 1) * per], per, g.chunk_bytes, vec, ctas)
        return [functools.partial(launch, j) for j in range(g.num_layers)]

    def _torch_copy(self, ids: np.ndarray, pages: torch.Tensor, rows: np.ndarray, layers: range,
                    to_pages: bool) -> None:
        """Index ops per layer; ``pages`` is on the engine's device."""
        g = self.geometry
        n, k, planes, chunk = len(rows), g.blocks_per_page, g.planes, g.chunk_bytes
        if n == 0:
            return
        ids_t = torch.from_numpy(ids).to(self.device, non_blocking=True)
        rows_t = torch.from_numpy(rows).to(self.device, non_blocking=True)
        view = torch.as_strided(pages, (pages.shape[0], g.num_layers, planes, k, chunk),
                                (pages.stride(0), g.layer_page_bytes, g.plane_page_bytes, chunk, 1),
                                pages.storage_offset())
        for j in layers:
            if to_pages:
                blocks = self._chunks[j].index_select(0, ids_t).view(n, k, planes, chunk).transpose(1, 2)
                view[:, j].index_copy_(0, rows_t, blocks)
            else:
                part = view[:, j].index_select(0, rows_t).transpose(1, 2).reshape(n * k, planes, chunk)
                self._chunks[j].index_copy_(0, ids_t, part)

    def _staged(self, ids: np.ndarray, pages: torch.Tensor, rows: np.ndarray, layers: range,
                to_pages: bool) -> None:
        """Host pages for a CUDA engine without the kernel: through a device buffer of whole pages."""
        local = np.arange(len(rows), dtype=np.int64)
        if to_pages:
            stage = torch.empty((len(rows), self.page_bytes), dtype=torch.uint8, device=self.device)
            if layers != range(self.geometry.num_layers):  # the rows' other layers must survive the copy back
                copy_runs(stage, local, pages, rows, self.page_bytes)
            self._copy_on_device(ids, stage, local, layers, True)
            copy_runs(pages, rows, stage, local, self.page_bytes)
        else:
            self._copy_on_device(ids, self._stage_in(pages, rows), local, layers, False)

    def _copy_on_device(self, ids: np.ndarray, stage: torch.Tensor, rows: np.ndarray, layers: range,
                        to_pages: bool) -> None:
        if self.path is CopyPath.KERNEL:
            self._copy(ids, stage, rows, layers, to_pages)()
        else:
            self._torch_copy(ids, stage, rows, layers, to_pages)

    def _stage_in(self, pages: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        stage = torch.empty((len(rows), self.page_bytes), dtype=torch.uint8, device=self.device)
        copy_runs(stage, np.arange(len(rows), dtype=np.int64), pages, rows, self.page_bytes)
        return stage


def gather(kv: EngineKV, block_ids: Indices, out: torch.Tensor | None = None, rows: Indices | None = None,
           layers: range | None = None) -> torch.Tensor:
    """``kv.gather(...)``: engine blocks to store pages (see :meth:`EngineKV.gather`)."""
    return kv.gather(block_ids, out, rows, layers)


def scatter(pages: torch.Tensor, kv: EngineKV, block_ids: Indices, rows: Indices | None = None,
            layers: range | None = None) -> None:
    """``kv.scatter(...)``: store pages to engine blocks (see :meth:`EngineKV.scatter`)."""
    kv.scatter(pages, block_ids, rows, layers)


def _check_layers(layout: EngineLayout, layers: list[torch.Tensor]) -> tuple[int, int, int]:
    """Validate the per-layer tensors; returns (num_blocks, block stride, K/V stride) in elements."""
    if len(layers) != layout.num_layers:
        raise InputError(f"the engine layout declares {layout.num_layers} layers, got {len(layers)} tensors")
    first = layers[0]
    if not isinstance(first, torch.Tensor):
        raise InputError(f"engine KV layers must be torch tensors, got {type(first).__name__}")
    block_dim = 1 if layout.kind is EngineLayoutKind.FLASH else 0
    if first.dim() != len(layout.layer_shape(1)):
        raise InputError(f"engine KV layer 0 has shape {list(first.shape)}; the {layout.kind.value} layout "
                         f"expects {list(layout.layer_shape(1))} with any number of blocks")
    num_blocks = first.shape[block_dim]
    want_shape = layout.layer_shape(num_blocks)
    want_dtype = getattr(torch, layout.dtype.torch_name)
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want_shape or t.dtype != want_dtype:
            raise InputError(f"engine KV layer {i}: expected {want_dtype} of shape {list(want_shape)}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} of shape {list(getattr(t, 'shape', []))}")
        if t.device != first.device or t.stride() != first.stride():
            raise InputError(f"engine KV layer {i} differs from layer 0 in device or strides "
                             f"({t.device} {t.stride()} vs {first.device} {first.stride()})")
    inner = want_shape[-2:] if layout.kind is EngineLayoutKind.MLA else want_shape[-3:]
    want_inner = tuple(int(np.prod(inner[d + 1:])) for d in range(len(inner)))
    if tuple(first.stride()[-len(inner):]) != want_inner or min(first.stride()) <= 0:
        raise InputError(f"engine KV blocks must be contiguous inside ({list(inner)} with strides {list(want_inner)}); "
                         f"got strides {list(first.stride())}")
    plane_stride = 0 if layout.kind is EngineLayoutKind.MLA else first.stride(1 - block_dim)
    return num_blocks, first.stride(block_dim), plane_stride


def _check_disjoint(addrs: np.ndarray, blocks: int, planes: int, chunk: int, block_stride: int,
                    plane_stride: int) -> None:
    """Refuse layers whose (layer, block, plane) chunks share bytes: a scatter into one block
    would silently change another. Byte addresses only; nothing is read.

    Cost: a sort of one layer's ``blocks * planes`` offsets; all layers' only when their
    spans overlap (views of one layer-interleaved allocation). Layers that are the same
    tensor (vLLM's KV sharing across layers) are one layer here: a scatter writes them
    the same bytes.
    """
    if blocks == 0:
        return
    addrs = np.unique(addrs)            # strides are equal across layers: one address, one tensor
    offsets = np.sort((np.arange(blocks, dtype=np.int64)[:, None] * block_stride
                       + np.arange(planes, dtype=np.int64)[None, :] * plane_stride).ravel())
    if (np.diff(offsets) < chunk).any():
        raise InputError(f"engine KV blocks overlap inside a layer (block stride {block_stride} bytes, K/V stride "
                         f"{plane_stride} bytes, {chunk} bytes per block and plane)")
    order = np.argsort(addrs, kind="stable")
    starts = addrs[order] + offsets[0]
    ends = addrs[order] + offsets[-1] + chunk
    if (starts[1:] >= np.maximum.accumulate(ends)[:-1]).all():
        return                                   # layer spans are disjoint
    every = (addrs[:, None] + offsets[None, :]).ravel()
    idx = np.argsort(every, kind="stable")
    clash = np.flatnonzero(np.diff(every[idx]) < chunk)
    if clash.size:
        a, b = sorted((int(idx[clash[0]]) // offsets.size, int(idx[clash[0] + 1]) // offsets.size))
        where = f"layers {a} and {b}" if a != b else f"layer {a}"
        raise InputError(f"engine KV {where} share memory: every layer, block and K/V plane must own its bytes")
