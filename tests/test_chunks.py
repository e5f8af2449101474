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
        for _ in range(helpers):
            pool.submit(job.help)
        job.finish()
    spans.sort()
    assert [a for a, _ in spans] == list(range(0, n, chunk))
    assert all(b - a <= chunk for a, b in spans) and (not spans or spans[-1][1] == n)


def test_a_helper_told_not_to_help_takes_nothing() -> None:
    by: list[str] = []
    job = Chunks(lambda a, b: by.append(threading.current_thread().name), 12, 2, may_help=lambda: False)
    helper = threading.Thread(target=job.help, name="helper")
    helper.start()
    helper.join()
    job.finish()
    assert by == [threading.current_thread().name] * 6


def test_after_a_failure_no_chunk_is_taken_and_finish_raises_it() -> None:
    started: list[int] = []

    def work(a: int, b: int) -> None:
        started.append(a)
        if a == 4:
            raise KeyboardInterrupt("stop")   # any BaseException, kept for the caller

    job = Chunks(work, 20, 2)
    with pytest.raises(KeyboardInterrupt, match="stop"):
        job.finish()
    assert started == [0, 2, 4]
    job.help()                                 # a helper arriving later does nothing
    assert started == [0, 2, 4]


def test_chunks_are_at_least_one_row() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        Chunks(lambda a, b: None, 4, 0)
