"""One batch of rows worked on by several threads, a chunk at a time (and settle: a
future given the result of work a pool refused).

The calling thread and the pool threads helping it take the next chunk of rows in turn
until none are left, so a helper that wakes late (0.1-0.2 ms on a VM) or not at all
costs the caller nothing: it takes the chunks no one has started rather than waiting for
a share handed out up front. Used by the DRAM tier's large copies and the codec's
batches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def settle(fut: Future[T], fn: Callable[[], T]) -> None:
    """Run ``fn`` here and give ``fut`` its result or its failure (any BaseException, as a
    pool thread would): for work a pool refused, run by the caller or a thread of its own."""
    try:
        fut.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - the waiter's result() raises it
        fut.set_exception(exc)


class Chunks:
    """Rows ``0:n`` of one batch: ``work(a, b)`` is called for consecutive chunks of at most
    ``chunk`` rows, each by the thread that took it. ``may_help()`` (optional) is asked
    before a helper takes each chunk: false sends the helper away (the caller takes the
    rest). After a chunk fails no chunk is taken; the first failure is kept for the caller
    (:meth:`drive`)."""

    def __init__(self, work: Callable[[int, int], None], n: int, chunk: int,
                 may_help: Callable[[], bool] | None = None) -> None:
        if chunk < 1:
            raise ValueError(f"chunks of at least one row, got {chunk}")
        self.work, self.n, self.chunk, self.may_help = work, n, chunk, may_help
        self.next = 0                  # the first row no thread has taken
        self.running = 0               # chunks being worked on
        self.error: BaseException | None = None
        self._cv = threading.Condition(threading.Lock())

    def _take(self, helper: bool) -> tuple[int, int] | None:
        with self._cv:
            if self.error is not None or self.next >= self.n:
                return None
            if helper and self.may_help is not None and not self.may_help():
                return None
            a = self.next
            self.next = min(self.n, a + self.chunk)
            self.running += 1
            return a, self.next

    def run(self, helper: bool = False) -> None:
        """Work on chunks until none are left (a helper: or until ``may_help`` says no)."""
        while (span := self._take(helper)) is not None:
            failure: BaseException | None = None
            try:
                self.work(*span)
            except BaseException as exc:  # noqa: BLE001 - raised by the caller, in drive()
                failure = exc
            with self._cv:
                self.running -= 1
                if failure is not None and self.error is None:
                    self.error = failure
                self._cv.notify_all()

    def help(self) -> None:
        """A pool thread's part."""
        self.run(helper=True)

    def drive(self, submit: Callable[[Callable[[], None]], object], helpers: int,
              helper: Callable[[], None] | None = None) -> None:
        """The caller's part: hand ``helpers`` pool threads ``helper`` (default
        :meth:`help`) through ``submit``, work on chunks until none are left, wait for the
        chunks other threads took, then raise the first failure, if any.

        Every chunk taken has ended when this returns or raises, whatever happens meanwhile
        (they write into the caller's memory): a pool that takes no more work (``submit``
        raising, as at interpreter exit) leaves the chunks to the caller; an exception in
        this thread (KeyboardInterrupt while it waits, say) stops the batch, no chunk is
        taken after it, and it is raised once the chunks in flight have ended."""
        try:
            for _ in range(helpers):
                try:
                    submit(helper or self.help)
                except Exception:  # noqa: BLE001 - no thread to be had (shut down, none left): copy alone
                    break
            self.run()
        except BaseException as exc:  # noqa: BLE001 - raised below, once no chunk is in flight
            with self._cv:
                if self.error is None:
                    self.error = exc
        with self._cv:
            while self.running:
                try:
                    self._cv.wait()
                except BaseException as exc:  # noqa: BLE001 - the wait goes on; raised below
                    if self.error is None:
                        self.error = exc
        if self.error is not None:
            raise self.error
