"""Waiting for state that a background thread changes (a tier's monitor, a kernel
controller): poll a condition until it holds or a deadline passes. Used where no future
exists to wait on; imports nothing heavy, so rig tests can use it too."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, step: float = 0.02) -> bool:
    """True as soon as ``cond()`` is, False if it is still false after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


def ends_while_busy(pool: Executor, workers: int, call: Callable[[], None], timeout: float = 20.0) -> None:
    """Run ``call`` on a thread named "caller" while all ``workers`` threads of ``pool`` are
    held busy; AssertionError if it has not returned within ``timeout`` (it waited for the
    pool). The pool is let go and the thread joined either way."""
    release, done = threading.Event(), threading.Event()
    blockers = [pool.submit(release.wait) for _ in range(workers)]

    def run() -> None:
        call()
        done.set()

    caller = threading.Thread(target=run, name="caller")
    caller.start()
    try:
        assert done.wait(timeout), "the call waited for a busy pool"
    finally:
        release.set()
        caller.join()
        for b in blockers:
            b.result()
