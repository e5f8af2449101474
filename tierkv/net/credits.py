"""Receive credits: the receiver grants, the sender spends, so no send finds the receiver
without a posted receive buffer.

On RDMA a SEND (or WRITE_WITH_IMM) that arrives when the receiver has no receive posted
is answered with an RNR NAK and retried by the NIC after the RNR timer: under incast
that retry storm costs far more than waiting. So the receiver grants one credit per
receive it has posted for a connection (in the handshake), and hands a credit back with
every reply once it has reposted the buffer the request used. The sender's
:class:`CreditGate` blocks while it holds none. The TCP fallback keeps the same
accounting (its server NAKs a message beyond its posted depth) so both paths behave
alike. Thread-safe. Used by :mod:`tierkv.net.tcp` and :mod:`tierkv.net.rdma`.
"""

from __future__ import annotations

import threading


class CreditGate:
    """The sender's side: ``acquire`` takes one credit (waiting up to ``timeout_s``),
    ``grant`` adds credits the receiver returned, ``reset`` starts over after a
    reconnect (the new connection's grant). ``enabled=False`` never blocks (the
    no-credits baseline of the benchmark)."""

    def __init__(self, credits: int = 0, enabled: bool = True) -> None:
        self._cond = threading.Condition()
        self._credits = credits
        self._closed = False
        self.enabled = enabled
        self.waits = 0  # how many acquires found no credit: a measure of back-pressure

    @property
    def available(self) -> int:
        return self._credits

    def acquire(self, timeout_s: float | None = None) -> bool:
        """Take one credit; False when none arrived within ``timeout_s`` or the gate closed."""
        if not self.enabled:
            return not self._closed
        with self._cond:
            if self._credits <= 0:
                self.waits += 1
                self._cond.wait_for(lambda: self._credits > 0 or self._closed, timeout_s)
            if self._closed or self._credits <= 0:
                return False
            self._credits -= 1
            return True

    def grant(self, n: int) -> None:
        if n <= 0:
            return
        with self._cond:
            self._credits += n
            self._cond.notify(n)

    def reset(self, credits: int) -> None:
        with self._cond:
            self._credits = credits
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class ReceiveLedger:
    """The receiver's side for one connection: ``depth`` receives posted; ``consume``
    when a message lands (False: none was posted, an overrun that RDMA would NAK with
    RNR), ``repost`` when its buffer is free again, which also returns one credit to the
    sender through :meth:`take_grants`."""

    def __init__(self, depth: int) -> None:
        self._lock = threading.Lock()
        self.depth = depth
        self._posted = depth
        self._to_grant = 0
        self.overruns = 0

    @property
    def posted(self) -> int:
        return self._posted

    def consume(self) -> bool:
        with self._lock:
            if self._posted <= 0:
                self.overruns += 1
                return False
            self._posted -= 1
            return True

    def repost(self) -> None:
        with self._lock:
            self._posted += 1
            self._to_grant += 1

    def take_grants(self) -> int:
        """Credits to piggyback on the next message to the sender (and forget)."""
        with self._lock:
            n, self._to_grant = self._to_grant, 0
            return n
