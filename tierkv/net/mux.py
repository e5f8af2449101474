"""Many logical channels over a few connections (QPs) per peer.

A serving engine has many concurrent streams (one per request, per layer group) but a
peer should see only a few connections: each costs a QP, its receive buffers and its
credits. A :class:`Mux` maps channel ``c`` to connection ``c % n`` (so one channel's
messages stay in order on one connection) and tags every message with its channel, so
replies and statistics come back per channel. Thread-safe; used by the transports.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tierkv.errors import InputError

L = TypeVar("L")
MAX_CHANNELS = 0xFFFF


@dataclass(frozen=True)
class ChannelStats:
    channel: int
    link: int
    requests: int
    failures: int


class Mux(Generic[L]):
    def __init__(self, links: Sequence[L]) -> None:
        if not links:
            raise InputError("a mux needs at least one connection")
        self.links = list(links)
        self._lock = threading.Lock()
        self._requests: dict[int, int] = {}
        self._failures: dict[int, int] = {}

    def link_index(self, channel: int) -> int:
        if not 0 <= channel <= MAX_CHANNELS:
            raise InputError(f"channel {channel} out of range [0, {MAX_CHANNELS}]")
        return channel % len(self.links)

    def route(self, channel: int) -> L:
        """The connection that carries ``channel``; counts the request."""
        i = self.link_index(channel)
        with self._lock:
            self._requests[channel] = self._requests.get(channel, 0) + 1
        return self.links[i]

    def failed(self, channel: int) -> None:
        with self._lock:
            self._failures[channel] = self._failures.get(channel, 0) + 1

    def stats(self) -> list[ChannelStats]:
        with self._lock:
            return [ChannelStats(c, self.link_index(c), n, self._failures.get(c, 0))
                    for c, n in sorted(self._requests.items())]
