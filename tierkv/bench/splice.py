"""``tierkv bench splice``: what a splice saves and what it costs, on SmolLM2-135M.

Two parts, one run:

- **The model** (transformers, CPU, fp32): an agent's context of ``--context`` tokens (a
  system prompt, requests, tool outputs and answers, made up deterministically) is
  prefilled and saved in a store. A tool output of ``--delete`` tokens in its middle is
  then dropped, and the first token of the edited context is produced two ways: an
  honest re-prefill (the exact pages before the edit loaded, everything after prefilled)
  and a splice (``TierKVCache.splice``: the pages from the edit's on moved, then everything
  loaded with ``accept="derived"``, the last partial page prefilled). Reported: ``ttft_s_reprefill``, ``ttft_s_splice`` (each the
  median of ``--runs``, the splice's store work included), ``layer0_key_max_abs_err`` (the
  derived keys of the first layer against the re-prefill's), ``greedy_agreement`` (of
  ``--generate`` greedy tokens from each cache, the share equal position by position, and
  the leading run equal), and ``nll_delta`` (teacher-forced NLL per token of the text that
  follows the context, spliced minus re-prefilled; positive: the splice predicts worse).
- **The trace** (no model: reuse depends on positions, not on the KV's values): sessions
  of an agent whose context grows turn by turn, where from the fourth turn on each turn
  drops or replaces an earlier tool output, through a real store with random pages.
  Reported per request after an edit: tokens served from exact pages
  (``tokens_reused_exact``), from exact and derived pages (``tokens_reused_splice``), and
  the gain in points of the cached context (``reuse_gain_points``).
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tierkv.config import DramConfig, StoreConfig
from tierkv.layout import KVLayout
from tierkv.splice.rope import Rope
from tierkv.store.api import Store

WORDS = ("build", "test", "worker", "cache", "page", "file", "error", "passed", "request", "token", "node", "disk",
         "latency", "socket", "retry", "commit", "branch", "config", "module", "import", "index", "query")


def agent_text(rng: np.random.Generator, tool_lines: int) -> str:
    """A tool's output: ``tool_lines`` log lines of words and numbers."""
    return "\n".join(f"[{i:04d}] {rng.choice(WORDS)} {rng.choice(WORDS)} {int(rng.integers(0, 10_000))} "
                     f"{rng.choice(WORDS)} in {int(rng.integers(1, 999))} ms" for i in range(tool_lines))


def run_splice_bench(context: int = 2048, delete: int = 256, generate: int = 32, continuation: int = 64,
                     runs: int = 3, sessions: int = 8, turns: int = 10, where: str | None = None,
                     step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run both parts (module docstring); ``step`` is told each phase as it starts."""
    if not 64 <= delete < context // 2:
        raise ValueError(f"--delete must be 64 or more and less than half of --context, got {delete} and {context}")
    say = step or (lambda _what: None)
    out: dict[str, Any] = {"context": context, "delete": delete}
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-splice-", dir=where) as tmp:
        say("the trace: tokens reused with exact pages and with splices")
        out.update(reuse_on_trace(Path(tmp) / "trace", sessions, turns))
        say("loading SmolLM2-135M (fp32)")
        out.update(model_part(Path(tmp) / "model", context, delete, generate, continuation, runs, say))
    return out


def model_part(where: Path, context: int, delete: int, generate: int, continuation: int, runs: int,
               say: Callable[[str], None]) -> dict[str, Any]:
    import torch

    from tierkv.integrations import smollm2
    from tierkv.integrations.hf import TierKVCache

    lm = smollm2.load("fp32")
    model, tok = lm.model, lm.tokenizer
    rng = np.random.default_rng(7)
    # The context: a system prompt, then turns of request, tool output and answer, until long enough.
    parts: list[list[int]] = [tok.encode("You are a coding agent. Use the tools; keep answers short.\n",
                                         add_special_tokens=False)]
    while sum(map(len, parts)) < context + continuation + delete:
        parts.append(tok.encode(f"\nUser: check the {rng.choice(WORDS)} {rng.choice(WORDS)}.\nTool output:\n",
                                add_special_tokens=False))
        parts.append(tok.encode(agent_text(rng, 24), add_special_tokens=False))
        parts.append(tok.encode(f"\nAssistant: the {rng.choice(WORDS)} is {rng.choice(WORDS)}.\n",
                                add_special_tokens=False))
    ids = np.array([t for p in parts for t in p], dtype=np.int64)
    old, follow = ids[:context], ids[context:context + continuation]
    s = int(context * 0.4) // 16 * 16 + 5          # the deleted output starts mid-page
    e = s + delete
    new = np.concatenate([old[:s], old[e:]])
    layout = smollm2.kv_layout("fp32", 16)
    pages = 2 * (context // 16 + 8)

    def forward(cache: Any, tokens: np.ndarray) -> Any:
        with torch.no_grad():
            return model(torch.from_numpy(tokens)[None], past_key_values=cache, use_cache=True)

    ttft_re, ttft_sp = [], []
    say(f"prefilling the {context}-token context")
    base = forward(None, old)
    for r in range(runs):
        say(f"run {r + 1} of {runs}: a fresh store holding the context; re-prefill, then splice")
        cfg = StoreConfig(path=str(where / f"run{r}"), model_id=smollm2.MODEL_ID, layout=layout,
                          dram=DramConfig(pages * layout.page_bytes))
        with Store.open(cfg) as store:
            tkv = TierKVCache(store, model)
            tkv.save(copy.deepcopy(base.past_key_values), old)
            t0 = time.perf_counter()          # re-prefill: the exact pages before the edit, the rest computed
            pre = tkv.load(new)
            re_out = forward(pre.cache, new[pre.tokens:])
            ttft_re.append(time.perf_counter() - t0)
            t0 = time.perf_counter()          # splice: move, prefill the edit's pages, load it all
            res = tkv.splice(old, s, e, np.zeros(0, np.int64))
            if res.prefill_to > res.prefill_from:   # a replacement: its pages prefilled first (none for a deletion)
                pre = tkv.load(new[:res.prefill_to])
                mid = forward(pre.cache, new[pre.tokens:res.prefill_to])
                tkv.save(mid.past_key_values, new[:res.prefill_to])
            full = tkv.load(new, accept="derived")
            sp_out = forward(full.cache, new[full.tokens:])
            ttft_sp.append(time.perf_counter() - t0)
    re_cache, re_logits = re_out.past_key_values, re_out.logits[0, -1]
    sp_cache, sp_logits = sp_out.past_key_values, sp_out.logits[0, -1]
    derived_from = res.first_derived * 16
    k_sp = sp_cache.layers[0].keys[0, :, derived_from:full.tokens]
    k_re = re_cache.layers[0].keys[0, :, derived_from:full.tokens]
    layer0 = float((k_sp - k_re).abs().max())
    say(f"greedy agreement over {generate} tokens and NLL over {continuation}")
    agree, lead = _greedy(model, copy.deepcopy(sp_cache), sp_logits, copy.deepcopy(re_cache), re_logits, generate)
    nll_sp = _nll(model, copy.deepcopy(sp_cache), sp_logits, follow)
    nll_re = _nll(model, copy.deepcopy(re_cache), re_logits, follow)
    t_re, t_sp = statistics.median(ttft_re), statistics.median(ttft_sp)
    return {
        "prompt_tokens": int(new.size), "deleted_at": s, "derived_tokens": full.derived_tokens,
        "prefilled_tokens_splice": int(res.prefill_to - res.prefill_from + new.size - full.tokens),
        "prefilled_tokens_reprefill": int(new.size - s // 16 * 16),
        "ttft_s_reprefill": round(t_re, 4), "ttft_s_splice": round(t_sp, 4),
        "ttft_reprefill_vs_splice": round(t_re / t_sp, 2),
        "ttft_s_reprefill_runs": [round(x, 4) for x in ttft_re], "ttft_s_splice_runs": [round(x, 4) for x in ttft_sp],
        "layer0_key_max_abs_err": layer0,
        "greedy_agreement": agree, "greedy_leading_agreement": lead, "generated_tokens": generate,
        "nll_reprefill": round(nll_re, 4), "nll_splice": round(nll_sp, 4), "nll_delta": round(nll_sp - nll_re, 4),
        "continuation_tokens": int(follow.size),
    }


def _greedy(model: Any, cache_a: Any, logits_a: Any, cache_b: Any, logits_b: Any, n: int) -> tuple[float, float]:
    import torch

    def run(cache: Any, logits: Any) -> list[int]:
        toks = []
        with torch.no_grad():
            for _ in range(n):
                t = int(logits.argmax())
                toks.append(t)
                out = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
                cache, logits = out.past_key_values, out.logits[0, -1]
        return toks

    a, b = run(cache_a, logits_a), run(cache_b, logits_b)
    same = [x == y for x, y in zip(a, b)]
    lead = next((i for i, ok in enumerate(same) if not ok), n)
    return round(sum(same) / n, 4), round(lead / n, 4)


def _nll(model: Any, cache: Any, last_logits: Any, follow: np.ndarray) -> float:
    """Mean negative log-likelihood per token of ``follow`` after the context (teacher-forced)."""
    import torch

    with torch.no_grad():
        out = model(torch.from_numpy(follow[:-1])[None], past_key_values=cache, use_cache=True)
        logits = torch.cat([last_logits[None], out.logits[0]], 0)
        return float(torch.nn.functional.cross_entropy(logits.float(), torch.from_numpy(follow)))


# -- the trace -------------------------------------------------------------------------------
TRACE_LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=64, dtype="bf16", tokens_per_page=16)


def reuse_on_trace(where: Path, sessions: int, turns: int) -> dict[str, Any]:
    """Tokens reused after edits, exact pages against exact and derived ones (module docstring)."""
    rng = np.random.default_rng(11)
    rope = Rope.from_theta(100_000.0, TRACE_LAYOUT.head_dim)
    tpp, pb = TRACE_LAYOUT.tokens_per_page, TRACE_LAYOUT.page_bytes
    cfg = StoreConfig(path=str(where), model_id="trace", layout=TRACE_LAYOUT, dram=DramConfig(1 << 30), policy="lru")
    exact = splice = cached = edits = 0
    with Store.open(cfg) as store:
        for sid in range(sessions):
            tenant = f"s{sid}"
            ctx = list(rng.integers(0, 50_000, 200))          # the system prompt
            outputs: list[tuple[int, int]] = []                # the tool outputs' spans in ctx
            for turn in range(turns):
                if turn >= 3 and outputs:
                    k = int(rng.integers(0, len(outputs)))
                    s, e = outputs.pop(k)
                    rep = list(rng.integers(0, 50_000, int(rng.integers(30, 120)))) if rng.random() < 0.4 else []
                    old = np.array(ctx, np.uint32)
                    res = store.splice(old, s, e, np.array(rep, np.uint32), rope=rope, tenant=tenant)
                    new = res.tokens
                    shift = len(rep) - (e - s)
                    outputs = [(a + shift, b + shift) if a >= e else (a, b) for a, b in outputs]
                    if rep:
                        outputs.append((s, s + len(rep)))
                    # The engine prefills from the edit's page to the derived pages, and puts them.
                    whole = new.size // tpp * tpp
                    exact_now = store.lookup(new, tenant).cached_tokens
                    store.put(new[:res.prefill_to], _random_pages(rng, res.prefill_to // tpp, pb), tenant)
                    # Reused: the exact pages before the edit and the derived ones, not what was prefilled.
                    spliced_now = exact_now + store.lookup(new, tenant, accept="derived").derived * tpp
                    exact, splice, cached, edits = exact + exact_now, splice + spliced_now, cached + whole, edits + 1
                    ctx = list(new)
                # The turn: a request, a tool output, an answer; all of it cached after.
                start = len(ctx) + 20
                out_len = int(rng.integers(150, 500))
                ctx += list(rng.integers(0, 50_000, 20 + out_len + 60))
                outputs.append((start, start + out_len))
                arr = np.array(ctx, np.uint32)
                have = store.lookup(arr, tenant).cached_pages
                n = arr.size // tpp
                if n > have:   # pages already cached are skipped
                    store.put(arr[:n * tpp], _random_pages(rng, n, pb), tenant)
    return {
        "trace_sessions": sessions, "trace_turns": turns, "trace_edits": edits,
        "tokens_reused_exact": exact, "tokens_reused_splice": splice, "tokens_cached_context": cached,
        "reuse_exact_fraction": round(exact / cached, 4) if cached else None,
        "reuse_splice_fraction": round(splice / cached, 4) if cached else None,
        "reuse_gain_points": round(100 * (splice - exact) / cached, 2) if cached else None,
    }


def _random_pages(rng: np.random.Generator, n: int, page_bytes: int) -> np.ndarray:
    # bf16 bits of small normal values: what keys look like to the rotation (no NaN, no inf)
    vals = (rng.standard_normal((n, page_bytes // 2)).astype(np.float32)).view(np.uint32) >> 16
    return vals.astype(np.uint16).view(np.uint8).reshape(n, page_bytes)
