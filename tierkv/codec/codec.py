"""The lossless KV page codec: :class:`Codec` encodes store pages into blobs and back.

A blob is one page: a 40-byte header (codec id, format version, dtype, layout,
payload length, xxh3-64 checksum) and a payload that is either the page coded
(exponents modelled per channel, rANS-coded; signs by their first flip; mantissas
packed raw) or, where coding would not shrink it, the page as it is. Decoding is
bit-exact; a blob whose checksum, header or streams do not check out is refused,
never decoded into wrong data. ``tierkv/codec/FORMAT.md`` describes the format.

Called by the store's tier transfers (pages crossing into NVMe and NVMe-oF tiers)
and by ``tierkv bench codec``. The work runs in the C extension
``tierkv.codec._codec`` without the GIL; where it is not built, the portable
implementation (:mod:`tierkv.codec.portable`, numpy and Python) reads and writes the
same format, much slower.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import numpy as np

import tierkv.codec.portable as portable
from tierkv.chunks import Chunks
from tierkv.codec.format import ERROR_TEXT, HEADER_BYTES, DecodeStatus, geometry, max_encoded_bytes
from tierkv.errors import CorruptPageError, InputError, StoreClosedError
from tierkv.layout import KVLayout

log = logging.getLogger(__name__)

Blob = bytes | bytearray | memoryview | np.ndarray

try:
    from tierkv.codec import _codec as _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - where the extension is not built
    _native = None

# Below this many pages per worker a batch is not worth splitting across threads.
_MIN_PAGES_PER_THREAD = 2
# Pages a thread takes at a time at least (where the batch has that many a thread): a
# call into the backend costs a few microseconds, a page 10-40.
_CHUNK_PAGES = 8
_warned_portable = False


class _Backend(Protocol):
    def encode_rows(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, *geo: int) -> None: ...

    def decode_rows(self, blobs: Sequence[Blob], dst: np.ndarray, status: np.ndarray, *geo: int) -> None: ...


def native_available() -> bool:
    """Whether the C extension is built (otherwise the portable implementation runs)."""
    return _native is not None


@dataclass(frozen=True)
class DecodeReport:
    """Outcome of :meth:`Codec.decode_into`: which pages failed, and why.

    A failed page's destination row holds unspecified bytes and must not be used; the
    others are decoded exactly.
    """

    failed: tuple[int, ...]
    reasons: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.failed


_ALL_DECODED = DecodeReport((), ())


class Codec:
    """Encodes and decodes pages of one :class:`~tierkv.layout.KVLayout`.

    Pages are rows of a C-contiguous ``uint8`` array ``[n, layout.page_bytes]`` (the
    store's raw page format). ``threads`` workers split batches of pages; a single
    page always runs on the calling thread. Thread-safe: any number of threads may
    call one codec at once. ``native=False`` forces the portable implementation (tests).
    Owns a thread pool when ``threads > 1``: close it, or use it as a context manager.
    """

    def __init__(self, layout: KVLayout, threads: int = 1, native: bool | None = None) -> None:
        if not isinstance(layout, KVLayout):
            raise InputError(f"Codec takes the store's KVLayout (layers, heads, head_dim, dtype, "
                             f"tokens per page), got {type(layout).__name__} {layout!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InputError(f"codec threads must be a positive integer, got {threads!r}")
        if native and _native is None:
            raise InputError("the native codec was asked for but tierkv.codec._codec is not built")
        self.layout = layout
        self.threads = threads
        self.native = _native is not None if native is None else native
        global _warned_portable
        if not self.native and native is None and not _warned_portable:
            _warned_portable = True
            log.warning("tierkv.codec._codec is not built: the portable codec (numpy) runs, about 1000x slower")
        self._backend: _Backend = _native if self.native else portable  # type: ignore[assignment]
        self._geo = geometry(layout)
        self._pool: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(threads, thread_name_prefix="tierkv-codec") if threads > 1 else None)
        self._closed = False

    @property
    def max_encoded_bytes(self) -> int:
        """Longest blob a page of this layout can become (the page plus the header)."""
        return max_encoded_bytes(self.layout.page_bytes)

    def encode_into(self, page_rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Encodes page ``i`` into the front of ``out[i]``; returns the blob lengths.

        ``out`` is ``uint8 [n, stride]`` with ``stride >= max_encoded_bytes`` (a tier's
        staging buffer, say, with 4 KiB-aligned rows); the bytes of each row past its
        blob are left as they were. Returns ``int64 [n]``.
        """
        rows = self._rows(page_rows, "encode_into: page_rows")
        n = rows.shape[0]
        if (not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.ndim != 2 or out.shape[0] != n
                or out.shape[1] < self.max_encoded_bytes or not out.flags.c_contiguous
                or not out.flags.writeable):
            got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, np.ndarray) else type(out).__name__
            raise InputError(f"encode_into: out must be a writable C-contiguous uint8 array [{n}, >= "
                             f"{self.max_encoded_bytes}], got {got}")
        sizes = np.zeros(n, dtype=np.int64)
        if n:
            self._split(n, lambda a, b: self._backend.encode_rows(rows[a:b], out[a:b], sizes[a:b], *self._geo))
        return sizes

    def encode(self, page_rows: np.ndarray) -> list[memoryview]:
        """Encodes each page into its own blob (views into one buffer the blobs share)."""
        rows = self._rows(page_rows, "encode: page_rows")
        out = np.empty((rows.shape[0], self.max_encoded_bytes), dtype=np.uint8)
        sizes = self.encode_into(rows, out)
        return [out[i, :int(sizes[i])].data for i in range(rows.shape[0])]

    def decode_into(self, blobs: Sequence[Blob], out_rows: np.ndarray) -> DecodeReport:
        """Decodes ``blobs[i]`` into ``out_rows[i]``, checking each; never raises for a
        bad blob but names it in the report (a bad page is a miss, not an error).

        A blob may be followed by trailing bytes (whole blocks read back from a tier).
        """
        rows = self._out_rows(out_rows, len(blobs), "decode_into: out_rows")
        n = len(blobs)
        status = np.zeros(n, dtype=np.int32)
        if n:
            # Both backends take any C-contiguous buffer as it is; only when one refuses a
            # blob does each get looked at, for an error that names it.
            seq = blobs if isinstance(blobs, (list, tuple)) else list(blobs)
            try:
                if self._pool is None and not self._closed:   # the common case, without slices
                    self._backend.decode_rows(seq, rows, status, *self._geo)
                else:
                    self._split(n, lambda a, b: self._backend.decode_rows(seq[a:b], rows[a:b], status[a:b],
                                                                         *self._geo))
            except TypeError:
                for i, b in enumerate(seq):
                    _as_buffer(b, i)
                raise
            if not status.any():
                return _ALL_DECODED
        failed = tuple(int(i) for i in np.flatnonzero(status))
        return DecodeReport(failed, tuple(ERROR_TEXT[DecodeStatus(int(status[i]))] for i in failed))

    def decode(self, blob: Blob, out_row: np.ndarray) -> None:
        """Decodes one blob into ``out_row`` (``uint8 [page_bytes]``); raises
        CorruptPageError, naming the cause, if the blob does not check out."""
        if not isinstance(out_row, np.ndarray) or out_row.ndim != 1:
            raise InputError(f"decode: out_row must be a 1-D uint8 array of {self.layout.page_bytes} bytes")
        report = self.decode_into([blob], out_row.reshape(1, -1))
        if not report.ok:
            raise CorruptPageError(f"codec page does not decode: {report.reasons[0]}")

    def close(self) -> None:
        """Stops the worker threads (idempotent)."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> Codec:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _split(self, n: int, work: Callable[[int, int], None]) -> None:
        if self._closed:
            raise StoreClosedError("the codec was used after close()")
        workers = min(self.threads, n // _MIN_PAGES_PER_THREAD) if self._pool is not None else 1
        if workers <= 1:
            work(0, n)
            return
        assert self._pool is not None
        # The calling thread and workers - 1 pool threads take chunks of pages in turn (about
        # four a thread): a pool thread that wakes late (0.1-0.2 ms on the 2-core VM, of a 2
        # ms batch) or is descheduled costs the caller nothing, it codes the chunks no one
        # has started. Every chunk taken has ended before anything is raised: they all
        # write into the caller's arrays.
        chunk = max(1, min(-(-n // workers), max(_CHUNK_PAGES, -(-n // (4 * workers)))))
        Chunks(work, n, chunk).drive(self._pool.submit, workers - 1)

    def _rows(self, page_rows: np.ndarray, what: str) -> np.ndarray:
        pb = self.layout.page_bytes
        if (not isinstance(page_rows, np.ndarray) or page_rows.dtype != np.uint8 or page_rows.ndim != 2
                or page_rows.shape[1] != pb):
            got = (f"{page_rows.dtype} {tuple(page_rows.shape)}" if isinstance(page_rows, np.ndarray)
                   else type(page_rows).__name__)
            raise InputError(f"{what} must be a uint8 numpy array [n, {pb}], got {got}")
        return np.ascontiguousarray(page_rows)

    def _out_rows(self, out_rows: np.ndarray, n: int, what: str) -> np.ndarray:
        pb = self.layout.page_bytes
        if (not isinstance(out_rows, np.ndarray) or out_rows.dtype != np.uint8 or out_rows.shape != (n, pb)
                or not out_rows.flags.c_contiguous or not out_rows.flags.writeable):
            got = (f"{out_rows.dtype} {tuple(out_rows.shape)}" if isinstance(out_rows, np.ndarray)
                   else type(out_rows).__name__)
            raise InputError(f"{what} must be a writable C-contiguous uint8 array [{n}, {pb}], got {got}")
        return out_rows


def _as_buffer(blob: Blob, i: int) -> memoryview:
    try:
        view = blob.data if isinstance(blob, np.ndarray) else memoryview(blob)
    except TypeError:
        raise InputError(f"blob {i} is a {type(blob).__name__}, not a bytes-like object") from None
    if not view.c_contiguous:
        raise InputError(f"blob {i} is not contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


__all__ = ["HEADER_BYTES", "Codec", "DecodeReport", "native_available"]
