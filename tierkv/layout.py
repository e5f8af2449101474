"""The declared KV layout of a store's pages.

A page holds ``tokens_per_page`` tokens of every layer, contiguous, layers outermost:
``[num_layers, 2, tokens_per_page, num_kv_heads, head_dim]`` for K+V caches and
``[num_layers, tokens_per_page, head_dim]`` for latent-only (MLA) caches, where
``head_dim`` is then the latent width. That is the ``standard`` page order, the one
every engine integration reads and writes. ``page_order = "vllm_cpu"`` instead keeps
each layer as vLLM's CPU attention backend packs a block (:class:`PageOrder`), so that
the vLLM connector copies a page into an engine block without permuting it; pages of
another order are another layout (another key namespace, another store format), never
read as this one. The layout is always declared by the caller (config or dataclass),
never guessed from a tensor. Used by the API to validate page batches, by the manager
for page sizes and by the key namespace.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from tierkv.errors import LayoutError

if TYPE_CHECKING:   # numpy is imported where the order functions run: `tierkv --help` loads no numpy
    import numpy as np


class DType(enum.Enum):
    """Element types a KV page may hold; the value is the config spelling."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def torch_name(self) -> str:
        """Attribute name of the matching ``torch`` dtype."""
        return _TORCH_NAME[self]

    @classmethod
    def parse(cls, value: str | DType) -> DType:
        if isinstance(value, DType):
            return value
        aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                   "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
        key = aliases.get(str(value).lower(), str(value).lower())
        try:
            return cls(key)
        except ValueError:
            names = ", ".join(d.value for d in cls)
            raise LayoutError(f"unknown KV dtype {value!r}; expected one of {names}") from None


_ITEMSIZE = {DType.BF16: 2, DType.FP16: 2, DType.FP32: 4, DType.FP8_E4M3: 1, DType.FP8_E5M2: 1}
_TORCH_NAME = {
    DType.BF16: "bfloat16",
    DType.FP16: "float16",
    DType.FP32: "float32",
    DType.FP8_E4M3: "float8_e4m3fn",
    DType.FP8_E5M2: "float8_e5m2",
}


class LayoutKind(enum.Enum):
    """Whether a page holds separate K and V or one latent vector per token."""

    KV = "kv"
    LATENT = "latent"


class PageOrder(enum.Enum):
    """How a page's elements are ordered inside each of its layers.

    - ``STANDARD``: ``[2, tokens_per_page, num_kv_heads, head_dim]`` (K then V, token-major);
      latent layouts ``[tokens_per_page, head_dim]``;
    - ``VLLM_CPU``: one block of vLLM's CPU attention backend (kernels ``vec``/``vec16``):
      ``[num_kv_heads, tokens_per_page, 2 * head_dim]`` as a tensor, where each head's
      ``2 * tokens * head_dim`` elements are K transposed (``[head_dim, tokens]``)
      followed by V (``[tokens, head_dim]``). K+V layouts only;
    - ``VLLM_CPU_AMX``: one block as the backend's ``amx`` kernel packs it (vLLM picks it on
      CPUs with AMX tiles for BF16 caches whose block size is a multiple of 32): the same
      ``[num_kv_heads, tokens_per_page, 2 * head_dim]`` tensor, each head's K packed for the
      tiles as ``[tokens/16, head_dim/2, 16, 2]`` (token ``n``, dim ``d`` at ``[n//16, d//2,
      n%16, d%2]``) followed by V as ``[head_dim/16, tokens/2, 16, 2]`` (``[d//16, n//2,
      d%16, n%2]``). BF16 K+V layouts, tokens_per_page and head_dim multiples of 32 (at other
      head dims vLLM picks ``vec16``, and the kernel would pack otherwise).
    """

    STANDARD = "standard"
    VLLM_CPU = "vllm_cpu"
    VLLM_CPU_AMX = "vllm_cpu_amx"

    @property
    def engine_blocks(self) -> bool:
        """Whether a page's layer is one engine block's bytes (an engine's packing, not the standard order)."""
        return self is not PageOrder.STANDARD


# Guards against typos such as a head_dim of 1280000 producing a 50 GiB page.
MAX_PAGE_BYTES = 1 << 31


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one store page. Immutable and hashable.

    ``num_kv_heads`` must be 1 for ``LayoutKind.LATENT``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.BF16
    tokens_per_page: int = 16
    kind: LayoutKind = LayoutKind.KV
    page_order: PageOrder = PageOrder.STANDARD

    if TYPE_CHECKING:  # dtype, kind and page_order may be given by name ("bf16", "latent"): __post_init__ parses them
        def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: DType | str = DType.BF16,
                     tokens_per_page: int = 16, kind: LayoutKind | str = LayoutKind.KV,
                     page_order: PageOrder | str = PageOrder.STANDARD) -> None: ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType.parse(self.dtype))
        if not isinstance(self.kind, LayoutKind):
            try:
                object.__setattr__(self, "kind", LayoutKind(str(self.kind).lower()))
            except ValueError:
                raise LayoutError(f"layout kind must be 'kv' or 'latent', got {self.kind!r}") from None
        if not isinstance(self.page_order, PageOrder):
            try:
                object.__setattr__(self, "page_order", PageOrder(str(self.page_order).lower()))
            except ValueError:
                names = ", ".join(repr(o.value) for o in PageOrder)
                raise LayoutError(f"layout page_order must be one of {names}, got {self.page_order!r}") from None
        if self.page_order.engine_blocks and self.kind is not LayoutKind.KV:
            raise LayoutError(f"page_order {self.page_order.value!r} (vLLM's CPU attention blocks) holds K and V: "
                              "it needs kind 'kv'")
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_page"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise LayoutError(f"layout {name} must be a positive integer, got {value!r}")
        if self.page_order is PageOrder.VLLM_CPU_AMX and (self.dtype is not DType.BF16 or self.tokens_per_page % 32
                                                          or self.head_dim % 32):
            raise LayoutError(f"page_order 'vllm_cpu_amx' (vLLM's AMX kernel's blocks) holds bf16 pages whose "
                              f"tokens_per_page and head_dim are multiples of 32; got "
                              f"{self.dtype.value}, tokens_per_page {self.tokens_per_page}, head_dim {self.head_dim}")
        if self.kind is LayoutKind.LATENT and self.num_kv_heads != 1:
            raise LayoutError(
                f"a latent (MLA) layout has one latent vector per token: num_kv_heads must be 1, "
                f"got {self.num_kv_heads}"
            )
        if self.page_bytes > MAX_PAGE_BYTES:
            raise LayoutError(
                f"layout gives {self.page_bytes} bytes per page, over the {MAX_PAGE_BYTES}-byte limit; "
                "check num_layers, num_kv_heads, head_dim and tokens_per_page"
            )

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of one page as a tensor of ``dtype`` elements."""
        if self.kind is LayoutKind.LATENT:
            return (self.num_layers, self.tokens_per_page, self.head_dim)
        if self.page_order.engine_blocks:
            return (self.num_layers, self.num_kv_heads, self.tokens_per_page, 2 * self.head_dim)
        return (self.num_layers, 2, self.tokens_per_page, self.num_kv_heads, self.head_dim)

    @property
    def token_bytes(self) -> int:
        """Bytes of KV cache one token occupies across all layers."""
        planes = 1 if self.kind is LayoutKind.LATENT else 2
        return self.num_layers * planes * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        return self.token_bytes * self.tokens_per_page

    def fingerprint(self) -> bytes:
        """Canonical bytes that identify this layout (stable across versions)."""
        fields = asdict(self)
        fields["dtype"] = self.dtype.value
        fields["kind"] = self.kind.value
        if self.page_order is PageOrder.STANDARD:   # absent: stores and keys made before the field stay valid
            del fields["page_order"]
        else:
            fields["page_order"] = self.page_order.value
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def plane_tiles(layout: KVLayout) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """How one head's K and V planes of ``layout``'s engine order lie: the shape each is
    viewed as, and the permutation of that view's axes that gives ``[tokens, head_dim]``
    (split into sub-axes that reshape back to it)."""
    tpp, dim = layout.tokens_per_page, layout.head_dim
    if layout.page_order is PageOrder.VLLM_CPU_AMX:
        # K [n//16, d//2, n%16, d%2] -> (n//16, n%16, d//2, d%2); V [d//16, n//2, d%16, n%2] -> (n//2, n%2, d//16, d%16)
        return (tpp // 16, dim // 2, 16, 2), (0, 2, 1, 3), (dim // 16, tpp // 2, 16, 2), (1, 3, 0, 2)
    return (dim, tpp), (1, 0), (tpp, dim), (0, 1)   # K^T [d, n], V [n, d]


def to_standard_order(pages: np.ndarray, layout: KVLayout) -> np.ndarray:
    """Pages ``[n, *layout.page_shape]`` (any element type) as a standard-order copy
    ``[n, layers, 2, tokens, heads, head_dim]``: from vLLM's CPU orders (``[n, layers, heads,
    tokens, 2 * head_dim]``: per head, a K plane then a V plane, each of ``tokens * head_dim``
    elements packed as :class:`PageOrder` says), or the standard order itself. K/V layouts only."""
    import numpy as np

    if layout.page_order is PageOrder.STANDARD:
        return np.ascontiguousarray(pages.reshape(pages.shape[0], *layout.page_shape))
    n, layers, heads, tpp, dim = pages.shape[0], layout.num_layers, layout.num_kv_heads, layout.tokens_per_page, \
        layout.head_dim
    kshape, kperm, vshape, vperm = plane_tiles(layout)
    flat = pages.reshape(n, layers, heads, 2 * tpp * dim)
    lead = (0, 1, 2)
    k = flat[..., :tpp * dim].reshape(n, layers, heads, *kshape).transpose(*lead, *(3 + a for a in kperm))
    val = flat[..., tpp * dim:].reshape(n, layers, heads, *vshape).transpose(*lead, *(3 + a for a in vperm))
    k = k.reshape(n, layers, heads, tpp, dim).transpose(0, 1, 3, 2, 4)       # [n, L, tpp, H, D]
    val = val.reshape(n, layers, heads, tpp, dim).transpose(0, 1, 3, 2, 4)
    return np.ascontiguousarray(np.stack([k, val], axis=2))


def from_standard_order(std: np.ndarray, layout: KVLayout) -> np.ndarray:
    """:func:`to_standard_order` undone: ``[n, *layout.page_shape]``."""
    import numpy as np

    if layout.page_order is PageOrder.STANDARD:
        return np.ascontiguousarray(std.reshape(std.shape[0], *layout.page_shape))
    n, layers, heads, tpp, dim = std.shape[0], layout.num_layers, layout.num_kv_heads, layout.tokens_per_page, \
        layout.head_dim
    kshape, kperm, vshape, vperm = plane_tiles(layout)
    planes = []
    for plane, shape, perm in ((std[:, :, 0], kshape, kperm), (std[:, :, 1], vshape, vperm)):
        per_head = plane.transpose(0, 1, 3, 2, 4)                              # [n, L, H, tpp, D]
        split = per_head.reshape(n, layers, heads, *(shape[a] for a in perm))  # the permuted view's axes
        back = np.argsort(perm)                                                 # ... and the packed order
        planes.append(split.transpose(0, 1, 2, *(3 + int(a) for a in back)).reshape(n, layers, heads, tpp * dim))
    return np.concatenate(planes, axis=-1).reshape(n, layers, heads, tpp, 2 * dim)
