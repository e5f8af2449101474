"""Validation of page batches handed in by serving engines.

Engines pass pages as a torch tensor ``[n, *layout.page_shape]`` in the layout's
dtype, or as raw bytes: a uint8 torch tensor or numpy array ``[n, page_bytes]``.
Either becomes a zero-copy ``uint8 [n, page_bytes]`` numpy view. A put may also take
a list of separate pages (each ``[*layout.page_shape]`` in the layout's dtype, or
``uint8 [page_bytes]``), which becomes a :class:`PageList` of zero-copy views, so the
caller need not stack them into one batch first (a copy of every byte). Every mismatch
raises :class:`~tierkv.errors.InputError` naming what was expected. Called by the API.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Union, overload

import numpy as np

from tierkv.errors import InputError
from tierkv.layout import KVLayout

if TYPE_CHECKING:
    import torch

# torch is imported lazily (it takes seconds, and minutes in the emulated rig guest): a
# caller holding a tensor has imported it already, so sys.modules tells whether one can be.
PageBatch = Union["torch.Tensor", np.ndarray]
#: What ``Store.put`` takes: a batch, or a list of separate pages.
PageSource = Union[PageBatch, Sequence["torch.Tensor"], Sequence[np.ndarray]]


class PageList:
    """Pages held as separate ``uint8 [page_bytes]`` arrays (views of the caller's pages).

    Stands where a ``uint8 [n, page_bytes]`` batch would in the put path: ``shape``,
    ``len``, integer indexing (one page's row) and slicing (another PageList, no copy).
    A tier that can copy page by page takes it as is; the others stack it once into
    their own (aligned) buffer.
    """

    __slots__ = ("_rows", "shape", "aligned", "checked", "scattered")

    def __init__(self, rows: list[np.ndarray], page_bytes: int, *, aligned: bool = False,
                 checked: bool = False, scattered: bool = False) -> None:
        self._rows = rows
        self.shape = (len(rows), page_bytes)
        #: Every row is known to start on an O_DIRECT boundary (False: not known).
        self.aligned = aligned
        #: Every row is known to be a C-contiguous uint8 array of ``page_bytes`` bytes (rows
        #: of a tier's own buffer): tiers skip checking them one by one.
        self.checked = checked
        #: The rows are known to lie on 4 KiB pages the kernel gave no huge pages (a DRAM
        #: tier's shared memory where ``shmem_enabled`` is ``never``): a tier doing direct
        #: I/O moves them through its own huge-page buffers, in larger pieces, even where
        #: they are aligned (docs/design.md, "NVMe I/O").
        self.scattered = scattered

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self._rows)

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, i: slice) -> PageList: ...

    def __getitem__(self, i: int | slice) -> np.ndarray | PageList:
        if isinstance(i, slice):
            return PageList(self._rows[i], self.shape[1], aligned=self.aligned, checked=self.checked,
                            scattered=self.scattered)
        return self._rows[i]

    def take(self, idx: Sequence[int]) -> PageList:
        """The pages at ``idx``, in that order (no copy)."""
        return PageList([self._rows[i] for i in idx], self.shape[1], aligned=self.aligned, checked=self.checked,
                        scattered=self.scattered)

    def stacked(self, out: np.ndarray) -> np.ndarray:
        """Copy the pages into the rows of ``out`` (``uint8 [n, page_bytes]``); returns ``out``."""
        for i, row in enumerate(self._rows):
            out[i] = row
        return out


#: Rows as the put path carries them.
Rows = Union[np.ndarray, PageList]


def _is_tensor(x: object) -> bool:
    torch_mod = sys.modules.get("torch")
    return torch_mod is not None and isinstance(x, torch_mod.Tensor)


def page_list(pages: Sequence[object], layout: KVLayout, what: str, max_pages: int) -> PageList:
    """A :class:`PageList` of zero-copy views of separate pages; raises InputError on any mismatch."""
    pb = layout.page_bytes
    if len(pages) > max_pages:
        raise InputError(f"{what}: {len(pages)} pages given but the tokens hold only {max_pages} full "
                         f"pages of {layout.tokens_per_page} tokens")
    rows: list[np.ndarray] = []
    flat, u8 = (pb,), np.dtype(np.uint8)
    for i, page in enumerate(pages):
        # the usual page first: a flat, contiguous uint8 array, taken as it is
        if type(page) is np.ndarray and page.shape == flat and page.dtype == u8 and page.flags.c_contiguous:
            rows.append(page)
            continue
        where = f"{what}[{i}]"
        if _is_tensor(page):
            row = _torch_page(page, layout, where)  # type: ignore[arg-type]
        elif isinstance(page, np.ndarray):
            if page.dtype != np.uint8 or page.shape not in ((pb,), (1, pb)):
                raise InputError(f"{where}: a numpy page must be raw bytes, uint8 of shape [{pb}] or [1, {pb}] "
                                 f"(a typed page goes in as a torch tensor), got {page.dtype} {tuple(page.shape)}")
            if not page.flags.c_contiguous:
                raise InputError(f"{where}: the page must be C-contiguous")
            row = page.reshape(pb)
        else:
            raise InputError(f"{where}: a page must be a torch.Tensor or numpy.ndarray, got {type(page).__name__}")
        rows.append(row)
    return PageList(rows, pb)


def page_rows(pages: PageBatch, layout: KVLayout, what: str, max_pages: int, *, lists: bool = False) -> np.ndarray:
    """A ``uint8 [n, page_bytes]`` view of ``pages``; raises InputError on any mismatch
    (``lists``: the caller also takes a list of pages, and the message says so)."""
    pb = layout.page_bytes
    if _is_tensor(pages):
        rows = _torch_rows(pages, layout, what)  # type: ignore[arg-type]
    elif isinstance(pages, np.ndarray):
        if pages.dtype != np.uint8 or pages.ndim != 2 or pages.shape[1] != pb:
            raise InputError(f"{what}: a numpy page batch must be uint8 of shape [n, {pb}], "
                             f"got {pages.dtype} {tuple(pages.shape)}")
        if not pages.flags.c_contiguous:
            raise InputError(f"{what}: the page batch must be C-contiguous")
        rows = pages
    else:
        also = ", or a list or tuple of pages" if lists else ""
        raise InputError(f"{what}: pages must be a torch.Tensor or numpy.ndarray{also}, got {type(pages).__name__}")
    if rows.shape[0] > max_pages:
        raise InputError(f"{what}: {rows.shape[0]} pages given but the tokens hold only {max_pages} full "
                         f"pages of {layout.tokens_per_page} tokens")
    return rows


def _torch_page(t: torch.Tensor, layout: KVLayout, what: str) -> np.ndarray:
    """One page's tensor (``[*page_shape]`` in the layout's dtype, or uint8 ``[page_bytes]``)
    as a zero-copy ``uint8 [page_bytes]`` view."""
    import torch

    pb = layout.page_bytes
    if not t.is_contiguous():  # checked first: a reshape would copy it silently
        raise InputError(f"{what}: the page tensor must be contiguous (call .contiguous())")
    if t.dtype == torch.uint8 and tuple(t.shape) in ((pb,), (1, pb)):
        return _torch_rows(t.reshape(1, pb), layout, what)[0]
    want = getattr(torch, layout.dtype.torch_name)
    shape = layout.page_shape
    if t.dtype != want or tuple(t.shape) not in (shape, (1, *shape)):
        dims = ", ".join(map(str, shape))
        raise InputError(f"{what}: a page tensor must be {want} of shape [{dims}] or [1, {dims}], or uint8 [{pb}] "
                         f"or [1, {pb}], got {t.dtype} {list(t.shape)}")
    return _torch_rows(t.reshape(1, *shape), layout, what)[0]


def _torch_rows(t: torch.Tensor, layout: KVLayout, what: str) -> np.ndarray:
    import torch

    pb = layout.page_bytes
    if t.device.type != "cpu":
        raise InputError(f"{what}: pages on {t.device} are not supported by this store's tiers; "
                         "expected a CPU tensor (configure an HBM tier for device pages)")
    if not t.is_contiguous():
        raise InputError(f"{what}: the page tensor must be contiguous (call .contiguous())")
    if t.dtype == torch.uint8 and t.dim() == 2 and t.shape[1] == pb:
        return t.numpy()
    want = getattr(torch, layout.dtype.torch_name)
    if t.dtype != want:
        raise InputError(f"{what}: expected dtype {want} (layout {layout.dtype.value}) "
                         f"or uint8 [n, {pb}], got {t.dtype}")
    if t.dim() != 1 + len(layout.page_shape) or tuple(t.shape[1:]) != layout.page_shape:
        raise InputError(f"{what}: expected shape [n, {', '.join(map(str, layout.page_shape))}], "
                         f"got {list(t.shape)}")
    return t.view(torch.uint8).reshape(t.shape[0], pb).numpy()
