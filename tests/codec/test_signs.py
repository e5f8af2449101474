"""Signs on every decoding path: coded signs of up to 25 coded rows (read sixteen channels
a vector straight into the rows' masks), of 26 to 56 (eight channels a vector, from one
read of the bytes they span or a gather), and first flips on each row, on 64-row block
boundaries, with raw runs after them and repeated rows before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.codec.conftest import real_pages, requires_native, roundtrip
from tierkv.codec import HEADER_BYTES, Codec
from tierkv.layout import DType, KVLayout


@requires_native
@pytest.mark.parametrize("tokens", [40, 50, 56])
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16], ids=lambda d: d.value)
def test_real_pages_of_40_to_56_tokens_round_trip(kv_layers: dict, dtype: DType, tokens: int, simd: int) -> None:
    """Coded signs of up to 56 rows are read eight channels at a time, from one read of
    the bytes they span where that is at most 64 (a gather beyond): both happen here."""
    layout, rows = real_pages(kv_layers, dtype, tokens)
    with Codec(layout) as codec:
        roundtrip(codec, rows)


@requires_native
@pytest.mark.parametrize("tokens", [1, 2, 7, 8, 9, 17, 24, 25, 26])
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16, DType.FP8_E4M3], ids=lambda d: d.value)
def test_real_pages_of_up_to_26_tokens_round_trip(kv_layers: dict, dtype: DType, tokens: int, simd: int) -> None:
    """Coded signs of up to 25 rows are read sixteen channels at a time straight into the
    rows' masks (plane_sign_rows_vbmi); 26 rows go the general way."""
    layout, rows = real_pages(kv_layers, dtype, tokens)
    with Codec(layout) as codec:
        roundtrip(codec, rows)


@requires_native
@pytest.mark.parametrize("tokens", [3, 16, 25])
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP8_E4M3], ids=lambda d: d.value)
def test_first_flips_at_every_row_round_trip(dtype: DType, tokens: int, simd: int) -> None:
    """Channel c of 192 flips sign first at row 1 + c mod tokens (never, where that is
    past the rows) with raw signs after it, a repeated row leaves one coded row fewer:
    every first-flip position, raw run and bit offset of the sixteen-channel reads."""
    layout = KVLayout(2, 3, 64, dtype, tokens)
    rng = np.random.default_rng(tokens)
    x = np.abs(rng.standard_normal(layout.page_shape)).astype(np.float32) + 0.1   # [L, 2, T, H, D]
    for c in range(192):
        f = 1 + c % tokens
        x[:, :, f:, c // 64, c % 64] *= np.where(rng.random((2, 2, max(tokens - f, 0))) < 0.8, -1, 1)
    x[:, :, tokens - 1] = x[:, :, max(tokens - 2, 0)]   # a repeated row (two rows and more)
    t = torch.from_numpy(x).to(getattr(torch, dtype.torch_name)).contiguous().view(torch.uint8)
    rows = t.reshape(1, -1).numpy().copy()
    with Codec(layout) as codec:
        blob = bytes(codec.encode(rows)[0])
        assert blob[5] == 1 and blob[HEADER_BYTES + 3] & 3 == 3   # coded, signs coded for K and V
        roundtrip(codec, rows)


@requires_native
@pytest.mark.parametrize("tokens, flip", [(65, 64), (129, 64), (200, 128), (512, 192), (100, 63), (100, 65)])
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16], ids=lambda d: d.value)
def test_a_first_sign_flip_on_a_64_row_boundary_round_trips(dtype: DType, tokens: int, flip: int,
                                                              simd: int) -> None:
    layout = KVLayout(1, 1, 64, dtype, tokens)
    x = np.abs(np.random.default_rng(1).standard_normal(layout.page_shape)).astype(np.float32) + 0.1
    x[0, 0, flip:, 0, 5] *= -1          # one channel positive until row ``flip``, negative after
    rows = torch.from_numpy(x).to(getattr(torch, dtype.torch_name)).contiguous().view(torch.uint8)
    with Codec(layout, native=True) as codec:
        roundtrip(codec, rows.reshape(1, -1).numpy().copy())
