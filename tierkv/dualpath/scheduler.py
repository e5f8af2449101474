"""Which side reads a request's cached pages: the prefill engine's storage NIC, a decode
engine's (then forwarded over the compute network), or both.

A :class:`Side` is what a node reports: the bytes queued on its storage NIC, that NIC's
read rate, what asking it costs whatever the size (its latency), and (for a decode node)
the rate at which it can forward to the prefill node over the compute network and what
that link already carries. :func:`choose_reads` answers with :class:`Read` s (a side and a
range of the request's pages) by policy:

- ``pe-only``: the prefill side reads everything (today's systems);
- ``shorter-queue``: the whole request on whichever side would finish it first, counting
  what is queued there (the DualPath paper's choice, per request);
- ``split``: the request's pages divided between the prefill side and the best decode
  side so that both finish at once (a decode side's part also crosses the compute link),
  in whole pages.

A side that does not hold the request's pages (``holds`` false: it cannot reach the
storage that has them) is never chosen. The simulator (:mod:`tierkv.dualpath.sim`) calls
this with the queues it models; a cluster calls it with what its nodes report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tierkv.errors import InputError

Policy = Literal["pe-only", "shorter-queue", "split"]
POLICIES: tuple[Policy, ...] = ("pe-only", "shorter-queue", "split")


@dataclass(frozen=True)
class Side:
    """A node that could read: ``name``, bytes queued on its storage NIC, that NIC's rate
    (bytes/s), its compute link's rate to the prefill node (bytes/s; ``inf`` for the
    prefill node itself), and whether it reaches the request's pages."""

    name: str
    queued_bytes: float
    read_bytes_s: float
    forward_bytes_s: float = float("inf")
    holds: bool = True
    forward_queued_bytes: float = 0.0
    latency_s: float = 0.0

    def finish_s(self, nbytes: float) -> float:
        """When it would have read (and forwarded) ``nbytes`` more, from now: a decode
        side forwards as it reads, so its part ends when the slower of its read and its
        link (with what the link already carries) is done; ``latency_s`` is what asking
        it costs whatever the size (a round trip, a helper's own work)."""
        read = (self.queued_bytes + nbytes) / self.read_bytes_s
        if self.forward_bytes_s != float("inf"):
            read = max(read, (self.forward_queued_bytes + nbytes) / self.forward_bytes_s)
        return self.latency_s + read


@dataclass(frozen=True)
class Read:
    """Pages ``[start, stop)`` of the request, read by ``side``."""

    side: str
    start: int
    stop: int


def choose_reads(policy: str, pages: int, page_bytes: int, prefill: Side, decode: list[Side]) -> list[Read]:
    """The reads of a request's ``pages`` cached pages of ``page_bytes`` each, by ``policy``,
    given the prefill side and the decode sides that could read for it. InputError for an
    unknown policy, or when no side holds the pages."""
    if policy not in POLICIES:
        raise InputError(f"unknown DualPath policy {policy!r}; expected one of {', '.join(POLICIES)}")
    if pages <= 0:
        return []
    for side in (prefill, *decode):
        if side.read_bytes_s <= 0 or side.forward_bytes_s <= 0:
            raise InputError(f"side {side.name!r} reports a rate of 0 or less")
        if not side.latency_s >= 0:
            raise InputError(f"side {side.name!r} reports a latency below 0 (or not a number)")
    nbytes = pages * page_bytes
    helpers = [d for d in decode if d.holds]
    if policy == "pe-only" or not helpers:
        if not prefill.holds:
            raise InputError("the prefill node does not hold the request's pages, and pe-only reads nowhere else"
                             if helpers else
                             "no side holds the request's pages: neither the prefill node nor a decode node")
        return [Read(prefill.name, 0, pages)]
    best = min(helpers, key=lambda d: (d.finish_s(nbytes), d.name))
    if not prefill.holds:
        return [Read(best.name, 0, pages)]
    if policy == "shorter-queue":
        side = prefill if prefill.finish_s(nbytes) <= best.finish_s(nbytes) else best
        return [Read(side.name, 0, pages)]
    # split: x pages on the prefill side, the rest on the decode side, finishing together.
    # Linear in the bytes on each side, so the balance point is solved directly, then the
    # whole-page choices either side of it compared.
    lo, hi = 0, pages
    while hi - lo > 1:   # the largest x whose prefill part finishes no later than the decode part
        mid = (lo + hi) // 2
        if prefill.finish_s(mid * page_bytes) <= best.finish_s((pages - mid) * page_bytes):
            lo = mid
        else:
            hi = mid
    candidates = {0, lo, hi, pages}

    def worst(x: int) -> float:
        return max(prefill.finish_s(x * page_bytes) if x else 0.0,
                   best.finish_s((pages - x) * page_bytes) if x < pages else 0.0)

    x = min(candidates, key=lambda c: (worst(c), -c))
    out = []
    if x:
        out.append(Read(prefill.name, 0, x))
    if x < pages:
        out.append(Read(best.name, x, pages))
    return out
