"""A seeded discrete-event simulator of DualPath loading (``tierkv sim dualpath``).

The model (docs/dualpath.md):

- ``prefill`` prefill engines and ``decode`` decode engines, each with a storage NIC of
  ``storage_nic_bytes_s`` (reads of cached KV from the shared storage), the storage itself
  serving at most ``storage_bytes_s`` in all; NICs share it max-min fairly. Each prefill
  engine receives over a compute link of ``compute_link_bytes_s``.
- A closed loop of ``sessions`` agent sessions: each turn's prompt is the last one plus
  ``turn_tokens`` (a tool result, a user message); ``hit_rate`` of the previous prompt's
  pages are cached and loaded, the rest prefilled at ``prefill_s_per_token`` on the
  prefill engine (one request at a time, in the order their loads end), then
  ``output_tokens`` decoded at ``decode_s_per_token`` on a decode engine (batched: not
  contended), then a think time (exponential, mean ``think_s``) before the next turn; a
  session of ``turns`` turns is followed by a fresh one. The sessions start at random
  ages (as if running for a while, their caches warm), so the measurement sees a steady
  state rather than a wave of first turns.
- Loads are chosen by :func:`tierkv.dualpath.scheduler.choose_reads` from the queues
  the simulator holds (each NIC's bytes left, each compute link's backlog): ``pe-only``,
  ``shorter-queue`` (the paper's) or ``split`` (ours). A decode engine's part crosses the
  compute link as it is read, in ``chunks`` pieces (the link carries it while the NIC
  reads; it ends one piece after the read at best).

Measured over ``duration_s`` after ``warmup_s``: turns completed per second, prompt tokens
served per second (the throughput compared across policies), time to first token (load + queueing + prefill), the storage NICs' utilization
per side, and the share of bytes each side read. Every policy runs the same sessions
(same seed, same think times and prompt sizes).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tierkv.dualpath.scheduler import POLICIES, Read, Side, choose_reads
from tierkv.errors import InputError

#: Events at one simulated instant after which a run is taken as stuck (InputError).
STUCK_EVENTS = 1_000_000


@dataclass(frozen=True)
class DualPathConfig:
    prefill: int = 1
    decode: int = 1
    storage_nic_bytes_s: float = 50e9 / 8          # 50 Gbit/s per engine
    compute_link_bytes_s: float = 400e9 / 8        # 400 Gbit/s
    storage_bytes_s: float = 1e12                   # the storage cluster in all
    kv_bytes_per_token: int = 70 * 1024             # about DeepSeek-V3's (MLA, 61 layers, bf16)
    page_tokens: int = 64
    prefill_s_per_token: float = 20e-6              # on the prefill engine, for the new tokens
    decode_s_per_token: float = 20e-3
    output_tokens: int = 64
    sessions: int = 64
    start_tokens: int = 16_000
    turn_tokens: int = 400
    turns: int = 50
    hit_rate: float = 0.98
    think_s: float = 0.5
    chunks: int = 32
    duration_s: float = 300.0
    warmup_s: float = 60.0
    seed: int = 0

    def check(self) -> DualPathConfig:
        ints = {"prefill": 1, "decode": 0, "kv_bytes_per_token": 1, "page_tokens": 1, "output_tokens": 0,
                "sessions": 1, "start_tokens": 0, "turn_tokens": 1, "turns": 1, "chunks": 1}
        for name, low in ints.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InputError(f"--{name.replace('_', '-')} must be a whole number >= {low}, got {v!r}")
        flags = {"storage_nic_bytes_s": "--storage-nic-gbps", "compute_link_bytes_s": "--compute-link-gbps",
                 "storage_bytes_s": "--storage-gbps", "duration_s": "--duration-s",
                 "prefill_s_per_token": "--prefill-us-per-token", "decode_s_per_token": "--decode-ms-per-token",
                 "think_s": "--think-s", "warmup_s": "--warmup-s"}
        for name, flag in flags.items():
            v = getattr(self, name)
            positive = name in ("storage_nic_bytes_s", "compute_link_bytes_s", "storage_bytes_s", "duration_s")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
                raise InputError(f"{flag} must be a {'positive number' if positive else 'number >= 0'}, got {v!r}")
        if isinstance(self.hit_rate, bool) or not isinstance(self.hit_rate, (int, float)) or not 0 <= self.hit_rate <= 1:
            raise InputError(f"--hit-rate must lie in [0, 1], got {self.hit_rate!r}")
        if self.sessions > 100_000 or self.prefill + self.decode > 1024:
            raise InputError("at most 100,000 sessions and 1,024 engines")
        if self.prefill_s_per_token == 0 and self.output_tokens * self.decode_s_per_token == 0 and self.think_s == 0:
            raise InputError("a turn would take no time (no prefill, decode or think time): the simulated clock "
                             "could not advance; give --prefill-us-per-token, --decode-ms-per-token or --think-s")
        return self

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.kv_bytes_per_token


class _Clock:
    """Events in time order (ties in the order they were scheduled)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn))

    def run(self, until: float) -> None:
        same = 0   # events without the clock moving: a model that cannot advance is an error, not a hang
        while self._heap and self._heap[0][0] <= until:
            t, _, fn = heapq.heappop(self._heap)
            same = same + 1 if t == self.now else 0
            if same > STUCK_EVENTS:
                raise InputError(f"the simulation stopped advancing at {t:.6g} s ({STUCK_EVENTS:,} events at one "
                                 "instant): give turns some time (think, decode or prefill) or shorter runs")
            self.now = t
            fn()
        self.now = until


class _Nics:
    """Storage NICs as a fluid model: each serves its reads one after another at its own
    rate, all of them together at most the storage's rate (max-min fair)."""

    def __init__(self, clock: _Clock, caps: list[float], total: float) -> None:
        self.clock, self.caps, self.total = clock, caps, total
        self.queues: list[deque[list[Any]]] = [deque() for _ in caps]   # [bytes left, on_done]
        self.rates = [0.0] * len(caps)
        self.read = [0.0] * len(caps)        # bytes read, all time
        self._t = 0.0
        self._version = 0

    def queued(self, i: int) -> float:
        """Bytes left to read on NIC ``i``, now."""
        self._advance()
        return sum(job[0] for job in self.queues[i])

    def add(self, i: int, nbytes: float, on_done: Callable[[], None]) -> None:
        self._advance()
        self.queues[i].append([float(nbytes), on_done])
        self._schedule()

    def _advance(self) -> None:
        dt = self.clock.now - self._t
        if dt > 0:
            for i, q in enumerate(self.queues):
                if q and self.rates[i]:
                    moved = min(q[0][0], self.rates[i] * dt)
                    q[0][0] -= moved
                    self.read[i] += moved
        self._t = self.clock.now

    def _schedule(self) -> None:
        active = sorted((i for i, q in enumerate(self.queues) if q), key=lambda i: self.caps[i])
        self.rates = [0.0] * len(self.caps)
        left = self.total
        for k, i in enumerate(active):
            self.rates[i] = min(self.caps[i], left / (len(active) - k))
            left -= self.rates[i]
        self._version += 1
        version = self._version
        soonest = min((self.queues[i][0][0] / self.rates[i] for i in active if self.rates[i] > 0), default=None)
        if soonest is not None:
            self.clock.at(self.clock.now + soonest, lambda: self._done(version))

    def _done(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        finished = []
        now = self.clock.now
        for i, q in enumerate(self.queues):   # done: under a byte, a nanosecond's worth, or a clock step
            while q and (q[0][0] <= max(1.0, self.rates[i] * 1e-9)
                         or (self.rates[i] > 0 and now + q[0][0] / self.rates[i] == now)):
                self.read[i] += q[0][0]
                finished.append(q.popleft()[1])
        self._schedule()
        for on_done in finished:
            on_done()


@dataclass
class _Stats:
    turns: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    bytes_by_side: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})


def simulate(cfg: DualPathConfig, policy: str) -> dict[str, Any]:
    """One policy's run; the result's fields are described in the module docstring."""
    cfg.check()
    if policy not in POLICIES:
        raise InputError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    clock = _Clock()
    n_eng = cfg.prefill + cfg.decode
    nics = _Nics(clock, [float(cfg.storage_nic_bytes_s)] * n_eng, float(cfg.storage_bytes_s))
    link_free = [0.0] * cfg.prefill        # each prefill engine's compute link, receiving
    compute_free = [0.0] * cfg.prefill
    in_flight = [0] * cfg.prefill
    rng = random.Random(cfg.seed)
    stats = _Stats()
    end = cfg.warmup_s + cfg.duration_s
    read_at_warmup: list[float] = []

    def measured() -> bool:
        return cfg.warmup_s <= clock.now < end

    def turn(session_rng: random.Random, k: int, prev_context: int, context: int) -> None:
        arrival = clock.now
        cached_tokens = int(cfg.hit_rate * prev_context) // cfg.page_tokens * cfg.page_tokens if k else 0
        pages = cached_tokens // cfg.page_tokens
        new_tokens = context - cached_tokens
        p = min(range(cfg.prefill), key=lambda i: (in_flight[i], i))
        in_flight[p] += 1
        prefill_side = Side(f"p{p}", nics.queued(p), cfg.storage_nic_bytes_s)
        backlog = max(0.0, link_free[p] - clock.now) * cfg.compute_link_bytes_s
        decode_sides = [Side(f"d{d}", nics.queued(cfg.prefill + d), cfg.storage_nic_bytes_s,
                             cfg.compute_link_bytes_s, forward_queued_bytes=backlog) for d in range(cfg.decode)]
        reads = choose_reads(policy, pages, cfg.page_bytes, prefill_side, decode_sides)
        waiting = [len(reads)]

        def loaded() -> None:
            waiting[0] -= 1
            if waiting[0]:
                return
            start = max(clock.now, compute_free[p])
            compute_free[p] = start + new_tokens * cfg.prefill_s_per_token
            clock.at(compute_free[p], prefilled)

        def prefilled() -> None:
            in_flight[p] -= 1
            if measured():
                stats.turns += 1
                stats.tokens += context
                stats.ttft.append(clock.now - arrival)
            think = session_rng.expovariate(1 / cfg.think_s) if cfg.think_s > 0 else 0.0
            after = clock.now + cfg.output_tokens * cfg.decode_s_per_token + think
            if k + 1 < cfg.turns:
                clock.at(after, lambda: turn(session_rng, k + 1, context, context + cfg.turn_tokens))
            else:
                clock.at(after, lambda: start_session(session_rng))

        if not reads:
            waiting[0] = 1
            loaded()
            return
        for r in reads:
            _issue(r, p, loaded)

    def _issue(r: Read, p: int, loaded: Callable[[], None]) -> None:
        nbytes = (r.stop - r.start) * cfg.page_bytes
        side = "prefill" if r.side.startswith("p") else "decode"
        if measured():
            stats.bytes_by_side[side] += nbytes
        if side == "prefill":
            nics.add(p, nbytes, loaded)
            return
        d = int(r.side[1:])
        begun = clock.now

        def read_done() -> None:
            # Forwarded as it is read, in chunks: the link is busy nbytes / rate in all, no
            # earlier than when the read began, and ends one chunk after the read at best.
            ship = nbytes / cfg.compute_link_bytes_s
            link_free[p] = max(link_free[p], begun) + ship
            clock.at(max(clock.now + ship / cfg.chunks, link_free[p]), loaded)

        nics.add(cfg.prefill + d, nbytes, read_done)

    def start_session(session_rng: random.Random, age: int = 0) -> None:
        """A session from its first turn, or (at the start, for a steady state from the
        first second) as if ``age`` turns were behind it, its cache warm."""
        context = max(cfg.turn_tokens, int(cfg.start_tokens * session_rng.uniform(0.5, 1.5))) + age * cfg.turn_tokens
        turn(session_rng, age, context - cfg.turn_tokens if age else 0, context)

    for s in range(cfg.sessions):   # each session with a generator of its own, at a random age
        srng = random.Random(rng.getrandbits(64))
        age = rng.randrange(cfg.turns)
        clock.at(rng.uniform(0, max(cfg.think_s, 1.0)), lambda srng=srng, age=age: start_session(srng, age))  # type: ignore[misc]

    clock.run(cfg.warmup_s)
    nics._advance()
    read_at_warmup = list(nics.read)
    clock.run(end)
    nics._advance()
    window = cfg.duration_s
    util = [(nics.read[i] - read_at_warmup[i]) / (cfg.storage_nic_bytes_s * window) for i in range(n_eng)]
    ttft = sorted(stats.ttft)
    total_bytes = sum(stats.bytes_by_side.values())
    return {
        "policy": policy,
        "turns_per_s": stats.turns / window,
        "tokens_per_s": stats.tokens / window,
        "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None,
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
        "nic_util_prefill": sum(util[:cfg.prefill]) / cfg.prefill,
        "nic_util_decode": sum(util[cfg.prefill:]) / cfg.decode if cfg.decode else None,
        "prefill_read_share": stats.bytes_by_side["prefill"] / total_bytes if total_bytes else None,
        "turns": stats.turns,
    }


def run_dualpath(cfg: DualPathConfig, policies: list[str] | None = None) -> dict[str, Any]:
    """Every policy (``pe-only`` always, as the baseline) over the same sessions; the
    config, each policy's result and ``throughput_vs_pe_only``."""
    cfg.check()
    chosen = list(dict.fromkeys(["pe-only", *(policies or POLICIES)]))
    results = {p: simulate(cfg, p) for p in chosen}
    # Throughput is prompt tokens served per second: a turn's bytes to load grow with its
    # session's context, and a faster policy moves its sessions on to bigger turns, so
    # turns per second would understate it.
    base = results["pe-only"]["tokens_per_s"]
    for r in results.values():
        r["throughput_vs_pe_only"] = r["tokens_per_s"] / base if base else None
    return {"config": asdict(cfg), "results": results}
