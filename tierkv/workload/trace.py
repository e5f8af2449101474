"""Workload requests and the Mooncake trace reader.

A workload is a sequence of :class:`Request` in arrival order. A request names its
prompt as *prefix-chained block ids*: one id per ``block_tokens``-token block, where
an equal id at position ``i`` of two requests means their prompts are identical up to
the end of block ``i`` (the Mooncake trace convention). :func:`block_tokens` turns an
id into the tokens it stands for, so that the store's own chained page keys agree with
the ids: shared ids give shared pages. Called by :mod:`tierkv.workload.replay`,
:mod:`tierkv.sim` and :mod:`tierkv.plan`; :mod:`tierkv.workload.synthetic` makes requests
of the same form.
"""

from __future__ import annotations

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
#: The largest ``input_length`` or ``output_length`` a trace may give: no model has a
#: context of 2**31 tokens, and the planner keeps token counts in 64-bit arrays.
MAX_TRACE_TOKENS = (1 << 31) - 1


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

    Each non-blank line is an object with ``timestamp`` (ms, a finite int or float >= 0),
    ``input_length`` and ``output_length`` (ints in ``[0, MAX_TRACE_TOKENS]``) and ``hash_ids`` (list of
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
    # An integer past float's range (JSON allows any) is as infinite as 1e999.
    ms = float(ts) if isinstance(ts, float) or (isinstance(ts, int) and not isinstance(ts, bool)
                                                 and ts.bit_length() <= 1000) else math.nan
    if not (ms >= 0 and math.isfinite(ms)):
        raise InputError(f"{where}: timestamp must be a finite number >= 0 (ms), got {_short(ts)}")
    lengths = []
    for key in ("input_length", "output_length"):
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TRACE_TOKENS:
            raise InputError(f"{where}: {key} must be an integer >= 0 and <= {MAX_TRACE_TOKENS}, got {_short(value)}")
        lengths.append(value)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= _MAX_BLOCK_ID for b in ids):
        raise InputError(f"{where}: hash_ids must be a list of integers in [0, 2**64), got {str(ids)[:80]}")
    want = -(-lengths[0] // block_tokens)
    if len(ids) != want:
        raise InputError(f"{where}: input_length {lengths[0]} needs {want} blocks of {block_tokens} tokens, "
                         f"hash_ids has {len(ids)}")
    return Request(arrival_s=ms / 1000.0, blocks=tuple(ids), input_tokens=lengths[0], output_tokens=lengths[1])


def _short(value: object) -> str:
    """``value`` for a message: a huge integer by its size (its digits may be refused or slow)."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"a {value.bit_length()}-bit integer"
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


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
