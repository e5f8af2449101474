"""Tests of tierkv.workload: the Mooncake reader, the synthetic mix, block tokens."""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.errors import InputError, TierKVError
from tierkv.keys import namespace_digest, page_keys
from tierkv.layout import KVLayout
from tierkv.workload import (Request, SyntheticMix, block_tokens, load_requests, parse_mix, read_mooncake,
                             request_tokens, synthetic)
from tierkv.workload.synthetic import MAX_EMPTY_SESSIONS, MAX_REQUESTS, MIX_LIMITS

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
B = 512


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def _line(ts: float = 0, inp: int = 1000, out: int = 10, ids: list[int] | None = None) -> str:
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out,
                       "hash_ids": [0, 1] if ids is None else ids})


# -- Mooncake reader ---------------------------------------------------------------------


def test_reads_requests_in_seconds_and_skips_blank_lines(tmp_path: Path) -> None:
    p = _write(tmp_path, [_line(0, 1000), "", _line(1500, 1024, 7, [0, 5]), "   "])
    reqs = list(read_mooncake(p))
    assert reqs == [Request(0.0, (0, 1), 1000, 10), Request(1.5, (0, 5), 1024, 7)]
    assert reqs[0].full_blocks(B) == 1 and reqs[1].full_blocks(B) == 2


def test_limit_stops_early(tmp_path: Path) -> None:
    p = _write(tmp_path, [_line(i) for i in range(5)] + ["not json"])
    assert len(list(read_mooncake(p, limit=3))) == 3
    assert list(read_mooncake(p, limit=0)) == []


@pytest.mark.parametrize("bad, fragment", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"timestamp": 1, "input_length": 10, "hash_ids": [0]}), "missing field(s) output_length"),
    (_line(inp="10"), "input_length must be an integer"),  # type: ignore[arg-type]
    (_line(inp=True), "input_length must be an integer"),
    (_line(out=-1), "output_length must be an integer >= 0"),
    (_line(ts="0"), "timestamp must be a finite number"),  # type: ignore[arg-type]
    (_line(ts=-5), "timestamp must be a finite number"),
    (_line(ids=[0, "x"]), "hash_ids must be a list of integers"),  # type: ignore[list-item]
    (_line(ids=[0, -1]), "hash_ids must be a list of integers"),
    (_line(ts=10 ** 400), "timestamp must be a finite number >= 0 (ms), got a 1329-bit integer"),
    (_line(ids=[1]).replace('"timestamp": 0', '"timestamp": 1e999'), "finite number >= 0 (ms), got inf"),
    (_line(ids=[1]).replace('"timestamp": 0', '"timestamp": NaN'), "finite number >= 0 (ms), got nan"),
    (_line(out=10 ** 30), "output_length must be an integer >= 0 and <= 2147483647"),
    (_line(inp=1000, ids=[0]), "needs 2 blocks of 512 tokens, hash_ids has 1"),
    (_line(inp=1024, ids=[0, 1, 2]), "needs 2 blocks of 512 tokens, hash_ids has 3"),
])
def test_malformed_line_names_its_number(tmp_path: Path, bad: str, fragment: str) -> None:
    p = _write(tmp_path, [_line(0), _line(1), bad])
    it = read_mooncake(p)
    assert next(it).arrival_s == 0.0
    with pytest.raises(InputError) as info:
        list(it)
    assert f"{p}:3:" in str(info.value) and fragment in str(info.value)
    assert isinstance(info.value, TierKVError)


def test_decreasing_timestamps_are_rejected(tmp_path: Path) -> None:
    p = _write(tmp_path, [_line(10), _line(10), _line(5)])
    with pytest.raises(InputError, match=r":3: timestamp 5 ms is earlier than the previous line's 10 ms"):
        list(read_mooncake(p))


def test_missing_file_fails_at_call_time(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        read_mooncake(tmp_path / "nope.jsonl")
    with pytest.raises(InputError, match="limit"):
        read_mooncake(_write(tmp_path, [_line()]), limit=-1)


@pytest.mark.skipif(not TRACE.is_file(), reason="Mooncake trace not present")
def test_real_trace_totals() -> None:
    reqs = list(read_mooncake(TRACE))
    assert len(reqs) == 12031
    assert sum(len(r.blocks) for r in reqs) == 288500
    assert len({b for r in reqs for b in r.blocks}) == 182790
    assert all(r.blocks[0] == 0 for r in reqs)
    assert reqs[-1].arrival_s <= 3537.0


# -- block tokens ------------------------------------------------------------------------


def test_block_tokens_are_deterministic_uint32_and_distinct() -> None:
    a = block_tokens(7, B)
    assert a.dtype == np.dtype("<u4") and a.shape == (B,)
    assert np.array_equal(a, block_tokens(7, B))
    rows = {block_tokens(i, B).tobytes() for i in range(2000)}
    assert len(rows) == 2000
    assert block_tokens(2**64 - 1, B)[:2].tolist() == [2**32 - 1, 2**32 - 1]


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
@settings(max_examples=200, deadline=None)
def test_block_tokens_distinct_for_distinct_ids(a: int, b: int) -> None:
    assert (a == b) == np.array_equal(block_tokens(a, 16), block_tokens(b, 16))


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, True])
def test_block_tokens_rejects_bad_ids(bad: object) -> None:
    with pytest.raises(InputError):
        block_tokens(bad, B)  # type: ignore[arg-type]


def test_request_tokens_keep_only_full_blocks() -> None:
    partial = Request(0.0, (3, 4, 5), 2 * B + 1, 1)
    full = Request(0.0, (3, 4), 2 * B, 1)
    assert np.array_equal(request_tokens(partial, B), np.concatenate([block_tokens(3, B), block_tokens(4, B)]))
    assert np.array_equal(request_tokens(full, B), request_tokens(partial, B))
    assert request_tokens(Request(0.0, (9,), 100, 1), B).size == 0


def test_shared_block_ids_give_shared_page_keys() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_page=B)
    ns = namespace_digest("m", layout)
    a = page_keys(request_tokens(Request(0.0, (0, 1, 2), 3 * B, 1), B), layout, ns)
    b = page_keys(request_tokens(Request(0.0, (0, 1, 9), 3 * B, 1), B), layout, ns)
    assert a[:2] == b[:2] and a[2] != b[2]


# -- synthetic mix -----------------------------------------------------------------------


def _assert_prefix_chained(reqs: list[Request]) -> None:
    """Equal id at position i means equal blocks up to i; partial tails are never reused."""
    where: dict[int, tuple[int, int | None]] = {}
    counts: dict[int, int] = {}
    for r in reqs:
        for i, b in enumerate(r.blocks):
            seen = where.setdefault(b, (i, r.blocks[i - 1] if i else None))
            assert seen == (i, r.blocks[i - 1] if i else None), f"block {b} has two prefixes"
            counts[b] = counts.get(b, 0) + 1
    for r in reqs:
        assert len(r.blocks) == -(-r.input_tokens // B)
        if r.input_tokens % B:
            assert counts[r.blocks[-1]] == 1, "a partial block's id was reused"


def test_synthetic_is_deterministic_and_sized() -> None:
    a = synthetic(3, 400)
    assert a == synthetic(3, 400)
    assert a != synthetic(4, 400)
    assert len(a) == 400 and synthetic(3, 0) == []
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals)


def test_synthetic_mix_has_reuse_and_long_contexts() -> None:
    reqs = synthetic(0, 1500)
    _assert_prefix_chained(reqs)
    blocks = [r.full_blocks(B) for r in reqs]
    assert max(blocks) > 64  # agent sessions grow long
    assert max(r.input_tokens for r in reqs) <= SyntheticMix().max_context_tokens
    # Some later request extends an earlier request's full prefix (conversation/agent turns).
    prefixes = {r.blocks[:r.full_blocks(B)] for r in reqs if r.full_blocks(B) >= 2}
    assert any(r.blocks[:k] in prefixes for r in reqs for k in range(2, r.full_blocks(B)))
    seen: set[int] = set()
    refs = hits = 0
    for r in reqs:
        full = r.blocks[:r.full_blocks(B)]
        refs += len(full)
        hits += sum(1 for b in full if b in seen)
        seen.update(full)
    assert 0.3 < hits / refs < 0.98


@given(st.integers(0, 2**32), st.integers(1, 120))
@settings(max_examples=25, deadline=None)
def test_synthetic_is_prefix_chained_for_any_seed(seed: int, n: int) -> None:
    reqs = synthetic(seed, n, SyntheticMix(session_rate_per_s=3.0))
    assert len(reqs) == n
    _assert_prefix_chained(reqs)


def test_synthetic_mix_validates() -> None:
    with pytest.raises(InputError, match="answer_tokens"):
        SyntheticMix(answer_tokens=(10, 5))
    with pytest.raises(InputError, match="shares"):
        SyntheticMix(conversation_share=0, rag_share=0, agent_share=0)
    with pytest.raises(InputError):
        synthetic(0, -1)
    only_rag = synthetic(1, 50, SyntheticMix(conversation_share=0, agent_share=0))
    assert all(len(r.blocks) <= 4 + 24 + 1 for r in only_rag)


def test_parse_mix_reads_numbers_and_ranges() -> None:
    mix = parse_mix("conversation_share=1, rag_share=0,agent_share=0,think_time_s_mean=300,"
                    "system_prompt_blocks=4-16,documents=9")
    assert mix == SyntheticMix(conversation_share=1.0, rag_share=0.0, agent_share=0.0, think_time_s_mean=300.0,
                               system_prompt_blocks=(4, 16), documents=9)
    assert parse_mix("") == SyntheticMix()


@pytest.mark.parametrize("spec, match", [
    ("nope=1", "field=value"), ("documents", "field=value"), ("documents=1.5", "integer"),
    ("think_time_s_mean=soon", "number"), ("system_prompt_blocks=4", "low-high"),
    ("documents=1,documents=2", "twice"), ("documents=0", "documents"), ("answer_tokens=9-3", "answer_tokens"),
    ("block_tokens=256", "field=value"),
])
def test_parse_mix_names_what_was_expected(spec: str, match: str) -> None:
    with pytest.raises(InputError, match=match):
        parse_mix(spec)


def test_load_requests_records_the_mix_it_used() -> None:
    reqs, source = load_requests(None, None, 30, 2, parse_mix("rag_share=0,agent_share=0"))
    assert reqs == synthetic(2, 30, SyntheticMix(rag_share=0.0, agent_share=0.0))
    assert source == {"source": "synthetic", "seed": 2, "mix": {"rag_share": 0.0, "agent_share": 0.0}}
    assert load_requests(None, None, 30, 2)[1] == {"source": "synthetic", "seed": 2}


def test_load_requests_refuses_a_seed_or_mix_with_a_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n')
    assert load_requests(trace, None, 30, None)[1] == {"source": "mooncake", "trace": str(trace)}
    with pytest.raises(InputError, match="--seed .* cannot be used with --trace"):
        load_requests(trace, None, 30, 0)
    with pytest.raises(InputError, match="--mix"):
        load_requests(trace, None, 30, None, SyntheticMix())
    assert load_requests(None, None, 5, None)[1] == {"source": "synthetic", "seed": 0}


# -- every mix field is bounded (issue 28, items 6, 7 and 9) -----------------------------


@contextmanager
def _bounded(seconds: int = 120, more_bytes: int = 2 << 30) -> Iterator[None]:
    """Fail instead of hanging or exhausting the machine: past ``seconds`` (a loop that never
    ends) or ``more_bytes`` of new data (a workload that grows without bound), the block
    raises. Not a timing claim: both bounds are far above any correct run."""
    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")
    used = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmData:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = used + more_bytes if hard == resource.RLIM_INFINITY else min(hard, used + more_bytes)
    old = signal.signal(signal.SIGALRM, expire)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("spec, match", [
    ("session_rate_per_s=inf", r"session_rate_per_s=inf is not a finite number; session_rate_per_s must be in "
                               r"\[1e-06, 1000000\]"),
    ("system_prompt_blocks=1-1000000000", r"system_prompt_blocks must be a range .* 1 <= low <= high <= 4096, "
                                          r"got \(1, 1000000000\)"),
    ("conversation_share=nan", r"conversation_share=nan is not a finite number; conversation_share must be in "
                               r"\[0, 1\]"),
    ("document_zipf_s=nan", r"document_zipf_s=nan is not a finite number; document_zipf_s must be in \[0, 10\]"),
    ("documents=1000000000000", r"documents must be an integer in \[1, 100000\], got 1000000000000"),
    ("think_time_s_mean=1e400", r"think_time_s_mean=1e400 is not a finite number; .* \[0, 1000000\]"),
    ("agent_step_s_mean=-inf", r"agent_step_s_mean=-inf is not a finite number"),
    ("session_rate_per_s=0", r"session_rate_per_s must be a finite number in \[1e-06, 1000000\], got 0.0"),
    ("conversation_share=1.5", r"conversation_share must be a finite number in \[0, 1\], got 1.5"),
    ("conversation_turns_mean=1e9", r"conversation_turns_mean must be .* \[1, 1000\]"),
    ("agent_turns=1-1000000", r"agent_turns must be a range .* <= 1000"),
    ("tool_output_tokens=1-9999999999", r"tool_output_tokens must be a range .* <= 1048576"),
    ("max_context_tokens=100000000", r"max_context_tokens must be an integer in \[1, 1048576\]"),
    ("max_context_tokens=600", r"shortest rag prompt .* is 1556 tokens, more than max_context_tokens=600"),
])
def test_mix_values_out_of_range_name_the_field_the_value_and_the_range(spec: str, match: str) -> None:
    """Before: inf looped forever, 1e9-block prompts and 1e12 documents ran out of memory,
    nan failed inside numpy and 1e400 reached the --json report as Infinity."""
    with pytest.raises(InputError, match=f"^--mix: .*{match}"):
        parse_mix(spec)


def _outside(name: str) -> list[object]:
    lo, hi = MIX_LIMITS[name]
    kind = str(next(f.type for f in dataclasses.fields(SyntheticMix) if f.name == name))
    if "IntRange" in kind:
        return [(int(lo) - 1, int(lo)), (int(lo), int(hi) + 1), (2, 1), (True, 2), (1.5, 2), (1, 2, 3), 5]
    if "float" in kind:
        return [math.nan, math.inf, -math.inf, lo - 1, hi * 2 + 1, True, "1"]
    return [int(lo) - 1, int(hi) + 1, True, 2.0, "3", None]


@pytest.mark.parametrize("name", sorted(MIX_LIMITS))
def test_every_mix_field_is_bounded_and_typed(name: str) -> None:
    assert {f.name for f in dataclasses.fields(SyntheticMix)} == set(MIX_LIMITS)
    for value in _outside(name):
        with pytest.raises(InputError, match=f"SyntheticMix.{name} must be"):
            SyntheticMix(**{name: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", [
    "session_rate_per_s=1000000", "session_rate_per_s=0.000001", "think_time_s_mean=1000000,agent_step_s_mean=0",
    "documents=100000,document_zipf_s=0", "system_prompts=100000,system_prompt_blocks=1-100",
    "conversation_share=1,rag_share=0,agent_share=0,conversation_turns_mean=1000",
    "conversation_share=0,rag_share=0,agent_share=1,agent_turns=1000-1000",
])
def test_mixes_at_the_limits_generate_finite_workloads(spec: str) -> None:
    with _bounded():
        reqs = synthetic(0, 60, parse_mix(spec))
    assert len(reqs) == 60
    _assert_prefix_chained(reqs)
    json.dumps([r.arrival_s for r in reqs], allow_nan=False)  # the report is JSON: no Infinity, no NaN


def test_a_mix_that_almost_never_fits_its_context_is_refused_not_run_forever() -> None:
    # Messages of 65,000 tokens or more, log-uniform up to 1M, in a 64K context: about one
    # session in 7,000 has a request. Before: sessions drawn until 60 requests, without end in sight.
    mix = parse_mix("conversation_share=1,rag_share=0,agent_share=0,system_prompt_blocks=1-1,"
                    "user_message_tokens=65000-1048576")
    with _bounded(), pytest.raises(InputError, match=f"{MAX_EMPTY_SESSIONS} sessions in a row without a request"):
        synthetic(0, 60, mix)


def test_synthetic_bounds_its_request_count_and_seed() -> None:
    with _bounded(), pytest.raises(InputError, match=f"0 to {MAX_REQUESTS} requests, asked for 1000000000000"):
        synthetic(0, 10 ** 12)
    for seed in (-1, 1.5, True):
        with pytest.raises(InputError, match="seed"):
            synthetic(seed, 5)  # type: ignore[arg-type]
    assert synthetic(np.int64(3), 5) == synthetic(3, 5)  # type: ignore[arg-type]


def test_mix_fields_are_normalised() -> None:
    mix = SyntheticMix(conversation_share=1, rag_share=0, agent_share=0,
                       answer_tokens=[np.int64(5), 9])  # type: ignore[arg-type]
    assert mix.answer_tokens == (5, 9) and type(mix.answer_tokens[0]) is int
    assert type(mix.conversation_share) is float and mix == SyntheticMix(conversation_share=1.0, rag_share=0.0,
                                                                         agent_share=0.0, answer_tokens=(5, 9))
