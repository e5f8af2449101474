"""Row copies between tier buffers (device pool, pinned or plain host rows), on every path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.targets import TARGETS, Target, as_bytes, random_bytes
from tierkv.engine.rows import as_indices, copy_rows, runs
from tierkv.errors import InputError

WIDTH = 48  # a multiple of 16: the kernel's 16-byte vectors


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("direction", ["host->device", "device->host", "device->device", "host->host"])
@pytest.mark.parametrize("width", [WIDTH, 13])
def test_copy_rows(target: Target, direction: str, width: int) -> None:
    src_on, dst_on = direction.split("->")
    place = {"device": lambda t: t.to(target.device), "host": target.host}
    src = place[src_on](random_bytes((10, 64), seed=1))
    dst = place[dst_on](random_bytes((9, 64), seed=2))
    kept_src, expected = as_bytes(src), as_bytes(dst)
    src_rows, dst_rows = np.array([9, 0, 1, 2, 5]), np.array([3, 4, 5, 8, 0])
    copy_rows(src, src_rows, dst, dst_rows, width, target.path)
    if target.cuda:
        torch.cuda.synchronize()
    expected[dst_rows, :width] = kept_src[src_rows, :width]
    assert torch.equal(as_bytes(dst), expected)  # untargeted rows and bytes past width untouched
    assert torch.equal(as_bytes(src), kept_src)


def test_runs_pair_consecutive_rows_on_both_sides() -> None:
    assert runs(np.array([3, 4, 5, 9, 10]), np.array([0, 1, 7, 8, 9])) == [(3, 0, 2), (5, 7, 1), (9, 8, 2)]
    assert runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []


def test_as_indices() -> None:
    assert as_indices(torch.tensor([3, 1]), "x").tolist() == [3, 1]
    assert as_indices([], "x").dtype == np.int64
    for bad in ([1.0], [[1, 2]], np.array([True])):
        with pytest.raises(InputError):
            as_indices(bad, "x")  # type: ignore[arg-type]
