"""DualPath on the requesting node: divide a fetch of pages from the storage peers between
this node's own reads and a helper's push (:mod:`tierkv.dualpath.push`).

:class:`Loads` is built by the store's peering from ``[peers] helpers``, ``landing`` and
``dualpath``. For a fetch of ``m`` pages a storage peer holds, it asks
:func:`tierkv.dualpath.scheduler.choose_reads` which side reads which pages, from what
it knows now: the bytes its own reads and each helper have queued (a helper reports its
queue with every answer; this node adds what it has asked of it meanwhile) and each
side's rate, measured as moving averages of the fetches and pushes that finished (both
start equal, so the first split is even). The helper's part goes out first (a ``push``
call), this node reads its own part meanwhile, then takes what landed; whatever a
helper did not deliver (it was busy, unreachable, lacked the pages, or a write failed)
is read here after, so a helper's failure costs time, never pages.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tierkv.dualpath.push import Landing, PushRequest, decode_answer
from tierkv.dualpath.scheduler import Read, Side, choose_reads
from tierkv.errors import TierKVError
from tierkv.keys import PageKey
from tierkv.net import NetConfig, connect
from tierkv.net.transport import CallResult, Transport

log = logging.getLogger(__name__)
Endpoint = tuple[str, int]
SELF = "self"
#: The rate both sides are taken to have before one is measured (bytes/s): equal, so that
#: a first split is even; measured transfers replace it.
INITIAL_BYTES_S = 1e9
SPREAD = 0.3        # sizes that spread this much (deviation over mean) tell latency from rate; less is noise
RETRY_S = 5.0       # a helper that could not be reached is asked again after this long
IDLE_S = 1.0        # a helper that delivered nothing (busy, or it lacks the pages) is left alone this long
PUSH_BUDGET = 0.75  # of timeout_s: how long a helper may take to answer a push
#: Reads this node's own part: ``(first, stop, rows)`` -> how many leading pages arrived.
OwnRead = Callable[[int, int, np.ndarray], int]


@dataclass
class _HelperState:
    ep: Endpoint
    fit: _Fit = field(default_factory=lambda: _Fit())
    reported_queue: float = 0.0     # what it said it had queued for others, with its last answer
    answered_at: float = 0.0        # when (time.monotonic())
    asked: float = 0.0              # bytes this node has asked of it and not had answered
    link: Transport | None = None
    next_try: float = 0.0


@dataclass
class _Push:
    """A push asked of a helper: its bytes, when it was asked and answered, its call."""

    nbytes: float
    began: float
    done_at: float | None = None
    call: Future[CallResult] | None = None


@dataclass
class LoadStats:
    """What :class:`Loads` did: fetches divided, pages read here and pushed by helpers,
    pages a helper was asked for but did not deliver (read here after), helpers' errors."""

    fetches: int = 0
    pages_self: int = 0
    pages_helpers: int = 0
    pages_fallback: int = 0
    helper_errors: int = 0


class Loads:
    """Divides fetches between this node and its ``helpers`` by ``policy``."""

    def __init__(self, policy: str, helpers: Sequence[Endpoint], landing: Landing, net: NetConfig,
                 node_id: int = 0) -> None:
        self.policy = policy
        self.node_id = node_id
        self.waiting = 0   # fetches waiting on a helper's answer now (a helper loader of this node's checks)
        self.landing = landing
        self._net = net
        self._lock = threading.Lock()
        self._helpers = {ep: _HelperState(ep) for ep in helpers}
        self._own_fit = _Fit()
        self._own_queue = 0.0
        self._stats = LoadStats()
        self._closed = False

    def fetch(self, chain: Sequence[PageKey], start: int, pages: int, rows: np.ndarray, salt: bytes,
              own: OwnRead) -> int:
        """Load ``chain[start:start + pages]`` (pages a storage peer holds) into
        ``rows[:pages]``: the helper's part pushed, this node's read by ``own``. How many
        leading pages arrived."""
        page_bytes = rows.shape[1]
        reads = self._choose(pages, page_bytes)
        helped = next((r for r in reads if r.side != SELF), None)
        if helped is None:
            return self._own(own, 0, pages, rows)
        state = self._helpers[_endpoint(helped.side)]
        x = helped.start
        slots, gens = self.landing.take(helped.stop - x)
        stop = x + len(slots)   # past what the landing zone took, this node reads too
        try:
            push = self._push(state, chain[:start + stop], start + x, slots, gens, salt, page_bytes) if slots else None
            got = self._own(own, 0, x, rows) if x else 0
            if got < x:
                return got
            tail = self._own(own, stop, pages, rows) if stop < pages else 0
            pushed = self._answer(state, push, slots, gens, rows[x:stop], page_bytes) if push is not None else 0
            if pushed < stop - x:   # what the helper did not deliver: read here
                more = self._own(own, x + pushed, stop, rows)
                with self._lock:
                    self._stats.pages_fallback += more
                if x + pushed + more < stop:
                    return x + pushed + more
            return stop + tail
        finally:
            if slots:
                self.landing.release(slots)

    def _choose(self, pages: int, page_bytes: int) -> list[Read]:
        now = time.monotonic()
        with self._lock:
            self._stats.fetches += 1
            latency, rate = self._own_fit.estimate(self._stats.fetches)
            prefill = Side(SELF, self._own_queue, rate, latency_s=latency)
            decode = []
            for h in self._helpers.values():
                latency, rate = h.fit.estimate(self._stats.fetches)
                # What it reported queued for others has drained at its rate since.
                queued = max(0.0, h.reported_queue - rate * (now - h.answered_at))
                decode.append(Side(_name(h.ep), queued + h.asked, rate, holds=now >= h.next_try, latency_s=latency))
        return choose_reads(self.policy, pages, page_bytes, prefill, decode)

    def _own(self, own: OwnRead, first: int, stop: int, rows: np.ndarray) -> int:
        nbytes = (stop - first) * rows.shape[1]
        with self._lock:
            self._own_queue += nbytes
        began = time.perf_counter()
        got = 0
        try:
            got = own(first, stop, rows[first:stop])
        finally:
            seconds = time.perf_counter() - began
            with self._lock:
                self._own_queue -= nbytes
                if got and seconds > 0:
                    self._own_fit.add(got * rows.shape[1], seconds, self._stats.fetches)
                self._stats.pages_self += got
        return got

    def _push(self, state: _HelperState, chain: Sequence[PageKey], start: int, slots: list[int], gens: list[int],
              salt: bytes, page_bytes: int) -> _Push | None:
        """Ask the helper to push ``chain[start:]`` into ``slots``; None if it cannot be asked."""
        link = self._link(state)
        if link is None:
            return None
        # The helper answers within this budget, before the call's own deadline (timeout_s) ends it.
        req = PushRequest(self.landing.address, tuple(chain), start, tuple(slots), tuple(gens), salt,
                          max(1, int(self._net.timeout_s * PUSH_BUDGET * 1e3)), self.node_id)
        push = _Push(len(slots) * page_bytes, time.perf_counter())
        with self._lock:
            state.asked += push.nbytes
        try:
            push.call = link.call("push", req.encode())
        except TierKVError:
            with self._lock:
                state.asked -= push.nbytes
            self._drop(state)
            return None

        def answered(_fut: object) -> None:   # counted off when it ends, waited for or not
            push.done_at = time.perf_counter()
            with self._lock:
                state.asked -= push.nbytes
        push.call.add_done_callback(answered)
        return push

    def _answer(self, state: _HelperState, push: _Push, slots: list[int], gens: list[int], rows: np.ndarray,
                page_bytes: int) -> int:
        """What the helper's push delivered into ``rows``."""
        assert push.call is not None
        with self._lock:
            self.waiting += 1
        try:
            res = push.call.result(timeout=self._net.timeout_s * 2 + 1)
            if not res.ok:
                raise TierKVError(res.error or res.body.decode(errors="replace"))
            stored, queued = decode_answer(res.body)
            if stored > len(slots):
                raise TierKVError(f"answered {stored} pages stored of {len(slots)} asked")
        except (TimeoutError, TierKVError) as exc:
            log.warning("helper %s:%d failed a push (%s); this node reads those pages itself", state.ep[0],
                        state.ep[1], exc)
            push.call.cancel()
            with self._lock:
                state.next_try = time.monotonic() + RETRY_S
                self._stats.helper_errors += 1
            self._drop(state)
            return 0
        finally:
            with self._lock:
                self.waiting -= 1
        got = self.landing.collect(slots[:stored], gens[:stored], rows[:stored])
        seconds = (push.done_at or time.perf_counter()) - push.began
        with self._lock:
            state.reported_queue, state.answered_at = queued, time.monotonic()
            if not got:   # busy, or it cannot reach the pages: this node reads them for a while
                state.next_try = state.answered_at + IDLE_S
            if got and seconds > 0:
                state.fit.add(got * page_bytes, seconds, self._stats.fetches)
            self._stats.pages_helpers += got
        return got

    def _link(self, state: _HelperState) -> Transport | None:
        """The TCP control connection to a helper (pushes are answered after the pages are
        written, which an RDMA server's progress thread must not wait for)."""
        with self._lock:
            if state.link is not None or self._closed or time.monotonic() < state.next_try:
                return state.link
        try:
            link = connect(state.ep[0], state.ep[1], "tcp", self._net)
        except TierKVError as exc:
            log.warning("helper %s:%d unreachable (%s); retrying in %.0f s", state.ep[0], state.ep[1], exc, RETRY_S)
            with self._lock:
                state.next_try = time.monotonic() + RETRY_S
            return None
        with self._lock:
            if self._closed or state.link is not None:
                other = state.link
                link.close()
                return other
            state.link = link
        return link

    def _drop(self, state: _HelperState) -> None:
        with self._lock:
            link, state.link = state.link, None
        if link is not None:
            link.close()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {k: float(v) for k, v in self._stats.__dict__.items()}

    def rates(self) -> tuple[dict[str, float], dict[str, float]]:
        """Each side's estimated rate (bytes/s) and latency (s): this node's own reads
        (``self``) and each helper's."""
        with self._lock:
            now = self._stats.fetches
            sides = {SELF: self._own_fit.estimate(now), **{_name(h.ep): h.fit.estimate(now) for h in self._helpers.values()}}
        return {k: r for k, (_, r) in sides.items()}, {k: lat for k, (lat, _) in sides.items()}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = [h.link for h in self._helpers.values() if h.link is not None]
            for h in self._helpers.values():
                h.link = None
        for link in links:
            link.close()
        self.landing.close()


class _Fit:
    """A side's cost model, ``seconds = latency + bytes / rate``, fitted by least squares
    to its last ``WINDOW`` transfers while their sizes spread enough (by ``SPREAD`` of
    their mean) to tell latency from rate; otherwise the latency is 0 and the rate what
    the transfers averaged. The rate is at most the fastest transfer's. A side's first
    transfer (it connects) is not counted; before any, and once the newest is ``FORGET``
    fetches old (a side the policy stopped choosing on one bad measurement is then tried
    again), the rate is the initial guess."""

    WINDOW = 16
    FORGET = 32

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=self.WINDOW)
        self._first = True
        self._last = 0

    def add(self, nbytes: float, seconds: float, tick: int) -> None:
        """A transfer of ``nbytes`` that took ``seconds``, at fetch number ``tick``."""
        if self._first:
            self._first = False
            return
        self._samples.append((nbytes, seconds))
        self._last = tick

    def estimate(self, tick: int) -> tuple[float, float]:
        """(latency seconds, rate bytes/s) at fetch number ``tick``."""
        if self._samples and tick - self._last > self.FORGET:
            self._samples.clear()
        n = len(self._samples)
        if not n:
            return 0.0, INITIAL_BYTES_S
        mb = sum(b for b, _ in self._samples) / n
        ms = sum(t for _, t in self._samples) / n
        var = sum((b - mb) ** 2 for b, _ in self._samples) / n
        if n >= 3 and var > (SPREAD * mb) ** 2:
            slope = sum((b - mb) * (t - ms) for b, t in self._samples) / n / var
            latency = ms - slope * mb
            if slope > 0 and 0 <= latency < min(t for _, t in self._samples):
                # No faster than the fastest transfer past its latency (a slope near 0 is noise).
                return latency, min(1 / slope, max(b / (t - latency) for b, t in self._samples))
        return 0.0, mb / ms


def _name(ep: Endpoint) -> str:
    return f"{ep[0]}:{ep[1]}"


def _endpoint(name: str) -> Endpoint:
    host, _, port = name.rpartition(":")
    return host, int(port)
