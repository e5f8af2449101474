"""The DRAM tier's large copies on several threads (:func:`in_chunks`; docs/design.md,
"The copies themselves")."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tierkv.chunks import Chunks

# A batch of at least _PARALLEL_BYTES is copied by up to ``copy_threads`` threads at once
# (the calling thread and threads of one pool the process's DRAM tiers share), each
# taking the next _PARALLEL_CHUNK bytes of rows until none are left. One core does not
# reach the memory's bandwidth with a copy (about 10 GB/s on the project's VM, 13-14 with
# two threads); below a few MiB waking a thread (0.1-0.2 ms on a VM) costs what a second
# core saves. Threads copying at once are counted across the process (_copying): a pool
# thread helps only while they are no more than the call's ``copy_threads``, so that the
# copies of a daemon's several clients do not share out onto more threads than cores.
_PARALLEL_BYTES = 16 << 20
_PARALLEL_CHUNK = 8 << 20
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_workers = 0
_copying = 0   # threads copying a large batch right now (callers and helpers; under _pool_lock)


def default_copy_threads() -> int:
    """Threads a DRAM tier copies a large batch on when not told: the cores this process
    may run on, at most 4."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def _copy_pool(workers: int) -> ThreadPoolExecutor:
    """The process's pool of copy threads, with at least ``workers`` threads: one the DRAM
    tiers of every store here share, made on first use and never shut down (idle threads
    cost nothing). A tier asking for more threads gets a larger pool in its place; the
    former one's threads end once nothing refers to it. A forked child starts without
    one (_forget_pool)."""
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            _pool_workers = max(workers, default_copy_threads() - 1)
            _pool = ThreadPoolExecutor(_pool_workers, thread_name_prefix="tierkv-dram-copy")
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's pool has no threads here, yet counts its idle ones
    as ready, so work given to it would wait for ever; the next large copy makes a new
    one. The lock too: another thread may have held it at the fork."""
    global _pool, _pool_workers, _pool_lock, _copying
    _pool, _pool_workers, _pool_lock, _copying = None, 0, threading.Lock(), 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _helping(job: Chunks) -> None:
    """A pool thread's part of a large copy, counted in _copying meanwhile."""
    global _copying
    with _pool_lock:
        _copying += 1
    try:
        job.help()
    finally:
        with _pool_lock:
            _copying -= 1


def in_chunks(n: int, width: int, copy: Callable[[int, int], None], copy_threads: int,
              written: Sequence[int] | None = None) -> None:
    """``copy(a, b)`` of rows ``a:b`` for all ``n`` rows: in one call, or where the batch
    is large in chunks that this thread and up to ``copy_threads - 1`` pool threads take
    in turn (fewer while other large copies run in the process). Returns once every
    chunk taken has ended, and raises the first failure only then (the chunks write
    into the caller's memory); no chunk is taken after one failed. A write naming a
    slot twice (``written``) goes in one call, in order: its later row lands last."""
    nbytes = n * width
    if nbytes < _PARALLEL_BYTES or (written is not None and len(np.unique(np.asarray(written))) < n):
        copy(0, n)
        return
    global _copying
    with _pool_lock:   # threads other large copies hold already are not this call's
        helpers = min(copy_threads, -(-nbytes // _PARALLEL_CHUNK), copy_threads - _copying) - 1
        _copying += 1
    try:
        if helpers <= 0:
            copy(0, n)
            return
        job = Chunks(copy, n, max(1, _PARALLEL_CHUNK // max(1, width)), lambda: _copying <= copy_threads)
        job.drive(_copy_pool(helpers).submit, helpers, lambda: _helping(job))
    finally:
        with _pool_lock:
            _copying -= 1
