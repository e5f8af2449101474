"""Helpers for the transport tests: a peer server in a real second process, and page data.

``serve_forever`` is the child's entry point (``multiprocessing`` spawn): it builds a DRAM
tier, stores ``n`` seeded pages under published keys, reports ready, and serves until
killed. Tests kill it with SIGKILL to lose the peer mid-transfer, or set the ``reset``
event (see :func:`reset_event`) to cut every client connection without losing memory:
RDMA QPs are moved to ERR, TCP connections are shut.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as EventType

import numpy as np


def pages(n: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.frombuffer(rng.bytes(n * width), dtype=np.uint8).reshape(n, width).copy()


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reset_event() -> EventType:
    """An event for :func:`server_process`'s ``reset`` (of the spawn context it uses)."""
    return mp.get_context("spawn").Event()


def serve_forever(port: int, num_slots: int, page_bytes: int, stored: int, seed: int, ready: object,
                  host: str = "127.0.0.1", rdma: bool = False, reset: object = None) -> None:
    import os
    import sys

    if os.environ.get("TIERKV_RIG_GUEST") == "1":
        # The DRAM tier imports torch only to pin memory for CUDA; under TCG that import
        # costs about 100 s per process, and the rig has no GPU.
        sys.modules["torch"] = None  # type: ignore[assignment]
    from tierkv.net import PeerServer
    from tierkv.tiers.dram import DramTier

    tier = DramTier(num_slots, page_bytes)
    # Off loopback only inside the rig guest, whose network is private to the test: no credentials.
    server = PeerServer(tier, host, port, rdma=rdma, insecure=True)
    if stored:
        server.store.store([key(i) for i in range(stored)], pages(stored, page_bytes, seed))
    ready.set()  # type: ignore[attr-defined]
    while True:
        if reset is None:
            time.sleep(3600)
            continue
        if reset.wait(3600):  # type: ignore[attr-defined]
            reset.clear()  # type: ignore[attr-defined]
            if server.rdma is not None:
                server.rdma.reset_qps()
            else:
                server.tcp.drop_connections()


@contextmanager
def server_process(port: int, num_slots: int, page_bytes: int, stored: int = 0, seed: int = 0,
                   host: str = "127.0.0.1", rdma: bool = False, reset: object = None) -> Iterator[BaseProcess]:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=serve_forever, args=(port, num_slots, page_bytes, stored, seed, ready, host, rdma, reset),
                       daemon=True)
    proc.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("peer server process did not come up in 120 s")
        yield proc
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


@dataclass
class KillResult:
    """What a reader saw while its peer was killed: rows read exactly, rows read wrong
    (must stay empty), and the duration of every fetch that came back with misses."""

    good: list[int] = field(default_factory=list)
    wrong: list[int] = field(default_factory=list)
    miss_s: list[float] = field(default_factory=list)


def kill_mid_read(tier: object, metas: Sequence[object], expected: np.ndarray, proc: BaseProcess, *,
                  first_batch_s: float, settle_s: float, poll_s: float = 0.01) -> KillResult:
    """Fetch ``metas`` in a loop on a thread; once one whole batch came back, SIGKILL the
    peer ``proc``, keep reading for ``settle_s``, then stop. Every returned row is checked
    against ``expected``."""
    out = KillResult()
    stop = threading.Event()

    def reader() -> None:
        dst = np.empty(expected.shape, np.uint8)
        while not stop.is_set():
            dst.fill(0xA5)
            t0 = time.monotonic()
            res = tier.fetch_remote(metas, dst)  # type: ignore[attr-defined]
            for i, ok in enumerate(res.ok):
                if ok:
                    (out.good if np.array_equal(dst[i], expected[i]) else out.wrong).append(i)
            if not res.all_ok:
                out.miss_s.append(time.monotonic() - t0)

    t = threading.Thread(target=reader)
    t.start()
    deadline = time.monotonic() + first_batch_s
    while len(out.good) < len(expected) and time.monotonic() < deadline:  # a whole batch first
        time.sleep(poll_s)
    proc.kill()
    proc.join(10)
    time.sleep(settle_s)
    stop.set()
    t.join(60)
    assert not t.is_alive(), "the reader did not return after the peer was killed"
    return out
