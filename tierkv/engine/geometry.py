"""Declared layouts of a serving engine's paged KV, and how they map onto store pages.

An engine keeps KV as one paged tensor per layer; a store page is contiguous across
every layer (``KVLayout.page_shape``). The engine's layout is declared here (kind,
layers, block size, heads, head dim, dtype), never probed from a tensor, and checked
against the store's :class:`~tierkv.layout.KVLayout` once. :class:`PageGeometry` is the
result: the byte offsets that every copy between the two (``tierkv.engine.kv``) uses.
Pure data; no torch, no device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tierkv.errors import LayoutError
from tierkv.layout import DType, KVLayout, LayoutKind, PageOrder


class EngineLayoutKind(enum.Enum):
    """How one layer's paged KV tensor is shaped.

    - ``FLASH``: ``[2, num_blocks, block_size, kv_heads, head_dim]`` (vLLM flash-attention);
    - ``BLOCKS_FIRST``: ``[num_blocks, 2, block_size, kv_heads, head_dim]`` (FlashInfer, others);
    - ``MLA``: ``[num_blocks, block_size, latent_dim]`` (latent caches; ``head_dim`` is the latent width).
    """

    FLASH = "flash"
    BLOCKS_FIRST = "blocks_first"
    MLA = "mla"


@dataclass(frozen=True)
class EngineLayout:
    """One layer's paged KV tensor, declared by the engine. Immutable.

    ``num_kv_heads`` must be 1 for ``MLA``. ``dtype`` accepts ``DType`` or its spelling.
    """

    kind: EngineLayoutKind
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.BF16

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType.parse(self.dtype))
        if not isinstance(self.kind, EngineLayoutKind):
            try:
                object.__setattr__(self, "kind", EngineLayoutKind(str(self.kind).lower()))
            except ValueError:
                names = ", ".join(k.value for k in EngineLayoutKind)
                raise LayoutError(f"unknown engine layout {self.kind!r}; expected one of {names}") from None
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise LayoutError(f"engine layout {name} must be a positive integer, got {value!r}")
        if self.kind is EngineLayoutKind.MLA and self.num_kv_heads != 1:
            raise LayoutError(f"an MLA engine layout has one latent vector per token: num_kv_heads must be 1, "
                              f"got {self.num_kv_heads}")

    @classmethod
    def for_store(cls, store: KVLayout, kind: EngineLayoutKind | str, block_size: int | None = None) -> EngineLayout:
        """The engine layout of ``kind`` matching ``store`` (block size defaults to its tokens per page)."""
        # The constructor parses and checks ``kind`` and ``block_size`` (0 is refused, not defaulted).
        return cls(kind, store.num_layers,  # type: ignore[arg-type]
                   store.tokens_per_page if block_size is None else block_size,
                   store.num_kv_heads, store.head_dim, store.dtype)

    @property
    def planes(self) -> int:
        """2 (K and V) for K+V layouts, 1 for MLA."""
        return 1 if self.kind is EngineLayoutKind.MLA else 2

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one plane of one block in one layer: ``block_size x heads x head_dim`` elements."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's tensor holding ``num_blocks`` blocks."""
        tail = (self.block_size, self.num_kv_heads, self.head_dim)
        if self.kind is EngineLayoutKind.FLASH:
            return (2, num_blocks, *tail)
        if self.kind is EngineLayoutKind.BLOCKS_FIRST:
            return (num_blocks, 2, *tail)
        return (num_blocks, self.block_size, self.head_dim)

    def geometry(self, store: KVLayout) -> PageGeometry:
        """How blocks of this layout map onto ``store`` pages; raises LayoutError on a mismatch.

        Supported: the same layers, heads, head dim and dtype, K+V with K+V (``FLASH``,
        ``BLOCKS_FIRST``) or latent with latent (``MLA``), and ``tokens_per_page`` a
        whole multiple of ``block_size`` (a page then spans that many engine blocks).
        """
        want_latent = self.kind is EngineLayoutKind.MLA
        diffs = [f"{name} {getattr(self, name)} vs {getattr(store, name)}"
                 for name in ("num_layers", "num_kv_heads", "head_dim", "dtype")
                 if getattr(self, name) != getattr(store, name)]
        if store.page_order is not PageOrder.STANDARD:
            diffs.append(f"the store's pages are in page_order {store.page_order.value!r}; engine copies read and "
                         "write the 'standard' order")
        if want_latent != (store.kind is LayoutKind.LATENT):
            diffs.append(f"engine layout {self.kind.value} vs store layout kind {store.kind.value}")
        if store.tokens_per_page % self.block_size:
            diffs.append(f"tokens_per_page {store.tokens_per_page} is not a multiple of block_size {self.block_size}")
        if diffs:
            raise LayoutError("engine layout does not match the store layout (engine vs store): " + "; ".join(diffs))
        k = store.tokens_per_page // self.block_size
        layer_page_bytes = store.page_bytes // store.num_layers
        return PageGeometry(self, k, layer_page_bytes, layer_page_bytes // self.planes, store.page_bytes)


@dataclass(frozen=True)
class PageGeometry:
    """Byte offsets inside one store page for an engine layout.

    Layer ``l``, plane ``p`` (K=0, V=1) and sub-block ``b`` (0 .. ``blocks_per_page``-1)
    of a page start at ``l * layer_page_bytes + p * plane_page_bytes + b * chunk_bytes``
    and run for ``chunk_bytes``; engine block ``block_ids[i * blocks_per_page + b]``
    holds that chunk of page ``i``.
    """

    engine: EngineLayout
    blocks_per_page: int
    layer_page_bytes: int
    plane_page_bytes: int
    page_bytes: int

    @property
    def chunk_bytes(self) -> int:
        return self.engine.chunk_bytes

    @property
    def planes(self) -> int:
        return self.engine.planes

    @property
    def num_layers(self) -> int:
        return self.engine.num_layers
