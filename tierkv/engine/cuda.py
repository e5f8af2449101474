"""The CUDA copy kernel: one launch copies a batch of equal-size chunks between any addresses.

A batch is a *descriptor* array ``int64 [units, 2]``: the source and destination
address of each chunk (a contiguous run of units is itself a batch, which is how a
layer-wise load launches layer by layer from one upload). Addresses are device pointers or pinned host memory
seen through unified virtual addressing, so the same launch moves engine blocks to
HBM slots, to pinned DRAM slots, or back, across every layer of every block at once.
Each thread block copies whole chunks with 16-byte vector loads (narrower only when
an address or the chunk size is not 16-byte aligned), four loads in flight per thread.

Needs CuPy (NVRTC) to build the kernel; :func:`kernel_available` says whether it can
run here. :func:`emulate` executes a descriptor batch on CPU memory with the
kernel's exact semantics, so CPU tests check the descriptors every launch would use.
Called by :mod:`tierkv.engine.kv` and :mod:`tierkv.engine.rows`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from types import ModuleType

import numpy as np
import torch

from tierkv.errors import InputError

KERNEL_SOURCE = r"""
template <typename V>
__device__ __forceinline__ void copy_chunk(const V* __restrict__ s, V* __restrict__ d,
                                           long long n, long long t, long long stride) {
    long long i = t;
    // Four independent loads before their stores keep enough bytes in flight to
    // saturate HBM, and PCIe when one side is pinned host memory.
    for (; i + 3 * stride < n; i += 4 * stride) {
        V a = s[i];
        V b = s[i + stride];
        V c = s[i + 2 * stride];
        V e = s[i + 3 * stride];
        d[i] = a;
        d[i + stride] = b;
        d[i + 2 * stride] = c;
        d[i + 3 * stride] = e;
    }
    for (; i < n; i += stride) {
        d[i] = s[i];
    }
}

template <typename V>
__global__ void copy_chunks(const long long* __restrict__ desc, long long units, long long vecs) {
    for (long long u = blockIdx.x; u < units; u += gridDim.x) {
        const V* s = reinterpret_cast<const V*>(desc[2 * u]);
        V* d = reinterpret_cast<V*>(desc[2 * u + 1]);
        copy_chunk<V>(s, d, vecs, (long long)threadIdx.x, (long long)blockDim.x);
    }
}
"""

log = logging.getLogger(__name__)

# Vector width in bytes -> the C type the kernel is instantiated with.
VECTOR_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
NAME_EXPRESSIONS = tuple(f"copy_chunks<{t}>" for t in VECTOR_TYPES.values())
MAX_THREADS = 256


@functools.cache
def _cupy() -> ModuleType | None:
    try:
        import cupy
    except Exception:  # noqa: BLE001 - a broken CuPy install is the same as none here
        return None
    return cupy


def cupy_present() -> bool:
    """Whether CUDA is present and CuPy imports (the kernel may still fail to build)."""
    return torch.cuda.is_available() and _cupy() is not None


@functools.cache
def kernel_available() -> bool:
    """Whether the copy kernel runs here: CUDA, CuPy, and the kernel builds on the current device.

    A build failure is logged once and answered False, so default paths fall back to torch.
    """
    if not cupy_present():
        return False
    try:
        _module(torch.cuda.current_device())
    except Exception as exc:  # noqa: BLE001 - NVRTC missing or refusing: any reason means no kernel
        log.warning("the CUDA copy kernel does not build here (%s); copies use the torch path", exc)
        return False
    return True


@functools.cache
def _module(device_index: int) -> object:
    cupy = _cupy()
    assert cupy is not None
    with cupy.cuda.Device(device_index):
        # No options: CuPy picks the architecture and NVRTC's default C++ standard covers the source.
        mod = cupy.RawModule(code=KERNEL_SOURCE, name_expressions=NAME_EXPRESSIONS)
        mod.compile()
        return mod


def vector_bytes(addresses: np.ndarray, chunk_bytes: int) -> int:
    """The widest vector (16, 8, 4, 2 or 1 bytes) that every address and the chunk size align to."""
    bits = int(np.bitwise_or.reduce(addresses, axis=None)) if addresses.size else 0
    bits |= chunk_bytes | 16
    return bits & -bits


def device_address(t: torch.Tensor) -> int:
    """The address a kernel on ``t``'s CUDA device (or the current one) uses for ``t``'s data.

    Device tensors give their own pointer; pinned host tensors give their mapped
    device pointer (the host pointer itself under unified addressing). Pageable host
    memory cannot be reached by a kernel: InputError.
    """
    if t.device.type == "cuda":
        return t.data_ptr()
    if not t.is_pinned():
        raise InputError("a kernel copy needs pinned host memory; this host tensor is pageable")
    cupy = _cupy()
    ptr = t.data_ptr()
    try:
        mapped = getattr(cupy.cuda.runtime.pointerGetAttributes(ptr), "devicePointer", ptr) if cupy else ptr
    except Exception:  # noqa: BLE001 - no attribute query here: unified addressing maps host == device
        return ptr
    if not mapped:
        raise InputError(f"pinned host memory at {ptr:#x} is not mapped into the device's address space")
    return int(mapped)


def launch(desc: torch.Tensor, units: int, chunk_bytes: int, vec: int, max_ctas: int) -> None:
    """Launch one copy of ``units`` chunks described by ``desc`` (device int64 ``[units, 2]``, contiguous).

    Runs on torch's current stream of ``desc``'s device and returns at once (stream
    ordered, like any torch op). ``max_ctas`` bounds the thread blocks: fewer leave
    more of the GPU to compute when one side is PCIe-bound host memory.
    """
    if units == 0:
        return
    cupy = _cupy()
    if cupy is None:
        raise InputError("the kernel copy path needs CuPy, which is not installed")
    device = desc.device.index if desc.device.index is not None else torch.cuda.current_device()
    fn = _module(device).get_function(f"copy_chunks<{VECTOR_TYPES[vec]}>")  # type: ignore[attr-defined]
    vecs = chunk_bytes // vec
    threads = min(MAX_THREADS, max(32, -(-vecs // 4 // 32) * 32))
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream.cuda_stream):
        fn((min(units, max_ctas),), (threads,), (np.uint64(desc.data_ptr()), np.int64(units), np.int64(vecs)))


def emulate(desc: np.ndarray, chunk_bytes: int) -> None:
    """Run a descriptor batch on host memory as the kernel would (for CPU tests and the CPU path).

    ``desc`` is ``int64 [units, 2]`` of host addresses; every chunk must lie inside live
    memory, which the callers in :mod:`tierkv.engine` check before building it.
    """
    for src, dst in desc.tolist():
        ctypes.memmove(dst, src, chunk_bytes)


def default_ctas(device: torch.device) -> int:
    """Thread blocks per launch unless told otherwise: four per multiprocessor."""
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def upload(desc: np.ndarray, device: torch.device) -> torch.Tensor:
    """``desc`` on ``device``, copied asynchronously on the current stream through pinned memory."""
    host = torch.from_numpy(np.ascontiguousarray(desc, dtype=np.int64))
    return host.pin_memory().to(device, non_blocking=True)


def copy_batch(desc: np.ndarray, chunk_bytes: int, device: torch.device, max_ctas: int | None = None) -> None:
    """Copy every chunk of ``desc`` (int64 ``[units, 2]`` addresses): one launch on ``device``'s
    current stream, or :func:`emulate` when ``device`` is the CPU."""
    if device.type == "cpu":
        emulate(desc, chunk_bytes)
        return
    if not len(desc):
        return
    vec = vector_bytes(desc, chunk_bytes)
    launch(upload(desc, device), len(desc), chunk_bytes, vec, max_ctas or default_ctas(device))
