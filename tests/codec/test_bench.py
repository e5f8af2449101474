"""``run_codec_bench`` on a small safetensors file: loading, page cutting, the JSON fields."""

from __future__ import annotations

import json
import time
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from tierkv.bench.codec import H2H_KEYS, kv_pages, load_kv, run_codec_bench
from tierkv.codec import native_available
from tierkv.errors import InputError
from tierkv.layout import DType

KEYS = ("ratio", "compress_gbps", "decompress_gbps", "zipnn_ratio", "zipnn_compress_gbps", "zipnn_decompress_gbps",
        "zstd_ratio", "zstd_compress_gbps", "zstd_decompress_gbps")


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


@pytest.fixture
def kv_file(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in (0, 7):
        for kv in "kv":
            tensors[f"layer{layer:02d}.{kv}"] = (torch.randn(2, 40, 32, generator=g) * 3).to(torch.bfloat16)
    path = tmp_path / "kv.safetensors"
    _write_safetensors(path, tensors)
    return path


def test_pages_are_cut_as_the_store_forms_them(kv_file: Path) -> None:
    _, layers = load_kv(kv_file)
    layout, rows = kv_pages(layers, 8, DType.BF16)
    assert rows.shape == (5, layout.page_bytes) and layout.num_layers == 2 and layout.tokens_per_page == 8
    page = torch.from_numpy(rows[1].copy()).view(torch.bfloat16).reshape(layout.page_shape)
    assert torch.equal(page[1, 0, 3], layers[7][0][:, 11])   # layer 7, K, token 8+3, every head


@pytest.mark.skipif(not native_available(), reason="tierkv.codec._codec is not built")
def test_bench_fields(kv_file: Path) -> None:
    result = run_codec_bench(kv_file, page_tokens=8, runs=1, threads=2)
    for key in KEYS:
        assert key in result
    assert 0 < result["ratio"] <= 1.01  # type: ignore[operator]
    assert set(result["dtypes"]) == {"bf16", "fp16", "fp8_e4m3", "fp8_e5m2"}  # type: ignore[arg-type]
    # the threaded figures come from a batch of about 8 MB, with their scaling over one thread
    pages, batch, pb = result["pages"], result["batch_pages"], result["page_bytes"]
    assert isinstance(pages, int) and isinstance(batch, int) and isinstance(pb, int)
    assert result["threads"] == 2 and batch % pages == 0 and (8 << 20) - pages * pb < batch * pb <= 8 << 20
    for key in ("compress_gbps_threads", "decompress_gbps_threads", "compress_scaling", "decompress_scaling"):
        assert isinstance(result[key], float) and result[key] > 0
    json.dumps(result)
    for key in KEYS[3:] + H2H_KEYS:
        baseline = "zipnn" if key.startswith("zipnn") else "zstandard"
        try:
            __import__(baseline)
        except ImportError:
            assert result[key] is None
        else:
            assert isinstance(result[key], float) and result[key] > 0
    if result["h2h_decompress_gbps"] is not None:   # the ratio is of the two head-to-head figures
        ratio = result["h2h_decompress_gbps"] / result["h2h_zipnn_bulk_decompress_gbps"]  # type: ignore[operator]
        assert result["h2h_decompress_vs_zipnn_bulk"] == pytest.approx(ratio)
    fp8 = result["dtypes"]["fp8_e4m3"]  # type: ignore[index]
    assert all(fp8[key] is None for key in H2H_KEYS)   # zipnn has no FP8


def test_bad_kv_files(tmp_path: Path, kv_file: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        load_kv(tmp_path / "missing.safetensors")
    other = tmp_path / "other.safetensors"
    _write_safetensors(other, {"weight": torch.zeros(2, 2, 2, dtype=torch.bfloat16)})
    with pytest.raises(InputError, match="layerNN"):
        load_kv(other)
    _, layers = load_kv(kv_file)
    with pytest.raises(InputError, match="page-tokens"):
        kv_pages(layers, 41, DType.BF16)
    assert np.isfinite(len(layers))


def test_a_run_counts_at_least_its_wall_time() -> None:
    """CPU time can undercount on a shared VM (and does not count a sleep): a run is
    charged the larger of the two clocks, so no best-of is shorter than the run was."""
    from tierkv.bench.codec import CPU, _timed

    assert _timed(lambda: time.sleep(0.02), CPU) >= 0.02
    busy = _timed(lambda: sum(range(200_000)), CPU)
    assert busy > 0
