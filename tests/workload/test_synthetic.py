"""Tests of tierkv.workload: the Mooncake reader, the synthetic mix, block tokens."""

from __future__ import annotations

import json
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
