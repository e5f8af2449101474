"""vLLM's CPU paged KV cache, as store pages: per-layer copies between engine blocks and pages.

vLLM's CPU attention backend (layout "LBHNC") keeps one tensor per layer, ``[num_blocks,
H, N, 2*D]`` (H KV heads, N = block size in tokens, D = head dim). Its cache-write kernel
stores each (block, head) plane of ``2*N*D`` elements as a K plane then a V plane of
``N*D`` elements each, packed as its attention kernel reads them:

- ``vec`` and ``vec16``: K transposed (``[D, N]``: element (d, n) at ``d*N + n``), V
  token-major (``[N, D]`` at ``n*D + d``);
- ``amx`` (CPUs with AMX tiles, BF16 caches, N a multiple of 32): K as ``[N/16, D/2, 16,
  2]`` (at ``[n//16, d//2, n%16, d%2]``), V as ``[D/16, N/2, 16, 2]`` (at ``[d//16, n//2,
  d%16, n%2]``).

``tools/vllm_probe/layout_check.py`` and ``tests/integrations/test_vllm_engine.py``
check both against the kernel itself (the latter for ``amx`` where the CPU has AMX).

Two kinds of page order (:class:`~tierkv.layout.PageOrder`, the store's ``[layout]
page_order``):

- the engine's own, ``vllm_cpu`` (vec, vec16) or ``vllm_cpu_amx`` (amx): each layer of a
  page is one engine block's bytes for that layer, as the kernel packs it, so a copy is a
  plain copy of ``H*N*2*D`` elements per block and layer (16 blocks of SmolLM2, all
  layers: 3.4-6.3 ms here against 8-35 ms permuting); pages are then this kernel's, under
  a key namespace of their own, and an engine whose kernel packs otherwise is refused;
- ``standard``: ``[layers, 2, N, H, D]``, the order every integration shares, so each
  copy permutes (K and V unpacked, heads and tokens swapped), from any kernel.

Copies go one layer at a time (the connector saves a layer as soon as the forward pass
has written it and loads a layer just before the forward pass reads it). Consecutive
block ids are copied as one slice, scattered ones with one indexed copy (per plane
when permuting): a copy per block costs more in dispatch than in bytes (16 blocks,
all layers, permuting: 10 ms that way against 19-29 ms block by block).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierkv.errors import InputError, LayoutError
from tierkv.layout import KVLayout, PageOrder, plane_tiles

#: The CPU attention kernels whose block packing this module knows, with the page order
#: that keeps their blocks as they are (vLLM's other CPU kernels, neon, vsx, vxe, rvv, are
#: for other architectures, unprobed: refused rather than stored in a wrong order).
KNOWN_CPU_KERNELS = {"vec": PageOrder.VLLM_CPU, "vec16": PageOrder.VLLM_CPU, "amx": PageOrder.VLLM_CPU_AMX}


def runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``block_ids`` as runs of consecutive ids: ``(first_index, first_block, length)``."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if out and out[-1][1] + out[-1][2] == b:
            start, first, n = out[-1]
            out[-1] = (start, first, n + 1)
        else:
            out.append((i, int(b), 1))
    return out


class CpuPagedKV:
    """The per-layer caches of one vLLM CPU worker, checked against a store's layout."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout, kernel: str) -> None:
        """``kernel``: the CPU attention kernel vLLM picked for these caches (how its blocks are
        packed; no default: on a CPU with AMX the same caches may be packed either way)."""
        if kernel not in KNOWN_CPU_KERNELS:
            raise LayoutError(f"vLLM's CPU attention kernel here is {kernel!r}, whose block packing tierkv does not "
                              f"know (it knows {', '.join(KNOWN_CPU_KERNELS)}); refusing rather than storing pages "
                              "in a wrong order")
        own = KNOWN_CPU_KERNELS[kernel]
        if layout.page_order.engine_blocks and layout.page_order is not own:
            raise LayoutError(f"the store's pages are in page_order {layout.page_order.value!r}, another CPU "
                              f"kernel's block packing; this engine's kernel is {kernel!r}, whose blocks are "
                              f"page_order {own.value!r}: declare [layout] page_order = \"{own.value}\" (or "
                              "\"standard\", which every kernel reads) in the daemon's config")
        if not layers:
            raise InputError("the engine registered no KV cache layers")
        first = layers[0]
        if first.dim() != 4:
            raise LayoutError(f"vLLM's CPU KV cache is [num_blocks, kv_heads, block_size, 2*head_dim] per layer; "
                              f"got {list(first.shape)}")
        nb, h, n, d2 = (int(x) for x in first.shape)
        engine = {"num_layers": len(layers), "num_kv_heads": h, "head_dim": d2 // 2,
                  "tokens_per_page": n, "dtype": str(first.dtype).removeprefix("torch.")}
        store = {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
                 "tokens_per_page": layout.tokens_per_page, "dtype": layout.dtype.torch_name}
        if engine != store or layout.kind.value != "kv":
            diff = ", ".join(f"{k}: engine {engine[k]} vs store {store[k]}" for k in engine if engine[k] != store[k])
            raise LayoutError(f"the store's layout does not match this vLLM engine's KV cache ({diff or 'kind'}); "
                              f"declare [layout] num_layers={engine['num_layers']}, num_kv_heads={h}, "
                              f"head_dim={d2 // 2}, tokens_per_page={n} (the engine's block size), "
                              f"dtype={layout.dtype.parse(str(engine['dtype'])).value}, kind=\"kv\", "
                              f"page_order=\"{own.value}\" in the daemon's config")
        for i, t in enumerate(layers):
            if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype or not t.is_contiguous():
                raise LayoutError(f"KV cache layer {i} is {t.dtype} {list(t.shape)} (contiguous: {t.is_contiguous()}); "
                                  f"layer 0 is {first.dtype} {list(first.shape)}")
        self.layers = list(layers)
        self.layout = layout
        self.kernel = kernel
        self.native = layout.page_order is own   # a page's layer is a block's bytes
        self.num_blocks, self.heads, self.block_tokens, self.head_dim = nb, h, n, d2 // 2
        # How the kernel packs a head's K and V planes, as views whose axes run tokens, then
        # the head, then dims (each split in sub-axes where the kernel tiles them).
        packed = KVLayout(1, h, d2 // 2, layout.dtype, n, page_order=own)
        self._tiles = plane_tiles(packed)
        self._views = self._plane_views()

    def pages(self, rows: torch.Tensor) -> torch.Tensor:
        """``uint8 [n, page_bytes]`` rows (a store buffer) viewed as ``[n, *page_shape]`` pages
        (``[n, layers, 2, N, H, D]``, or ``[n, layers, H, N, 2*D]`` in an engine's order)."""
        return rows.view(self.layers[0].dtype).view(rows.shape[0], *self.layout.page_shape)

    def _plane_views(self) -> list[tuple[tuple[int, ...], tuple[int, ...], bool]]:
        """K's and V's packing as ``(shape, perm, paired)``: ``paired`` where the packing's
        innermost axis is a pair of 2-byte elements that stays innermost in the standard
        order too (the AMX kernel's K: a pair of dims), so both sides are viewed as 4-byte
        elements without that axis and the copy moves half as many, twice as wide (16
        blocks of SmolLM2, all layers: K in 3 ms against 19)."""
        kshape, kperm, vshape, vperm = self._tiles
        out = []
        for shape, perm in ((kshape, kperm), (vshape, vperm)):
            paired = (self.layers[0].element_size() == 2 and shape[-1] == 2 and perm[-1] == len(shape) - 1)
            out.append((shape[:-1], perm[:-1], True) if paired else (shape, perm, False))
        return out

    def _planes(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of an engine-shaped tensor ``[blocks, H, N, 2*D]`` as views ``[blocks,
        *token_axes, H, *dim_axes]`` (``[blocks, N, H, D]`` for vec: the same shape as
        :meth:`_page_planes`' views of pages, so the two copy into each other)."""
        b, h, nd = cache.shape[0], self.heads, self.block_tokens * self.head_dim
        flat = cache.view(b, h, 2, nd)
        out = []
        for i, (shape, perm, paired) in enumerate(self._views):
            half = (len(perm) + paired) // 2   # the token sub-axes come first in perm
            plane = flat[:, :, i].view(torch.int32) if paired else flat[:, :, i]
            view = plane.view(b, h, *shape)   # splitting the contiguous plane: a view
            out.append(view.permute(0, *(2 + a for a in perm[:half]), 1, *(2 + a for a in perm[half:])))
        return out[0], out[1]

    def _page_planes(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Standard-order pages of one layer ``[n, 2, N, H, D]`` as K and V views shaped like
        :meth:`_planes`' (tokens and dims split as the kernel tiles them)."""
        n = pages.shape[0]
        out = []
        for i, (shape, perm, paired) in enumerate(self._views):
            half = (len(perm) + paired) // 2
            tokens, dims = [shape[a] for a in perm[:half]], [shape[a] for a in perm[half:]]
            plane = pages[:, i].view(torch.int32) if paired else pages[:, i]
            out.append(plane.view(n, *tokens, self.heads, *dims))
        return out[0], out[1]

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise InputError(f"block ids must lie in [0, {self.num_blocks}), got {bad[:8]}")

    def gather(self, layer: int, block_ids: Sequence[int], pages: torch.Tensor) -> None:
        """Copy layer ``layer`` of engine blocks ``block_ids`` into ``pages[i, layer]``."""
        self._check_ids(block_ids)
        cache, n = self.layers[layer], len(block_ids)
        spans = runs(block_ids)
        if self.native:   # a run of blocks is one copy
            for start, first, m in spans:
                pages[start:start + m, layer].copy_(cache[first:first + m])
            return
        if len(spans) > 1:   # scattered blocks: one gather per plane beats a copy per block
            ids = torch.as_tensor(list(block_ids), dtype=torch.long)
            k, v = self._planes(cache)
            pk, pv = self._page_planes(pages[:n, layer])
            pk.copy_(k.index_select(0, ids))
            pv.copy_(v.index_select(0, ids))
            return
        for start, first, m in spans:
            k, v = self._planes(cache[first:first + m])
            pk, pv = self._page_planes(pages[start:start + m, layer])
            pk.copy_(k)
            pv.copy_(v)

    def scatter(self, layer: int, pages: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copy ``pages[i, layer]`` into layer ``layer`` of engine block ``block_ids[i]``."""
        self._check_ids(block_ids)
        cache, n = self.layers[layer], len(block_ids)
        spans = runs(block_ids)
        if self.native:   # a run of blocks is one copy (index_copy_ of whole blocks took 2x this loop)
            for start, first, m in spans:
                cache[first:first + m].copy_(pages[start:start + m, layer])
            return
        if len(spans) > 1:   # scattered blocks (vLLM hands out freed blocks in any order)
            ids = torch.as_tensor(list(block_ids), dtype=torch.long)
            k, v = self._planes(cache)
            pk, pv = self._page_planes(pages[:n, layer])
            k.index_copy_(0, ids, pk)
            v.index_copy_(0, ids, pv)
            return
        for start, first, m in spans:
            k, v = self._planes(cache[first:first + m])
            pk, pv = self._page_planes(pages[start:start + m, layer])
            k.copy_(pk)
            v.copy_(pv)
