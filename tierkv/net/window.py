"""A bounded software send window per connection, with acknowledgement tracking.

Every request a client sends gets a sequence number and stays in the window until its
reply (the acknowledgement) arrives or its deadline passes. The window bounds the
requests in flight (``capacity``), keeps them in send order, and after a reconnect hands
back those not acknowledged so they are sent again (``rewind``). Page writes are
idempotent (keyed by slot and generation at the server), reads have no side effect, so a
resend cannot corrupt. Thread-safe. Used by :mod:`tierkv.net.tcp` and
:mod:`tierkv.net.rdma`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Entry(Generic[T]):
    """One request in flight: what to send, when it expires, whether it went out on the
    current connection, how often it was sent."""

    seq: int
    item: T
    deadline: float
    sent: bool = False
    sends: int = 0
    not_before: float = 0.0  # a NAKed request waits (the RNR timer) before its retry


class SendWindow(Generic[T]):
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"send window needs capacity >= 1, got {capacity}")
        self.capacity = capacity
        self._cond = threading.Condition()
        self._entries: OrderedDict[int, Entry[T]] = OrderedDict()
        self._next_seq = 1
        self._closed = False
        self.resends = 0

    def __len__(self) -> int:
        return len(self._entries)

    def reserve(self, item: T, deadline: float) -> Entry[T] | None:
        """Add ``item`` with the next sequence number, waiting while the window is full;
        None when the deadline passed first or the window closed."""
        with self._cond:
            while len(self._entries) >= self.capacity and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            if self._closed:
                return None
            e = Entry(self._next_seq, item, deadline)
            self._next_seq += 1
            self._entries[e.seq] = e
            self._cond.notify_all()
            return e

    def next_unsent(self, timeout_s: float) -> Entry[T] | None:
        """The oldest entry not yet sent on this connection and due (marked sent), waiting
        up to ``timeout_s``; None when there is none."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                due = [e for e in self._entries.values() if not e.sent]
                ready = [e for e in due if e.not_before <= now]
                if ready:
                    e = ready[0]
                    e.sent = True
                    e.sends += 1
                    if e.sends > 1:
                        self.resends += 1
                    return e
                wake = min([e.not_before for e in due] + [end])
                if now >= end:
                    return None
                self._cond.wait(max(0.0, wake - now))
            return None

    def ack(self, seq: int) -> Entry[T] | None:
        """Remove and return the entry ``seq`` (None when it already expired or was acked)."""
        with self._cond:
            e = self._entries.pop(seq, None)
            self._cond.notify_all()
            return e

    def retry(self, seq: int, delay_s: float) -> None:
        """Send ``seq`` again after ``delay_s`` (the receiver NAKed it)."""
        with self._cond:
            e = self._entries.get(seq)
            if e is not None:
                e.sent = False
                e.not_before = time.monotonic() + delay_s
                self._cond.notify_all()

    def rewind(self) -> int:
        """After a reconnect: mark every unacknowledged entry unsent, in order; returns how many."""
        with self._cond:
            for e in self._entries.values():
                e.sent = False
                e.not_before = 0.0
            self._cond.notify_all()
            return len(self._entries)

    def expire(self, now: float) -> list[Entry[T]]:
        """Remove and return the entries whose deadline passed."""
        with self._cond:
            gone = [e for e in self._entries.values() if e.deadline <= now]
            for e in gone:
                del self._entries[e.seq]
            if gone:
                self._cond.notify_all()
            return gone

    def drain(self) -> list[Entry[T]]:
        """Remove and return every entry (the peer is unreachable: fail them now)."""
        with self._cond:
            left = list(self._entries.values())
            self._entries.clear()
            self._cond.notify_all()
            return left

    def close(self) -> list[Entry[T]]:
        """Stop; returns what was still in flight."""
        with self._cond:
            self._closed = True
            left = list(self._entries.values())
            self._entries.clear()
            self._cond.notify_all()
            return left
