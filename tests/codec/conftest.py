"""Fixtures for the codec tests: real KV pages (skipped where the data file is absent),
small layouts, both implementations (C where built, the portable one always), and a
runner for the C checks in tools/."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tierkv.bench.codec import DEFAULT_KV_DIR, kv_pages, load_kv
from tierkv.codec import Codec, native_available
from tierkv.layout import DType, KVLayout

KV_FILES = sorted(DEFAULT_KV_DIR.glob("*.safetensors")) if DEFAULT_KV_DIR.is_dir() else []
requires_kv = pytest.mark.skipif(not KV_FILES, reason=f"no real KV data in {DEFAULT_KV_DIR}")
requires_native = pytest.mark.skipif(not native_available(), reason="tierkv.codec._codec is not built")

# Both implementations where the extension is built; the portable one (tierkv.codec.portable) alone otherwise.
IMPLS = [pytest.param(True, id="c", marks=requires_native), pytest.param(False, id="portable")]


@pytest.fixture(scope="session")
def kv_layers() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    if not KV_FILES:
        pytest.skip(f"no real KV data in {DEFAULT_KV_DIR}")
    return load_kv(KV_FILES[0])[1]


def real_pages(layers: dict[int, tuple[torch.Tensor, torch.Tensor]], dtype: DType,
               page_tokens: int = 16) -> tuple[KVLayout, np.ndarray]:
    return kv_pages(layers, page_tokens, dtype)


@pytest.fixture
def native_codec() -> Iterator[Codec]:
    """A C codec for a small BF16 layout (skips without the extension)."""
    if not native_available():
        pytest.skip("tierkv.codec._codec is not built")
    with Codec(KVLayout(2, 2, 64, DType.BF16, 16), native=True) as codec:
        yield codec


def normal_pages(layout: KVLayout, n: int, seed: int = 0) -> np.ndarray:
    """Gaussian pages with per-channel scales, in the layout's dtype, as uint8 rows."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *layout.page_shape)) * np.exp(rng.normal(0, 1.5, layout.page_shape[-1]))
    t = torch.from_numpy(x.astype(np.float32)).to(getattr(torch, layout.dtype.torch_name))
    return t.contiguous().view(torch.uint8).reshape(n, layout.page_bytes).numpy().copy()


def roundtrip(codec: Codec, rows: np.ndarray) -> np.ndarray:
    """Encodes and decodes rows with one codec, checks them exact; returns blob sizes."""
    out = np.empty((rows.shape[0], codec.max_encoded_bytes), dtype=np.uint8)
    sizes = codec.encode_into(rows, out)
    back = np.full_like(rows, 0xA5)
    report = codec.decode_into([out[i, :int(sizes[i])] for i in range(rows.shape[0])], back)
    assert report.ok, report
    np.testing.assert_array_equal(back, rows)
    return sizes


@pytest.fixture(params=[5, 7, 6, 4, 3, 1, 0],
                ids=["groups", "groups-novbmi2", "pairs", "gather", "search", "avx2", "scalar"])
def simd(request: pytest.FixtureRequest) -> Iterator[int]:
    """Runs a test on each decoding path the CPU has: every SIMD path with the AVX-512
    rANS symbols of up to four pages at once (a batch's lone page through the same kernel;
    from 16-bit halves of the states where VBMI2 runs, then without VBMI2), of two, then
    one page at a time by gathers, then by the register search, then AVX2 and BMI2
    without AVX-512, then the scalar code alone (``_codec.set_simd``'s levels)."""
    if not native_available():
        pytest.skip("tierkv.codec._codec is not built")
    from tierkv.codec import _codec  # type: ignore[attr-defined]

    _codec.set_simd(request.param)
    yield request.param
    _codec.set_simd(True)


def run_c_check(tmp_path: Path, tool: str, arg: str) -> list[str]:
    """Builds ``tools/<tool>.c`` (a check that includes the codec's C source) and runs it
    with ``arg``: its output lines, after it exited 0 (skips without a C compiler, or
    where it says the CPU lacks what it checks, exit 2)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    root = Path(__file__).resolve().parents[2]
    exe = tmp_path / tool
    subprocess.run([cc, "-O2", "-I", str(root / "tierkv" / "codec"), "-o", str(exe), str(root / "tools" / f"{tool}.c")],
                   check=True, capture_output=True, text=True)
    res = subprocess.run([str(exe), arg], capture_output=True, text=True, timeout=300)
    if res.returncode == 2:
        pytest.skip(res.stdout.strip())
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.splitlines()
