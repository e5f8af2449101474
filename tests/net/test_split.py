"""Batches issued as parts (tierkv.net.split): order, failure, cancellation, and that no
part is ever issued from the thread that resolved the one before."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tierkv.errors import StoreClosedError
from tierkv.net.split import in_turn

T = 5


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as ex:
        yield ex


class Parts:
    """Parts whose futures the test resolves by hand; records the thread that issued each."""

    def __init__(self, n: int) -> None:
        self.futures: list[Future[int]] = []
        self.threads: list[str] = []
        self.issued = threading.Condition()
        self.calls: list[Callable[[], Future[int]]] = [self._part for _ in range(n)]

    def _part(self) -> Future[int]:
        with self.issued:
            f: Future[int] = Future()
            self.futures.append(f)
            self.threads.append(threading.current_thread().name)
            self.issued.notify_all()
            return f

    def wait_issued(self, n: int) -> None:
        with self.issued:
            assert self.issued.wait_for(lambda: len(self.futures) >= n, T), f"part {n} never issued"


def test_parts_go_one_after_another_and_join_in_order(pool: ThreadPoolExecutor) -> None:
    p = Parts(3)
    out = in_turn(p.calls, list, pool)
    p.wait_issued(1)
    assert len(p.futures) == 1                       # the next waits for this one
    p.futures[0].set_result(1)
    p.wait_issued(2)
    p.futures[1].set_result(2)
    p.wait_issued(3)
    assert not out.done()
    p.futures[2].set_result(3)
    assert out.result(T) == [1, 2, 3] and out.settled.is_set()


def test_the_next_part_is_never_issued_on_the_resolving_thread(pool: ThreadPoolExecutor) -> None:
    p = Parts(2)
    out = in_turn(p.calls, list, pool)
    p.wait_issued(1)
    resolver = threading.Thread(target=p.futures[0].set_result, args=(1,), name="a-link-reader")
    resolver.start()
    resolver.join(T)
    p.wait_issued(2)
    assert p.threads[0] == threading.current_thread().name   # the first part: the caller's
    assert p.threads[1] != "a-link-reader"                   # a reader may not wait in a window
    p.futures[1].set_result(2)
    assert out.result(T) == [1, 2]


def test_a_part_that_raises_fails_the_batch(pool: ThreadPoolExecutor) -> None:
    def closed() -> Future[int]:
        raise StoreClosedError("closed")
    done: Future[int] = Future()
    done.set_result(1)
    out = in_turn([lambda: done, closed, closed], list, pool)
    with pytest.raises(StoreClosedError):
        out.result(T)
    assert out.settled.is_set()


def test_a_cancelled_batch_issues_nothing_more_and_settles_when_its_part_resolves(
        pool: ThreadPoolExecutor) -> None:
    p = Parts(3)
    out = in_turn(p.calls, list, pool)
    p.wait_issued(1)
    assert out.cancel()
    assert not out.settled.is_set()                  # a part is still in flight
    p.futures[0].set_result(1)
    assert out.settled.wait(T)
    pool.shutdown(wait=True)
    assert len(p.futures) == 1                       # nothing issued after the cancel


def test_many_parts_that_resolve_at_once_do_not_recurse(pool: ThreadPoolExecutor) -> None:
    def ready() -> Future[int]:
        f: Future[int] = Future()
        f.set_result(1)
        return f
    out = in_turn([ready] * 5000, len, pool)
    assert out.result(30) == 5000


def test_a_shut_executor_fails_the_batch_instead_of_leaving_it_pending() -> None:
    pool = ThreadPoolExecutor(1)
    p = Parts(2)
    out = in_turn(p.calls, list, pool)
    p.wait_issued(1)
    pool.shutdown()
    p.futures[0].set_result(1)
    with pytest.raises(StoreClosedError):
        out.result(T)
