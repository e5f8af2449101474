"""The GPU decoder's CUDA build: the kernel compiles for Hopper with NVRTC (no GPU needed;
skipped where the library is not installed) and decodes on a lent GPU (``gpu``; CUDA and
CuPy, with or without the C extension: the host side falls back to numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.codec.conftest import normal_pages
from tests.codec.test_corruption import _resealed
from tests.nvrtc import compile_ptx
from tierkv.codec import HEADER_BYTES, Codec, gpu
from tierkv.codec.codec import native_available
from tierkv.layout import DType, KVLayout, LayoutKind


def test_kernel_compiles_for_hopper() -> None:
    """The same source as CUDA C++ (with the CUDA prologue) builds for sm_90 with NVRTC,
    no GPU needed; skipped where no NVRTC library is installed."""
    text = compile_ptx(gpu.kernel_source(), ["--gpu-architecture=compute_90", "--std=c++14"])
    assert f".entry {gpu.KERNEL_NAME}" in text and "vote.sync.ballot" in text and "bar.sync" in text


def _cases() -> list[tuple[KVLayout, np.ndarray]]:
    fp16 = KVLayout(2, 2, 48, DType.FP16, 40)
    rows16 = normal_pages(fp16, 2, seed=5)
    rows16.reshape(2, 2, 2, 40, 192)[:, :, :, 10] = rows16.reshape(2, 2, 2, 40, 192)[:, :, :, 3]
    rows16.view(np.uint16)[:] &= np.uint16(0xFFF0)   # low bits dropped, with exceptions
    rows16.view(np.uint16).reshape(-1)[::331] |= np.uint16(0x3)
    long = KVLayout(1, 3, 64, DType.BF16, 300)
    latent = KVLayout(3, 1, 72, DType.BF16, 32, LayoutKind.LATENT)
    small = KVLayout(3, 3, 64, DType.BF16, 16)
    return [(small, normal_pages(small, 8)), (fp16, rows16), (long, normal_pages(long, 1, seed=2)),
            (latent, normal_pages(latent, 2, seed=3))]


@pytest.mark.gpu
@pytest.mark.parametrize("native", [True, False], ids=["c-host", "numpy-host"])
def test_gpu_decoder_on_the_device(native: bool) -> None:
    """Pages of several geometries and a damaged blob under a valid checksum: the device
    decodes what the CPU decoder decodes, bit for bit, and refuses what it refuses."""
    if not gpu.device_available():
        pytest.skip("no CUDA device or CuPy here")
    if native and not native_available():
        pytest.skip("tierkv.codec._codec is not built")
    for layout, rows in _cases():
        with Codec(layout) as codec:
            blobs = [bytes(b) for b in codec.encode(rows)]
        blobs += [_resealed(blobs[0], HEADER_BYTES + 300 + 37 * k, k % 8) for k in range(3)]
        want = np.zeros((len(blobs), layout.page_bytes), dtype=np.uint8)
        with Codec(layout) as codec:
            expected = codec.decode_into(blobs, want)
        out, report = gpu.GpuDecoder(layout).decode(gpu.prepare(layout, blobs, native=native))
        assert report.failed == expected.failed, layout
        kept = [i for i in range(len(blobs)) if i not in expected.failed]
        np.testing.assert_array_equal(out.cpu().numpy()[kept], want[kept])
        np.testing.assert_array_equal(out.cpu().numpy()[:len(rows)], rows)
