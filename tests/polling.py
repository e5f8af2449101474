"""Waiting for state that a background thread changes (a tier's monitor, a kernel
controller): poll a condition until it holds or a deadline passes. Used where no future
exists to wait on; imports nothing heavy, so rig tests can use it too."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, step: float = 0.02) -> bool:
    """True as soon as ``cond()`` is, False if it is still false after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()
