"""Workloads for ``tierkv plan``: a Mooncake trace, the built-in synthetic mix, or a few parameters.

:class:`ParamWorkload` turns the numbers an operator knows (request rate, prompt length
range, turns per conversation, share of prompts reused across conversations) into
prefix-chained requests in the Mooncake convention of :mod:`tierkv.workload`, so the
rest of the planner sees one kind of input. Called by :mod:`tierkv.cli.plan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tierkv.errors import InputError
from tierkv.workload.trace import MOONCAKE_BLOCK_TOKENS, Request


@dataclass(frozen=True)
class ParamWorkload:
    """Conversations described by parameters.

    Conversations start as a Poisson process at ``request_rate_per_s / turns_mean`` so
    requests arrive at about ``request_rate_per_s``. A conversation's first prompt has a
    log-uniform length in ``context_tokens``; its leading ``reuse`` share is a prefix
    shared with other conversations (the first blocks of one of ``shared_prefixes``
    documents or system prompts, chosen uniformly), the rest is its own. It then has a
    geometric number of turns of mean ``turns_mean``; each turn appends a log-uniform
    ``turn_tokens`` (the answer plus the next message) after an exponential think time
    of mean ``think_time_s``. Turns stop before a prompt would exceed ``max_context_tokens``.
    """

    requests: int = 3000
    request_rate_per_s: float = 1.0
    context_tokens: tuple[int, int] = (1024, 16384)
    turns_mean: float = 3.0
    reuse: float = 0.5
    shared_prefixes: int = 16
    turn_tokens: tuple[int, int] = (100, 1500)
    think_time_s: float = 60.0
    max_context_tokens: int = 131072
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise InputError(f"--requests must be >= 1, got {self.requests}")
        if not 0 < self.request_rate_per_s < math.inf:
            raise InputError(f"--request-rate must be a finite number > 0, got {self.request_rate_per_s}")
        for name in ("context_tokens", "turn_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise InputError(f"{name} must be LOW:HIGH with 1 <= LOW <= HIGH, got {lo}:{hi}")
        if not 1 <= self.turns_mean < math.inf:  # inf would make the geometric draw's p zero
            raise InputError(f"--turns must be a finite number >= 1 (mean turns per conversation), "
                             f"got {self.turns_mean}")
        if not 0 <= self.reuse <= 1:
            raise InputError(f"--reuse must be in [0, 1], got {self.reuse}")
        if self.shared_prefixes < 1 or not 0 <= self.think_time_s < math.inf or self.block_tokens < 1:
            raise InputError("shared_prefixes and block_tokens must be >= 1 and think_time_s >= 0, got "
                             f"{self.shared_prefixes}, {self.block_tokens}, {self.think_time_s}")


def _log_uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    lo, hi = bounds
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        first = self.next
        self.next += n
        return list(range(first, first + n))


def param_workload(spec: ParamWorkload, seed: int = 0) -> list[Request]:
    """The first ``spec.requests`` arrivals of ``spec``, sorted by arrival; deterministic per seed."""
    rng = np.random.default_rng(seed)
    bt = spec.block_tokens
    ids = _Ids()
    longest = -(-spec.max_context_tokens // bt)
    prefixes = [ids.take(longest) for _ in range(spec.shared_prefixes)] if spec.reuse > 0 else []
    rows: list[Request] = []
    t, cutoff = 0.0, math.inf
    while True:
        t += float(rng.exponential(spec.turns_mean / spec.request_rate_per_s))
        if len(rows) >= spec.requests:
            # The n-th arrival only moves earlier as conversations are added, so once a start
            # is past it no later conversation can make the cut (as in workload.synthetic).
            if cutoff == math.inf:
                cutoff = float(np.partition([r.arrival_s for r in rows], spec.requests - 1)[spec.requests - 1])
            if t > cutoff:
                break
        rows.extend(_conversation(spec, rng, ids, prefixes, t))
    rows.sort(key=lambda r: r.arrival_s)
    return rows[:spec.requests]


def _conversation(spec: ParamWorkload, rng: np.random.Generator, ids: _Ids, prefixes: list[list[int]],
                  start_s: float) -> list[Request]:
    bt = spec.block_tokens
    first = min(_log_uniform(rng, spec.context_tokens), spec.max_context_tokens)
    shared_blocks = int(spec.reuse * first) // bt if prefixes else 0
    full = list(prefixes[int(rng.integers(len(prefixes)))][:shared_blocks]) if shared_blocks else []
    tokens, tail = len(full) * bt, 0
    out: list[Request] = []
    grow, when = first - tokens, start_s
    for _ in range(int(rng.geometric(1.0 / spec.turns_mean))):
        if tokens + tail + grow > spec.max_context_tokens:
            break
        total = tail + grow
        full.extend(ids.take(total // bt))
        tail = total % bt
        tokens = len(full) * bt
        tail_id = ids.take(1) if tail else []  # a partial block is this request's own
        out.append(Request(when, tuple(full + tail_id), tokens + tail, int(_log_uniform(rng, (50, 800)))))
        grow = _log_uniform(rng, spec.turn_tokens)
        when += float(rng.exponential(spec.think_time_s)) if spec.think_time_s else 0.0
    return out
