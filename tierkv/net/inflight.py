"""One RDMA operation in flight, kept across QP rebuilds until it is answered or expires.

An :class:`Op` (a read, a write or a call) lives in its link's
:class:`~tierkv.net.window.SendWindow` from submission until its result is set. Each
time a QP starts it, that is a new *attempt*: the attempt owns the registered blocks
it allocated and counts its signaled work requests; completions and continuations carry
the attempt number and are ignored once the attempt is retired. A QP that fails retires
the attempts on it (after the QP is destroyed, so no DMA can reach their blocks), and the
window is rewound, so the next QP starts them again: reads from their first phase,
writes from their SEND (the server's generation rules make a resent write a no-op).

The result is set exactly once: :meth:`Op.resolve` (an answer, or a failure at the
deadline) claims the op first, so a read whose deadline passed never copies into the
caller's buffer afterwards. Thread-safe. Used by :mod:`tierkv.net.rdma_link` and
:mod:`tierkv.net.rdma_client`; pure Python, tested on the host.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tierkv.net.pool import Block, PagePool


@dataclass(eq=False)
class Op:
    """``start(link, op)`` posts an attempt's first work requests; ``on_reply(link, op,
    body)`` handles a message the server sent for it; ``fail(why)`` is its failed result;
    ``credits`` the receive credits an attempt needs up front."""

    deadline: float
    fail: Callable[[str], object]
    future: Future[Any]
    start: Callable[[Any, Op], None]
    credits: int = 0
    on_reply: Callable[[Any, Op, Any], None] | None = None
    seq: int = 0                          # the window's; the wire carries seq & 0x7FFFFFFF
    attempt: int = 0
    link: Any = None                      # the link running the current attempt, if any
    wrs: int = 0                          # its signaled work requests not yet completed
    blocks: list[Block] = field(default_factory=list)
    then: Callable[[], None] | None = None  # runs once wrs reaches 0
    phase: int = 0                        # per attempt: how far a multi-step op got
    retries: int = 0                      # re-posts asked by the server (staging full)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _claimed: bool = False

    @property
    def wire_seq(self) -> int:
        return self.seq & 0x7FFFFFFF

    @property
    def done(self) -> bool:
        return self._claimed

    def begin(self, link: Any) -> int:
        """A new attempt on ``link``; returns its number."""
        self.attempt += 1
        self.link, self.wrs, self.then, self.phase = link, 0, None, 0
        self.blocks = []
        return self.attempt

    def retire(self, pool: PagePool) -> None:
        """End the current attempt: its completions are ignored from now on and its blocks
        go back to ``pool``. Only once no DMA can reach them (the attempt's work requests
        all completed, or its QP is destroyed)."""
        self.attempt += 1
        self.link, self.wrs, self.then = None, 0, None
        blocks, self.blocks = self.blocks, []
        for b in blocks:
            pool.free(b)

    def resolve(self, make_result: Callable[[], object]) -> bool:
        """Set the result once (``make_result`` runs only for the first caller, under the
        claim); False when the op was already resolved."""
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
        try:
            result = make_result()
        except Exception as err:  # noqa: BLE001 - a result that cannot be built is a failure, not a hang
            result = self.fail(f"could not build the result: {err}")
        if not self.future.done():
            self.future.set_result(result)
        return True
