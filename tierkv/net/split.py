"""A batch too large for one message, issued as parts one after another.

A reply carries at most :func:`~tierkv.net.wire.pages_per_message` pages, so a larger
read or write goes out as parts, each issued once the one before has resolved: each part
has its own deadline, and a batch takes the time its bytes need.

The next part is never issued from the thread that resolved the one before. That thread
is a link's reader or reaper, and issuing may wait for room in a full send window: a
reader waiting there reads no replies, so the window never drains and every request on
the link expires. Parts are issued on ``executor`` instead.

The joined future is a :class:`Split`: cancelling it issues no further part, and its
``settled`` event is set once no part is in flight. A caller that gives up waits on
``settled`` before it hands the destination buffer back, so no part writes there after.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, InvalidStateError
from typing import TypeVar

from tierkv.errors import StoreClosedError

P = TypeVar("P")
R = TypeVar("R")


class Split(Future[R]):
    """The future of a batch sent as parts; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.settled = threading.Event()


def in_turn(parts: Sequence[Callable[[], Future[P]]], join: Callable[[list[P]], R],
            executor: Executor) -> Split[R]:
    """Issue ``parts`` one after another on ``executor`` and resolve with ``join`` of
    their results, in order; the first part that raises fails the whole batch."""
    out: Split[R] = Split()
    results: list[P] = []

    def finish(result: R | None = None, exc: BaseException | None = None) -> None:
        try:
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(result)  # type: ignore[arg-type]
        except InvalidStateError:  # cancelled meanwhile: the caller has gone
            pass
        out.settled.set()

    def issue() -> None:  # on the executor: may wait for room in the send window
        if out.cancelled():
            out.settled.set()
            return
        try:
            part = parts[len(results)]()
        except BaseException as exc:  # noqa: BLE001 - the joined future carries it
            finish(exc=exc)
            return
        part.add_done_callback(resolved)

    def resolved(part: Future[P]) -> None:  # on the thread that resolved the part: never blocks
        try:
            results.append(part.result())
        except BaseException as exc:  # noqa: BLE001
            finish(exc=exc)
            return
        if len(results) == len(parts):
            try:
                joined = join(results)
            except BaseException as exc:  # noqa: BLE001
                finish(exc=exc)
                return
            finish(joined)
            return
        if out.cancelled():
            out.settled.set()
            return
        try:
            executor.submit(issue)
        except RuntimeError:  # the executor shut down: the transport is closed
            finish(exc=StoreClosedError("transport closed while a split batch was in flight"))

    if not parts:
        finish(join([]))
    else:
        issue()  # the first part on the caller's thread, as an unsplit batch would be
    return out
