"""CopyStream: futures that complete when copies finish; failures become TierIOError."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from tests.engine.targets import DEVICES
from tierkv.engine.streams import CopyStream, completed
from tierkv.errors import InputError, StoreClosedError, TierIOError

TIMEOUT_S = 30


@pytest.mark.parametrize("device", DEVICES)
def test_submit_each_completes_in_order(device: str) -> None:
    src = torch.arange(1 << 16, dtype=torch.float32, device=device)
    dst = [torch.zeros_like(src) for _ in range(3)]
    with CopyStream(device) as copier:
        jobs: list[Callable[[], object]] = [functools.partial(lambda i: dst[i].copy_(src * i), i) for i in range(3)]
        done = copier.submit_each(jobs, keep=(src, *dst))
        for i, c in enumerate(done):
            c.future.result(timeout=TIMEOUT_S)
            c.wait_on()
            assert torch.equal(dst[i], src * i)
        assert copier.submit(lambda: dst[0].zero_()).result(timeout=TIMEOUT_S) is None
    assert not dst[0].any()


@pytest.mark.parametrize("device", DEVICES)
def test_side_stream_sees_earlier_work(device: str) -> None:
    """A copy submitted after a write on the caller's stream reads the written bytes."""
    a = torch.zeros(1 << 20, device=device)
    b = torch.empty_like(a)
    with CopyStream(device) as copier:
        a.fill_(7.0)  # enqueued on the current stream
        copier.submit(lambda: b.copy_(a), keep=(a, b)).result(timeout=TIMEOUT_S)
    assert bool((b == 7.0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_a_failing_copy_fails_its_future_and_the_later_ones(device: str) -> None:
    def boom() -> None:
        raise RuntimeError("simulated device error")
    with CopyStream(device) as copier:
        done = copier.submit_each([lambda: None, boom, lambda: None])
        assert done[0].future.result(timeout=TIMEOUT_S) is None
        for c in done[1:]:
            with pytest.raises(TierIOError, match="simulated device error"):
                c.future.result(timeout=TIMEOUT_S)
            c.wait_on()  # nothing to wait for; must not raise


def test_closed_and_bad_devices() -> None:
    copier = CopyStream("cpu")
    copier.close()
    copier.close()
    with pytest.raises(StoreClosedError):
        copier.submit(lambda: None)
    with pytest.raises(InputError, match="'cpu' or 'cuda'"):
        CopyStream("meta")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="needs CUDA"):
            CopyStream("cuda")


def test_completed() -> None:
    assert completed().result(timeout=0) is None
    with pytest.raises(TierIOError):
        completed(TierIOError("x")).result(timeout=0)
