"""The synthetic serving mix of ``tierkv replay`` and ``tierkv sim``, and the CLI's choice
between it and a Mooncake trace (:func:`load_requests`).

Conversations sharing system prompts, Zipf-popular documents and agent sessions with
growing contexts, as :class:`tierkv.workload.trace.Request` in arrival order.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import numbers
import os
from dataclasses import dataclass

import numpy as np

from tierkv.errors import InputError
from tierkv.workload.trace import MOONCAKE_BLOCK_TOKENS, Request, read_mooncake


# --------------------------------------------------------------------------------------
# Synthetic mix

IntRange = tuple[int, int]

_COUNT = (1, 100_000)           # prompts, documents, agent kinds: one weight each, per draw
_TOKENS = (1, 1 << 20)          # one message or answer: at most a 1M-token context
_BLOCKS = (1, 4096)             # one shared prefix, allocated whole when first used
_SECONDS = (0.0, 1e6)           # a mean gap between turns: 11.6 days is no session

#: The inclusive range of every field of :class:`SyntheticMix`. The bounds keep every
#: value finite (a report is JSON, which has no NaN or Infinity), every session's
#: requests and block ids in memory, and every draw cheap; past them a number is a typo,
#: not a workload.
MIX_LIMITS: dict[str, tuple[float, float]] = {
    "block_tokens": (2, 65536),
    "session_rate_per_s": (1e-6, 1e6),
    "conversation_share": (0.0, 1.0),
    "rag_share": (0.0, 1.0),
    "agent_share": (0.0, 1.0),
    "system_prompts": _COUNT,
    "system_prompt_blocks": _BLOCKS,
    "conversation_turns_mean": (1.0, 1000.0),
    "user_message_tokens": _TOKENS,
    "answer_tokens": _TOKENS,
    "think_time_s_mean": _SECONDS,
    "documents": _COUNT,
    "document_zipf_s": (0.0, 10.0),
    "document_blocks": _BLOCKS,
    "question_tokens": _TOKENS,
    "agent_kinds": _COUNT,
    "agent_prompt_blocks": _BLOCKS,
    "agent_turns": (1, 1000),
    "tool_output_tokens": _TOKENS,
    "agent_step_s_mean": _SECONDS,
    "max_context_tokens": _TOKENS,
}
#: At most this many blocks in one prompt (``max_context_tokens / block_tokens``).
MAX_PROMPT_BLOCKS = 4096
#: At most this many requests from :func:`synthetic`.
MAX_REQUESTS = 1_000_000
#: :func:`synthetic` gives up after this many sessions in a row without a request (every
#: prompt they drew was longer than ``max_context_tokens``).
MAX_EMPTY_SESSIONS = 1000


@dataclass(frozen=True)
class SyntheticMix:
    """Parameters of :func:`synthetic`. Ranges are inclusive ``(low, high)``.

    Sessions start as a Poisson process of ``session_rate_per_s``. Each is one of:

    * a **conversation** (``conversation_share``): one of ``system_prompts`` shared
      system prompts (whole blocks; prompt ``k`` is picked with weight ``1/(k+1)``),
      then ``turns`` ~ geometric with mean ``conversation_turns_mean``; turn ``n``'s
      prompt is turn ``n-1``'s prompt + its answer + a new user message, sent after an
      exponential think time of mean ``think_time_s_mean``;
    * a **RAG** query (``rag_share``): system prompt 0, then one of ``documents``
      documents (whole blocks, shared by every query of it) drawn with Zipf exponent
      ``document_zipf_s``, then a unique question; one request;
    * an **agent** session (``agent_share``): one of ``agent_kinds`` long tool-spec
      prompts, a task, then ``agent_turns`` steps ``agent_step_s_mean`` apart, each
      appending the model's action (``answer_tokens``) and a tool output.

    Shares are of *requests*, approximately: a kind's session probability is its share
    divided by its mean requests per session. Message lengths are log-uniform over their
    ranges. A session stops early before a prompt would exceed ``max_context_tokens``.

    Every field must lie in its range in :data:`MIX_LIMITS` (finite numbers only; ints
    for counts, ranges and ``max_context_tokens``), ``max_context_tokens`` must hold at
    most :data:`MAX_PROMPT_BLOCKS` blocks, and the shortest prompt of every kind with a
    positive share must fit in it; otherwise :class:`InputError` names the field, the
    value and the range.
    """

    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    session_rate_per_s: float = 1.0
    conversation_share: float = 0.5
    rag_share: float = 0.3
    agent_share: float = 0.2
    system_prompts: int = 4
    system_prompt_blocks: IntRange = (1, 4)
    conversation_turns_mean: float = 4.0
    user_message_tokens: IntRange = (30, 1500)
    answer_tokens: IntRange = (50, 800)
    think_time_s_mean: float = 30.0
    documents: int = 400
    document_zipf_s: float = 1.1
    document_blocks: IntRange = (2, 24)
    question_tokens: IntRange = (20, 300)
    agent_kinds: int = 3
    agent_prompt_blocks: IntRange = (4, 12)
    agent_turns: IntRange = (8, 40)
    tool_output_tokens: IntRange = (200, 4000)
    agent_step_s_mean: float = 4.0
    max_context_tokens: int = 65536

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _checked(f.name, str(f.type), getattr(self, f.name)))
        shares = (self.conversation_share, self.rag_share, self.agent_share)
        if sum(shares) <= 0:
            raise InputError(f"SyntheticMix shares must have a positive sum, got {shares}")
        if self.max_context_tokens > MAX_PROMPT_BLOCKS * self.block_tokens:
            raise InputError(f"SyntheticMix.max_context_tokens must be at most {MAX_PROMPT_BLOCKS} blocks of "
                             f"{self.block_tokens} tokens ({MAX_PROMPT_BLOCKS * self.block_tokens}), "
                             f"got {self.max_context_tokens}")
        bt = self.block_tokens
        shortest = {  # the fewest tokens a kind's first prompt can have
            "conversation": ("system_prompt_blocks", "user_message_tokens",
                             self.system_prompt_blocks[0] * bt + self.user_message_tokens[0]),
            "rag": ("system_prompt_blocks, document_blocks", "question_tokens",
                    (self.system_prompt_blocks[0] + self.document_blocks[0]) * bt + self.question_tokens[0]),
            "agent": ("agent_prompt_blocks", "user_message_tokens",
                      self.agent_prompt_blocks[0] * bt + self.user_message_tokens[0]),
        }
        for (kind, (blocks, tokens, least)), share in zip(shortest.items(), shares):
            if share > 0 and least > self.max_context_tokens:
                raise InputError(f"SyntheticMix: the shortest {kind} prompt ({blocks} and {tokens} at their "
                                 f"lows) is {least} tokens, more than max_context_tokens={self.max_context_tokens}; "
                                 f"raise it or set {kind}_share=0")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _checked(name: str, kind: str, value: object) -> object:
    """``value`` of field ``name`` (annotated ``kind``) normalised, or InputError naming its range."""
    lo, hi = MIX_LIMITS[name]
    where = f"SyntheticMix.{name}"
    if "IntRange" in kind:
        low, high = (_integer(v) for v in value) if isinstance(value, (tuple, list)) and len(value) == 2 \
            else (None, None)
        if low is None or high is None or not lo <= low <= high <= hi:
            raise InputError(f"{where} must be a range (low, high) of integers with {_num(lo)} <= low <= high <= "
                             f"{_num(hi)}, got {value!r}")
        return (low, high)
    if "float" in kind:
        x = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
        if not (math.isfinite(x) and lo <= x <= hi):
            raise InputError(f"{where} must be a finite number in [{_num(lo)}, {_num(hi)}], got {value!r}")
        return x
    n = _integer(value)
    if n is None or not lo <= n <= hi:
        raise InputError(f"{where} must be an integer in [{_num(lo)}, {_num(hi)}], got {value!r}")
    return n


def _integer(value: object) -> int | None:
    """``value`` as an int if it is an integer (numpy's included), never a bool; else None."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None


class _Builder:
    """Allocates block ids and builds the requests of one session at a time."""

    def __init__(self, mix: SyntheticMix, rng: np.random.Generator) -> None:
        self.mix = mix
        self.rng = rng
        self._next_id = 0
        self._shared: dict[tuple[str, int], tuple[int, ...]] = {}
        ranks = np.arange(1, mix.documents + 1, dtype=np.float64)
        weights = ranks ** -mix.document_zipf_s
        self._doc_p = weights / weights.sum()
        prompt_weights = 1.0 / np.arange(1, mix.system_prompts + 1)  # once, not once per conversation
        self.system_prompt_p = prompt_weights / prompt_weights.sum()

    def new_ids(self, n: int) -> list[int]:
        first = self._next_id
        self._next_id += n
        return list(range(first, first + n))

    def draw(self, bounds: IntRange) -> int:
        """Log-uniform integer in ``[low, high]``."""
        lo, hi = bounds
        return min(hi, int(math.exp(self.rng.uniform(math.log(lo), math.log(hi + 1)))))

    def shared(self, kind: str, index: int, blocks: IntRange, parent: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The block ids of a shared prefix, allocated the first time it is used."""
        key = (kind, index)
        if key not in self._shared:
            self._shared[key] = parent + tuple(self.new_ids(int(self.rng.integers(blocks[0], blocks[1] + 1))))
        return self._shared[key]

    def system_prompt(self, index: int) -> tuple[int, ...]:
        return self.shared("system", index, self.mix.system_prompt_blocks)

    def document(self) -> tuple[int, ...]:
        index = int(self.rng.choice(self.mix.documents, p=self._doc_p))
        return self.shared("document", index, self.mix.document_blocks, parent=self.system_prompt(0))


class _Context:
    """A growing prompt: full-block ids plus the token count of its partial tail."""

    def __init__(self, builder: _Builder, prefix: tuple[int, ...]) -> None:
        self._b = builder
        self.full = list(prefix)
        self.tail = 0

    @property
    def tokens(self) -> int:
        return len(self.full) * self._b.mix.block_tokens + self.tail

    def extend(self, n_tokens: int) -> None:
        total = self.tail + n_tokens
        self.full.extend(self._b.new_ids(total // self._b.mix.block_tokens))
        self.tail = total % self._b.mix.block_tokens

    def request(self, arrival_s: float, output_tokens: int) -> Request:
        # A partial tail is request-specific content: it always gets a fresh id.
        tail = self._b.new_ids(1) if self.tail else []
        return Request(arrival_s, tuple(self.full + tail), self.tokens, output_tokens)


def _conversation(b: _Builder, start_s: float) -> list[Request]:
    m = b.mix
    ctx = _Context(b, b.system_prompt(int(b.rng.choice(m.system_prompts, p=b.system_prompt_p))))
    turns = int(b.rng.geometric(1.0 / m.conversation_turns_mean))
    out: list[Request] = []
    t = start_s
    for _ in range(turns):
        ctx.extend(b.draw(m.user_message_tokens))
        if ctx.tokens > m.max_context_tokens:
            break
        answer = b.draw(m.answer_tokens)
        out.append(ctx.request(t, answer))
        ctx.extend(answer)
        t += float(b.rng.exponential(m.think_time_s_mean))
    return out


def _rag(b: _Builder, start_s: float) -> list[Request]:
    ctx = _Context(b, b.document())
    ctx.extend(b.draw(b.mix.question_tokens))
    if ctx.tokens > b.mix.max_context_tokens:
        return []
    return [ctx.request(start_s, b.draw(b.mix.answer_tokens))]


def _agent(b: _Builder, start_s: float) -> list[Request]:
    m = b.mix
    ctx = _Context(b, b.shared("agent", int(b.rng.integers(m.agent_kinds)), m.agent_prompt_blocks))
    ctx.extend(b.draw(m.user_message_tokens))
    out: list[Request] = []
    t = start_s
    for _ in range(int(b.rng.integers(m.agent_turns[0], m.agent_turns[1] + 1))):
        if ctx.tokens > m.max_context_tokens:
            break
        action = b.draw(m.answer_tokens)
        out.append(ctx.request(t, action))
        ctx.extend(action + b.draw(m.tool_output_tokens))
        t += float(b.rng.exponential(m.agent_step_s_mean))
    return out


def synthetic(seed: int, n_requests: int, mix: SyntheticMix = SyntheticMix()) -> list[Request]:
    """``n_requests`` requests of the :class:`SyntheticMix` ``mix``, sorted by arrival.

    Deterministic for a ``(seed, mix)`` pair. Block ids are prefix-chained: every new
    block gets a fresh id, shared prefixes (system prompts, documents, agent prompts,
    earlier turns of a session) reuse theirs. The result is the first ``n_requests``
    arrivals of a run long enough that no session starting later could arrive earlier.
    ``n_requests`` is at most :data:`MAX_REQUESTS`; a mix whose sessions almost never fit
    a prompt in ``max_context_tokens`` raises :class:`InputError` after
    :data:`MAX_EMPTY_SESSIONS` empty sessions in a row instead of running forever.
    """
    if isinstance(n_requests, bool) or not isinstance(n_requests, int) or not 0 <= n_requests <= MAX_REQUESTS:
        raise InputError(f"the synthetic mix makes 0 to {MAX_REQUESTS} requests, asked for {n_requests!r}")
    if _integer(seed) is None or seed < 0:
        raise InputError(f"the seed of the synthetic mix must be an integer >= 0, got {seed!r}")
    rng = np.random.default_rng(seed)
    b = _Builder(mix, rng)
    kinds = (_conversation, _rag, _agent)
    per_session = (mix.conversation_turns_mean, 1.0, sum(mix.agent_turns) / 2)
    p = np.array([s / n for s, n in zip((mix.conversation_share, mix.rag_share, mix.agent_share), per_session)])
    p /= p.sum()
    rows: list[tuple[float, int, int, Request]] = []
    # The n_requests earliest arrivals so far, negated (a max-heap): once it is full, a
    # session starting after its top can add nothing to the result. Kept current as
    # requests come, not computed once: a stale cutoff kept a fast mix (1e6 sessions/s)
    # drawing sessions for as long as its first ones' later turns took to arrive.
    earliest: list[float] = []
    t = 0.0
    session = empty = 0
    while n_requests:
        t += float(rng.exponential(1.0 / mix.session_rate_per_s))
        if len(earliest) == n_requests and t > -earliest[0]:
            break
        reqs = kinds[int(rng.choice(3, p=p))](b, t)
        rows.extend((r.arrival_s, session, i, r) for i, r in enumerate(reqs))
        for r in reqs:
            if len(earliest) < n_requests:
                heapq.heappush(earliest, -r.arrival_s)
            elif r.arrival_s < -earliest[0]:
                heapq.heapreplace(earliest, -r.arrival_s)
        session += 1
        empty = 0 if reqs else empty + 1
        if empty >= MAX_EMPTY_SESSIONS:
            raise InputError(f"the synthetic mix made {empty} sessions in a row without a request: almost every "
                             f"prompt it draws is longer than max_context_tokens={mix.max_context_tokens}; lower "
                             "its block and token ranges or raise max_context_tokens")
    rows.sort(key=lambda row: row[:3])
    return [row[3] for row in rows[:n_requests]]


def parse_mix(spec: str) -> SyntheticMix:
    """A :class:`SyntheticMix` from ``"field=value,field=value"``; ranges as ``low-high``.

    For example ``"conversation_share=1,rag_share=0,agent_share=0,think_time_s_mean=300"``
    or ``"system_prompt_blocks=4-16"``. Fields not named keep their defaults. A value
    outside its range (:data:`MIX_LIMITS`) raises :class:`InputError` naming the field,
    the value and the range.
    """
    # The block size is the trace convention every consumer assumes, not a workload knob.
    fields = {f.name: f for f in dataclasses.fields(SyntheticMix) if f.name != "block_tokens"}
    values: dict[str, object] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, sep, raw = (x.strip() for x in item.partition("="))
        if not sep or name not in fields:
            raise InputError(f"--mix: expected field=value with a field of {', '.join(fields)}; got {item!r}")
        if name in values:
            raise InputError(f"--mix: {name} given twice")
        kind = str(fields[name].type)
        try:
            if "IntRange" in kind:
                lo, dash, hi = raw.partition("-")
                if not dash:
                    raise ValueError
                values[name] = (int(lo), int(hi))
            elif "float" in kind:
                values[name] = number = float(raw)
                if not math.isfinite(number):  # "1e400" is inf: say what was typed, not what it became
                    low, high = MIX_LIMITS[name]
                    raise InputError(f"--mix: {name}={raw} is not a finite number; {name} must be in "
                                     f"[{_num(low)}, {_num(high)}]")
            else:
                values[name] = int(raw)
        except ValueError:
            want = "a range low-high of integers" if "IntRange" in kind else \
                "a number" if "float" in kind else "an integer"
            raise InputError(f"--mix: {name} takes {want}, got {raw!r}") from None
    try:
        return SyntheticMix(**values)  # type: ignore[arg-type]
    except InputError as exc:
        raise InputError(f"--mix: {exc}") from None


def load_requests(trace: str | os.PathLike[str] | None, limit: int | None, synthetic_requests: int,
                  seed: int | None, mix: SyntheticMix | None = None) -> tuple[list[Request], dict[str, object]]:
    """The requests a CLI command runs: the Mooncake ``trace`` if given, else
    ``synthetic_requests`` of the synthetic ``mix`` (default: the built-in one) for
    ``seed`` (default 0); at most ``limit`` either way. Returns them with a JSON-ready
    description of their source (the mix's fields that differ from the defaults, if any).
    A seed or a mix given with a trace is an error: a trace runs as recorded."""
    if trace is not None:
        if mix is not None:
            raise InputError("--mix describes the synthetic mix; it cannot be used with --trace")
        if seed is not None:
            raise InputError("--seed seeds the synthetic mix; a trace runs as recorded, so it cannot be "
                             "used with --trace")
        return list(read_mooncake(trace, limit)), {"source": "mooncake", "trace": str(trace)}
    n = synthetic_requests if limit is None else min(synthetic_requests, limit)
    mix = mix or SyntheticMix()
    seed = 0 if seed is None else seed
    if seed < 0:
        raise InputError(f"--seed must be >= 0, got {seed}")
    source: dict[str, object] = {"source": "synthetic", "seed": seed}
    changed = {f.name: getattr(mix, f.name) for f in dataclasses.fields(SyntheticMix)
               if getattr(mix, f.name) != f.default}
    if changed:
        source["mix"] = changed
    return synthetic(seed, n, mix), source
