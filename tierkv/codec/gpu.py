"""The GPU decoder: codec pages decoded on the device, straight into HBM.

A page read from NVMe or a peer into pinned host memory goes to the device coded (0.65 of
its bytes for real BF16 KV) and is decoded there, so the host's cores do not decode it and
the link carries fewer bytes. The host checks each blob as the C decoder does (header,
checksum, section lengths, tables) and turns its small parts into a descriptor and a side
block (:func:`prepare`: in C, or numpy without the extension); one kernel launch then
decodes the batch, a thread block of 64 threads per page
(``tierkv/codec/codec_gpu_kernel.cuh``, built by CuPy's NVRTC), and reports each page that
does not check out. A failed page is a miss, never wrong
bytes: the caller gets a :class:`~tierkv.codec.DecodeReport` as from the CPU decoder.

The kernel's source also builds as C: :func:`emulate` runs it on the CPU, one emulated
thread block at a time, so the tests check the kernel's code against the C decoder on
machines without a GPU (it needs the C extension). :class:`GpuDecoder` needs CUDA and CuPy;
the host side runs in C where the extension is built and in numpy where it is not.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from tierkv.codec.codec import Blob, DecodeReport, _as_buffer
from tierkv.codec.format import ERROR_TEXT, DecodeStatus, geometry
from tierkv.codec.portable.prepare import DESC_WORDS, EMULATION_FAULT, GEO_CHANS, THREADS
from tierkv.errors import InputError
from tierkv.layout import KVLayout

if TYPE_CHECKING:
    import torch

try:
    from tierkv.codec import _codec as _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - where the extension is not built
    _native = None

KERNEL_FILE = Path(__file__).with_name("codec_gpu_kernel.cuh")
KERNEL_NAME = "tk_codec_decode"

CUDA_PROLOGUE = r"""
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
#define TK_KERNEL(name) extern "C" __global__ void __launch_bounds__(64) name
#define TK_DEVICE static __device__ __forceinline__
#define TK_SHARED __shared__
#define TK_TID (threadIdx.x)
#define TK_BID (blockIdx.x)
#define TK_SYNC() __syncthreads()
#define TK_BALLOT(pred) __ballot_sync(0xffffffffu, (pred))
#define TK_POPC(x) __popc(x)
"""


def kernel_source() -> str:
    """The kernel as CUDA C++: the prologue, then ``codec_gpu_kernel.cuh``."""
    return CUDA_PROLOGUE + KERNEL_FILE.read_text()


@dataclass(frozen=True)
class Prepared:
    """A batch ready for the kernel: the blobs' bytes, a descriptor per page, the side
    blocks, the geometry, and each page's status (0 = to decode, else the host's refusal)."""

    layout: KVLayout
    buf: np.ndarray      # uint8: the blobs
    desc: np.ndarray     # uint32 [n, DESC_WORDS]
    side: np.ndarray     # uint32 words
    geo: np.ndarray      # uint32
    status: np.ndarray   # int32 [n]

    @property
    def pages(self) -> int:
        return int(self.status.shape[0])


def _need_native() -> ModuleType:
    if _native is None:
        raise InputError("the GPU decoder's host side needs the C codec (tierkv.codec._codec), which is not built")
    return _native  # type: ignore[no-any-return]


def prepare_buffer(layout: KVLayout, buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                   native: bool | None = None) -> Prepared:
    """Prepares the blobs ``buf[offsets[i]:offsets[i] + lengths[i]]`` of one buffer (a tier's
    read staging, say: pinned memory the device can read as it is). In C where the extension
    is built (``native=False`` forces the portable preparation, the same words, slower)."""
    if not isinstance(layout, KVLayout):
        raise InputError(f"prepare_buffer takes the store's KVLayout, got {type(layout).__name__}")
    if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
        raise InputError("prepare_buffer: buf must be a 1-D C-contiguous uint8 array")
    offs = np.ascontiguousarray(offsets, dtype=np.int64)
    lens = np.ascontiguousarray(lengths, dtype=np.int64)
    if offs.ndim != 1 or offs.shape != lens.shape:
        raise InputError(f"prepare_buffer: offsets and lengths must be 1-D of one length, got {offs.shape} "
                         f"and {lens.shape}")
    n = offs.shape[0]
    bad = (offs < 0) | (lens < 0) | (offs > buf.size - lens)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InputError(f"prepare_buffer: blob {i} at {int(offs[i])}, {int(lens[i])} bytes, is outside the "
                         f"{buf.size}-byte buffer")
    desc = np.zeros((n, DESC_WORDS), dtype=np.uint32)
    status = np.zeros(n, dtype=np.int32)
    if native is None:
        native = _native is not None
    if native:
        lib = _need_native()
        geo = np.zeros(lib.GPU_GEO_WORDS, dtype=np.uint32)
        side: bytes | np.ndarray = lib.gpu_prepare(buf, offs, lens, desc, status, geo, *geometry(layout))
        words = np.frombuffer(side, dtype=np.uint32) if side else np.zeros(1, dtype=np.uint32)
        return Prepared(layout, buf, desc, words, geo, status)
    from tierkv.codec.portable.common import geometry_of
    from tierkv.codec.portable.prepare import geometry_words, prepare_page

    g = geometry_of(*geometry(layout))
    parts, at = [], 0
    for i, (o, m) in enumerate(zip(offs.tolist(), lens.tolist(), strict=True)):
        status[i], desc[i], side = prepare_page(g, buf.data[o:o + m], o, at)
        parts.append(side)
        at += side.size
    words = np.concatenate(parts) if at else np.zeros(1, dtype=np.uint32)
    return Prepared(layout, buf, desc, words, geometry_words(g), status)


def pack(blobs: Sequence[Blob]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Separate blobs copied into one buffer, each 16-byte aligned: ``(buf, offsets, lengths)``."""
    views = [_as_buffer(b, i) for i, b in enumerate(blobs)]
    lengths = np.array([v.nbytes for v in views], dtype=np.int64)
    offsets = np.zeros(len(views), dtype=np.int64)
    if len(views) > 1:
        offsets[1:] = np.cumsum((lengths[:-1] + 15) // 16 * 16)
    total = int(offsets[-1] + lengths[-1]) if len(views) else 0
    buf = np.zeros(max(total, 1), dtype=np.uint8)
    for v, at in zip(views, offsets.tolist(), strict=True):
        buf[at:at + v.nbytes] = np.frombuffer(v, dtype=np.uint8)
    return buf, offsets, lengths


def prepare(layout: KVLayout, blobs: Sequence[Blob], native: bool | None = None) -> Prepared:
    """Prepares separate blobs: :func:`pack`, then :func:`prepare_buffer`."""
    return prepare_buffer(layout, *pack(blobs), native)


def report(status: np.ndarray) -> DecodeReport:
    """The :class:`DecodeReport` of a batch's final statuses."""
    failed = tuple(int(i) for i in np.flatnonzero(status))
    reasons = []
    for i in failed:
        code = int(status[i])
        if code == EMULATION_FAULT:
            reasons.append("the emulated kernel reached a barrier that not every thread reached")
            continue
        try:
            reasons.append(ERROR_TEXT[DecodeStatus(code)])
        except (ValueError, KeyError):
            reasons.append(f"decoder error {code}")
    return DecodeReport(failed, tuple(reasons))


def emulate(batch: Prepared) -> tuple[np.ndarray, DecodeReport]:
    """Runs the kernel's own code on the CPU over a prepared batch: ``uint8 [n, page_bytes]``
    and the report. Slow (every barrier switches 64 emulated threads): for tests."""
    native = _need_native()
    out = np.zeros((batch.pages, batch.layout.page_bytes), dtype=np.uint8)
    status = batch.status.copy()
    if batch.pages:
        native.gpu_emulate(batch.buf, batch.desc, batch.side, batch.geo, out, status)
    return out, report(status)


def _cupy() -> ModuleType | None:
    from tierkv.engine.cuda import _cupy as cupy   # one import attempt for the package

    return cupy()


def device_available() -> bool:
    """Whether :class:`GpuDecoder` can run here: CUDA (through torch) and CuPy. Pages are
    prepared in C where the extension is built, by the portable code otherwise."""
    import torch

    return torch.cuda.is_available() and _cupy() is not None


@functools.cache
def _kernel(device_index: int) -> Any:
    cupy = _cupy()
    assert cupy is not None
    with cupy.cuda.Device(device_index):
        mod = cupy.RawModule(code=kernel_source(), options=("--std=c++14",))
        return mod.get_function(KERNEL_NAME)


class GpuDecoder:
    """Decodes batches of codec pages on one CUDA device (torch's current one by default).

    :meth:`decode` does it all; :meth:`upload` and :meth:`launch` split it for callers
    that keep the blobs on the device or time the kernel alone.
    """

    def __init__(self, layout: KVLayout, device: int | None = None) -> None:
        if not device_available():
            raise InputError("the GPU decoder needs CUDA (through torch) and CuPy; one of them is missing here")
        import torch

        self.layout = layout
        self.device = torch.device("cuda", device if device is not None else torch.cuda.current_device())
        self._fn = _kernel(self.device.index)

    def upload(self, batch: Prepared) -> DeviceBatch:
        """The batch's arrays on the device, copied on the current stream."""
        import torch

        if batch.layout != self.layout:
            raise InputError(f"the batch was prepared for {batch.layout}, this decoder decodes {self.layout}")
        dev = self.device

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)

        scratch = torch.empty(batch.pages * 3 * int(batch.geo[GEO_CHANS]) + 1, dtype=torch.int32, device=dev)
        return DeviceBatch(batch.layout, batch.pages, put(batch.buf), put(batch.desc), put(batch.side),
                           put(batch.geo), put(batch.status), scratch)

    def launch(self, batch: DeviceBatch, out: torch.Tensor) -> None:
        """One kernel launch over an uploaded batch into ``out``, on the current stream
        (returns at once; the statuses land in ``batch.status``)."""
        import torch

        self._check_out(out, batch.layout, batch.pages)
        if batch.pages == 0:
            return
        cupy = _cupy()
        assert cupy is not None
        args = [batch.buf, batch.desc, batch.side, batch.geo, out, batch.scratch, batch.status]
        stream = torch.cuda.current_stream(self.device)
        with cupy.cuda.Device(self.device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
            self._fn((batch.pages,), (THREADS,), tuple(np.uint64(t.data_ptr()) for t in args))

    def decode(self, blobs: Sequence[Blob] | Prepared,
               out: torch.Tensor | None = None) -> tuple[torch.Tensor, DecodeReport]:
        """Decodes the pages into ``out`` (a CUDA ``uint8`` tensor ``[n, page_bytes]``,
        allocated when None) on the device's current stream; waits for the statuses and
        returns ``(out, report)``. Failed rows hold unspecified bytes."""
        import torch

        batch = blobs if isinstance(blobs, Prepared) else prepare(self.layout, blobs)
        if out is None:
            out = torch.empty((batch.pages, self.layout.page_bytes), dtype=torch.uint8, device=self.device)
        self._check_out(out, batch.layout, batch.pages)
        arrays = self.upload(batch)
        self.launch(arrays, out)
        return out, report(arrays.status.cpu().numpy())

    def _check_out(self, out: torch.Tensor, layout: KVLayout, pages: int) -> None:
        """The kernel writes page_bytes a page from the batch's own geometry: ``out`` and
        the batch must be this decoder's, or it would write past ``out``."""
        import torch

        if layout != self.layout:
            raise InputError(f"the batch was prepared for {layout}, this decoder decodes {self.layout}")
        pb = self.layout.page_bytes
        if not (isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and tuple(out.shape) == (pages, pb)
                and out.is_contiguous() and out.device == self.device):
            raise InputError(f"out must be a contiguous uint8 tensor [{pages}, {pb}] on {self.device}, got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")


@dataclass(frozen=True)
class DeviceBatch:
    """A prepared batch's arrays on the device (:meth:`GpuDecoder.upload`), with the
    kernel's scratch; ``status`` holds the pages' outcomes after a launch."""

    layout: KVLayout
    pages: int
    buf: torch.Tensor
    desc: torch.Tensor
    side: torch.Tensor
    geo: torch.Tensor
    status: torch.Tensor
    scratch: torch.Tensor


__all__ = ["CUDA_PROLOGUE", "KERNEL_FILE", "DeviceBatch", "GpuDecoder", "Prepared", "device_available", "emulate",
           "kernel_source", "pack", "prepare", "prepare_buffer", "report"]
