"""Serving workloads for ``tierkv replay``: the Mooncake trace reader and a synthetic mix.

A workload is a sequence of :class:`Request` in arrival order. A request names its
prompt as *prefix-chained block ids*: one id per ``block_tokens``-token block, where
an equal id at position ``i`` of two requests means their prompts are identical up to
the end of block ``i`` (the Mooncake trace convention). :func:`block_tokens` turns an
id into the tokens it stands for, so that the store's own chained page keys agree with
the ids: shared ids give shared pages. Called by :mod:`tierkv.replay` and the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierkv.errors import InputError

#: Tokens per block in the Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512

_U64 = np.uint64
_MAX_BLOCK_ID = (1 << 64) - 1


@dataclass(frozen=True)
class Request:
    """One prompt of a workload.

    ``blocks`` covers the whole prompt: ``ceil(input_tokens / block_tokens)`` ids, the
    last one standing for a partial block when ``input_tokens`` is not a multiple of
    the block size. ``arrival_s`` is seconds from the start of the workload.
    """

    arrival_s: float
    blocks: tuple[int, ...]
    input_tokens: int
    output_tokens: int
    tenant: str = ""

    def full_blocks(self, block_tokens: int) -> int:
        """How many leading blocks hold ``block_tokens`` tokens (only those get pages)."""
        return min(self.input_tokens // block_tokens, len(self.blocks))


# --------------------------------------------------------------------------------------
# Mooncake trace


def read_mooncake(path: str | os.PathLike[str], limit: int | None = None, *,
                  block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Iterator[Request]:
    """Requests of a Mooncake JSONL trace, in file order, at most ``limit`` of them.

    Each non-blank line is an object with ``timestamp`` (ms, int or float >= 0),
    ``input_length`` and ``output_length`` (ints >= 0) and ``hash_ids`` (list of
    ints >= 0) holding exactly ``ceil(input_length / block_tokens)`` ids; other keys
    are ignored. Timestamps must be non-decreasing (the replay runs in file order and
    that must be arrival order). Any violation raises :class:`InputError` naming the
    line number; a missing file raises it at call time, before iteration.
    """
    p = Path(path)
    if not p.is_file():
        raise InputError(f"trace file {str(p)!r} does not exist or is not a file")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InputError(f"limit must be a non-negative integer or None, got {limit!r}")
    if block_tokens <= 0:
        raise InputError(f"block_tokens must be positive, got {block_tokens}")
    return _iter_mooncake(p, limit, block_tokens)


def _iter_mooncake(path: Path, limit: int | None, block_tokens: int) -> Iterator[Request]:
    count = 0
    last_ms = -math.inf
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if limit is not None and count >= limit:
                return
            if not raw.strip():
                continue
            req = _parse_line(raw, lineno, path, block_tokens)
            if req.arrival_s * 1000.0 < last_ms:
                raise InputError(f"{path}:{lineno}: timestamp {req.arrival_s * 1000.0:g} ms is earlier "
                                 f"than the previous line's {last_ms:g} ms; timestamps must not decrease")
            last_ms = req.arrival_s * 1000.0
            count += 1
            yield req


def _parse_line(raw: bytes, lineno: int, path: Path, block_tokens: int) -> Request:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        raise InputError(f"{where}: missing field(s) {', '.join(missing)}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not ts >= 0 or math.isinf(ts):
        raise InputError(f"{where}: timestamp must be a finite number >= 0 (ms), got {ts!r}")
    lengths = []
    for key in ("input_length", "output_length"):
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"{where}: {key} must be an integer >= 0, got {value!r}")
        lengths.append(value)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= _MAX_BLOCK_ID for b in ids):
        raise InputError(f"{where}: hash_ids must be a list of integers in [0, 2**64), got {str(ids)[:80]}")
    want = -(-lengths[0] // block_tokens)
    if len(ids) != want:
        raise InputError(f"{where}: input_length {lengths[0]} needs {want} blocks of {block_tokens} tokens, "
                         f"hash_ids has {len(ids)}")
    return Request(arrival_s=ts / 1000.0, blocks=tuple(ids), input_tokens=lengths[0], output_tokens=lengths[1])


# --------------------------------------------------------------------------------------
# Tokens of a block


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wraps modulo 2**64)."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def _tokens_of(ids: np.ndarray, block_tokens: int) -> np.ndarray:
    """Rows of tokens for a uint64 id vector: shape ``(len(ids), block_tokens)``."""
    if block_tokens < 2:
        raise InputError(f"block_tokens must be at least 2 (the id spans two tokens), got {block_tokens}")
    pos = np.arange(block_tokens, dtype=_U64)
    with np.errstate(over="ignore"):
        mixed = _mix64(ids[:, None] * _U64(0x9E3779B97F4A7C15) + pos[None, :])
    out = (mixed & _U64(0xFFFFFFFF)).astype("<u4")
    # The id itself in the first two tokens makes blocks of distinct ids distinct.
    out[:, 0] = (ids & _U64(0xFFFFFFFF)).astype("<u4")
    out[:, 1] = (ids >> _U64(32)).astype("<u4")
    return out


def block_tokens(block_id: int, block_tokens: int) -> np.ndarray:
    """The ``block_tokens`` uint32 token ids block ``block_id`` stands for.

    Deterministic (same on every run and machine) and distinct for distinct ids in
    ``[0, 2**64)``: the first two tokens are the id's low and high 32 bits, the rest a
    hash of (id, position). Raises InputError for an id out of range.
    """
    if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id <= _MAX_BLOCK_ID:
        raise InputError(f"block id must be an integer in [0, 2**64), got {block_id!r}")
    return _tokens_of(np.array([block_id], dtype=_U64), block_tokens)[0]


def request_tokens(req: Request, block_tokens: int) -> np.ndarray:
    """The tokens of the request's full blocks, concatenated (uint32, 1-D).

    A last block that ``input_tokens`` shows to be partial is left out: a partial
    page gets no key in the store, so it is never cached.
    """
    n = req.full_blocks(block_tokens)
    if n == 0:
        return np.zeros(0, dtype="<u4")
    ids = np.array(req.blocks[:n], dtype=_U64)
    return _tokens_of(ids, block_tokens).reshape(-1)


# --------------------------------------------------------------------------------------
# Synthetic mix

IntRange = tuple[int, int]


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
        for name in ("block_tokens", "system_prompts", "documents", "agent_kinds", "max_context_tokens"):
            if getattr(self, name) < 1:
                raise InputError(f"SyntheticMix.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("system_prompt_blocks", "user_message_tokens", "answer_tokens", "document_blocks",
                     "question_tokens", "agent_prompt_blocks", "agent_turns", "tool_output_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise InputError(f"SyntheticMix.{name} must satisfy 1 <= low <= high, got ({lo}, {hi})")
        shares = (self.conversation_share, self.rag_share, self.agent_share)
        if min(shares) < 0 or sum(shares) <= 0:
            raise InputError(f"SyntheticMix shares must be >= 0 with a positive sum, got {shares}")
        if self.session_rate_per_s <= 0 or self.conversation_turns_mean < 1 or self.document_zipf_s < 0:
            raise InputError("SyntheticMix needs session_rate_per_s > 0, conversation_turns_mean >= 1 and "
                             f"document_zipf_s >= 0, got {self.session_rate_per_s}, "
                             f"{self.conversation_turns_mean}, {self.document_zipf_s}")


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
    weights = 1.0 / np.arange(1, m.system_prompts + 1)
    ctx = _Context(b, b.system_prompt(int(b.rng.choice(m.system_prompts, p=weights / weights.sum()))))
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
    """
    if isinstance(n_requests, bool) or not isinstance(n_requests, int) or n_requests < 0:
        raise InputError(f"n_requests must be a non-negative integer, got {n_requests!r}")
    rng = np.random.default_rng(seed)
    b = _Builder(mix, rng)
    kinds = (_conversation, _rag, _agent)
    per_session = (mix.conversation_turns_mean, 1.0, sum(mix.agent_turns) / 2)
    p = np.array([s / n for s, n in zip((mix.conversation_share, mix.rag_share, mix.agent_share), per_session)])
    p /= p.sum()
    rows: list[tuple[float, int, int, Request]] = []
    cutoff = math.inf
    t = 0.0
    session = 0
    while n_requests:
        t += float(rng.exponential(1.0 / mix.session_rate_per_s))
        if len(rows) >= n_requests:
            if cutoff == math.inf:  # adding requests only lowers it, so computing it once is safe
                cutoff = float(np.partition([r[0] for r in rows], n_requests - 1)[n_requests - 1])
            if t > cutoff:
                break
        reqs = kinds[int(rng.choice(3, p=p))](b, t)
        rows.extend((r.arrival_s, session, i, r) for i, r in enumerate(reqs))
        session += 1
    rows.sort(key=lambda row: row[:3])
    return [row[3] for row in rows[:n_requests]]


def parse_mix(spec: str) -> SyntheticMix:
    """A :class:`SyntheticMix` from ``"field=value,field=value"``; ranges as ``low-high``.

    For example ``"conversation_share=1,rag_share=0,agent_share=0,think_time_s_mean=300"``
    or ``"system_prompt_blocks=4-16"``. Fields not named keep their defaults.
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
                values[name] = float(raw)
            else:
                values[name] = int(raw)
        except ValueError:
            want = "a range low-high of integers" if "IntRange" in kind else \
                "a number" if "float" in kind else "an integer"
            raise InputError(f"--mix: {name} takes {want}, got {raw!r}") from None
    return SyntheticMix(**values)  # type: ignore[arg-type]


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
