"""Copies on their own CUDA stream, each returning a future completed by a CUDA event.

:class:`CopyStream` runs a copy function under a side stream (which first waits for
the caller's current stream, so it sees every write enqueued before the call),
records an event after it, and returns a ``concurrent.futures.Future`` that one
helper thread completes when the event fires: ``result(timeout)`` waits without
spinning (the events are blocking-sync), ``done()`` polls nothing. On CPU the copy
runs in the calling thread and the future is already complete: same API, sequential.

A failure while enqueuing or while the GPU runs the copy (a launch error surfacing
at the event) completes the future with :class:`~tierkv.errors.TierIOError`;
argument errors raise at the call, before anything is enqueued. The tensors a copy
touches are kept referenced until its future completes, so the caching allocators
cannot recycle them mid-copy. Thread-safe. Used by the HBM tier and the layer-wise
loader; engines may use it for their own gathers and scatters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Self

import torch

from tierkv.errors import InputError, StoreClosedError, TierIOError


def completed(exc: BaseException | None = None) -> Future[None]:
    """A future that is already done (with ``exc`` as its failure, if given)."""
    f: Future[None] = Future()
    if exc is None:
        f.set_result(None)
    else:
        f.set_exception(exc)
    return f


@dataclass(frozen=True)
class Completion:
    """One submitted copy: its future, and on CUDA the event recorded after it."""

    future: Future[None]
    event: torch.cuda.Event | None = None
    device: torch.device | None = None

    def wait_on(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current one) wait for this copy without blocking the host.

        On CPU, or when the copy never started, this does nothing (there is nothing to wait for).
        """
        if self.event is not None:
            (stream or torch.cuda.current_stream(self.device)).wait_event(self.event)


class CopyStream:
    """A copy stream on ``device`` ("cpu", "cuda", "cuda:1" or a torch.device); close it when done."""

    def __init__(self, device: str | torch.device = "cuda") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._closed = False
        self._stream: torch.cuda.Stream | None = None
        self._waiter: ThreadPoolExecutor | None = None
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise InputError(f"a copy stream on {self.device} needs CUDA, which is not available here")
            self._stream = torch.cuda.Stream(self.device)
            self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierkv-cuda-events")
        elif self.device.type != "cpu":
            raise InputError(f"copy streams run on 'cpu' or 'cuda' devices, got {self.device}")

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The side CUDA stream (None on CPU)."""
        return self._stream

    def submit(self, copy: Callable[[], object], keep: Sequence[object] = ()) -> Future[None]:
        """Run ``copy`` on this stream; the future completes when the GPU has finished it.

        ``keep`` holds objects (tensors) that must outlive the copy.
        """
        return self.submit_each([copy], keep)[0].future

    def submit_each(self, copies: Sequence[Callable[[], object]], keep: Sequence[object] = ()) -> list[Completion]:
        """Run ``copies`` in order on this stream, one completion (event and future) after each.

        Completion ``i`` fires once copies ``0..i`` have finished: what a layer-wise
        load hands out so that layer ``i`` is used while ``i+1`` is in flight.
        """
        if self._closed:
            raise StoreClosedError(f"the copy stream on {self.device} is closed")
        if self._stream is None:
            return self._run_here(copies)
        assert self._waiter is not None
        events: list[torch.cuda.Event] = []
        failed: TierIOError | None = None
        try:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for copy in copies:
                    copy()
                    event = torch.cuda.Event(blocking=True)
                    event.record(self._stream)
                    events.append(event)
        except (RuntimeError, OSError) as exc:  # an enqueue failure: the copies after it never ran
            failed = TierIOError(f"CUDA copy on {self.device} failed to start: {exc}")
        out = [Completion(self._waiter.submit(_wait, e, keep), e, self.device) for e in events]
        return out + [Completion(completed(failed)) for _ in range(len(copies) - len(events))]

    @staticmethod
    def _run_here(copies: Sequence[Callable[[], object]]) -> list[Completion]:
        out: list[Completion] = []
        for i, copy in enumerate(copies):
            try:
                copy()
            except (RuntimeError, OSError) as exc:
                failed = TierIOError(f"copy failed: {exc}")
                return out + [Completion(completed(failed)) for _ in range(len(copies) - i)]
            out.append(Completion(completed()))
        return out

    def close(self) -> None:
        """Wait for every submitted copy, then release the helper thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._waiter is not None:
            self._waiter.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait(event: torch.cuda.Event, keep: Sequence[object]) -> None:
    """Block (sleeping, not spinning) until ``event`` fires; ``keep`` stays referenced until then."""
    try:
        event.synchronize()
    except RuntimeError as exc:
        raise TierIOError(f"CUDA copy failed: {exc}") from exc
    del keep
