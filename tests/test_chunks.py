"""tierkv.chunks: a batch's rows worked on a chunk at a time by several threads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tierkv.chunks import Chunks


@pytest.mark.parametrize(("n", "chunk", "helpers"), [(0, 3, 2), (1, 5, 3), (10, 3, 0), (97, 4, 3), (1000, 7, 6)])
def test_every_row_is_worked_on_once_in_chunks_of_at_most_chunk_rows(n: int, chunk: int, helpers: int) -> None:
    spans: list[tuple[int, int]] = []
    lock = threading.Lock()

    def work(a: int, b: int) -> None:
        with lock:
            spans.append((a, b))

    job = Chunks(work, n, chunk)
    with ThreadPoolExecutor(max(1, helpers)) as pool:
        job.drive(pool.submit, helpers)
    spans.sort()
    assert [a for a, _ in spans] == list(range(0, n, chunk))
    assert all(b - a <= chunk for a, b in spans) and (not spans or spans[-1][1] == n)


def test_a_helper_told_not_to_help_takes_nothing() -> None:
    by: list[str] = []
    job = Chunks(lambda a, b: by.append(threading.current_thread().name), 12, 2, may_help=lambda: False)
    helper = threading.Thread(target=job.help, name="helper")
    helper.start()
    helper.join()
    job.drive(lambda fn: None, 0)
    assert by == [threading.current_thread().name] * 6


def test_after_a_failure_no_chunk_is_taken_and_drive_raises_it() -> None:
    started: list[int] = []

    def work(a: int, b: int) -> None:
        started.append(a)
        if a == 4:
            raise KeyboardInterrupt("stop")   # any BaseException, kept for the caller

    job = Chunks(work, 20, 2)
    with pytest.raises(KeyboardInterrupt, match="stop"):
        job.drive(lambda fn: None, 0)
    assert started == [0, 2, 4]
    job.help()                                 # a helper arriving later does nothing
    assert started == [0, 2, 4]


def test_chunks_are_at_least_one_row() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        Chunks(lambda a, b: None, 4, 0)


def test_a_pool_that_takes_no_work_leaves_every_chunk_to_the_caller() -> None:
    # As at interpreter exit (concurrent.futures refuses new work once the main thread
    # is done) or where no thread can be started.
    pool = ThreadPoolExecutor(2)
    pool.shutdown()
    by: list[str] = []
    Chunks(lambda a, b: by.append(threading.current_thread().name), 10, 3).drive(pool.submit, 2)
    assert by == [threading.current_thread().name] * 4

    submitted: list[object] = []

    def second_fails(fn: object) -> None:
        if submitted:
            raise RuntimeError("can't start new thread")
        submitted.append(fn)      # handed to a "thread" that never runs it before the call ends

    by.clear()
    Chunks(lambda a, b: by.append("caller"), 10, 3).drive(second_fails, 3)
    assert by == ["caller"] * 4 and len(submitted) == 1


def test_an_exception_while_the_caller_waits_stops_the_batch_once_nothing_is_in_flight() -> None:
    import time

    written: list[tuple[int, float]] = []
    helper_in = threading.Event()

    def work(a: int, b: int) -> None:
        if threading.current_thread().name == "helper":
            helper_in.set()
            time.sleep(0.3)
        written.append((a, time.monotonic()))

    job = Chunks(work, 40, 2)
    helper = threading.Thread(target=job.help, name="helper")
    real_wait = job._cv.wait
    interrupted: list[float] = []

    def wait_interrupted(timeout: float | None = None) -> bool:
        if not interrupted:               # the first wait is cut short, as by Ctrl-C
            interrupted.append(time.monotonic())
            raise KeyboardInterrupt("interrupted while waiting")
        return real_wait(timeout)

    def take_after_helper(a: int, b: int) -> None:
        helper_in.wait(10)                # the helper has a chunk in flight before the caller runs out
        work(a, b)

    job.work = lambda a, b: (take_after_helper if threading.current_thread().name != "helper" else work)(a, b)
    job._cv.wait = wait_interrupted       # type: ignore[method-assign]
    helper.start()
    with pytest.raises(KeyboardInterrupt, match="interrupted while waiting"):
        job.drive(lambda fn: None, 0)
    raised = time.monotonic()
    helper.join()
    assert all(t <= raised for _, t in written)          # nothing written after the call raised
    assert sorted(a for a, _ in written) == list(range(0, 40, 2))   # the rows were all taken before the wait
