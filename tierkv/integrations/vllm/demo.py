"""``tierkv demo --engine vllm``: a multi-turn chat in a real vLLM engine whose KV comes from tierkv.

Three engine processes over one ``tierkv serve`` daemon (store in a work directory):

1. **without**: the connector configured with loading and saving off: every turn
   recomputes its whole prompt. This is the baseline, not an engine without a connector
   at all, because configuring any KV connector in vLLM 0.32 (even one that does
   nothing) changes its greedy outputs slightly (docs/integration.md, "Exact outputs");
2. **with**: turns load the earlier turns' pages from the daemon's DRAM and store
   what they compute;
3. **after restart**: the daemon is stopped (SIGTERM: its DRAM pages go down to NVMe)
   and started again, and a new engine runs the chat: the pages come from NVMe.

All three prefill in chunks of one page (``max_num_batched_tokens`` = block size), so
that the tokens after a loaded prefix are computed exactly as a recompute computes
them; with ``save_generated`` off, only pages of prompt tokens are stored (a decode
step computes a token's KV in another order than a prefill). Under those settings the
greedy outputs of 2 and 3 must equal those of 1, and ``tokens_loaded`` is vLLM's own
count (``RequestOutput.num_cached_tokens``; vLLM's prefix cache is off).

The connector puts a turn's pages in the background; before the next turn, 2 and 3 wait
until the store holds them (as a user's reply would take longer), and report how long
(``save_wait_s``: 0 where they had landed; on a loaded machine a put took up to 1.2 s).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierkv.integrations.vllm.session import LAYOUT, Daemon, VllmEnv, run_chat, store_config

SYSTEM = (
    "You are a concise assistant for engineers who run language-model servers. Answer from the notes below.\n\n"
    "Notes on KV caches. A serving engine keeps the attention keys and values of every token it has processed, "
    "the KV cache, in accelerator memory. When a conversation returns for its next turn, the engine must either "
    "find that cache again or recompute it from the whole transcript, which costs time proportional to the "
    "length of the conversation. A tiered store keeps the cache in pages of a fixed number of tokens: the newest "
    "pages in host memory, older ones on a local NVMe drive, and each page is named by a hash of its tokens and "
    "of every token before it, salted by the model and the tenant.\n\n"
    "Notes on loading. A new turn looks up its prompt, loads the longest run of pages it finds, and computes only "
    "the tokens after them. Loading a page costs a copy from memory or a read from the drive; computing it costs "
    "a forward pass through every layer of the model. For long prompts the forward pass grows faster than the "
    "copy, so loading wins by more the longer the shared prefix is.\n\n"
    "Notes on failures. A page whose checksum fails is never used: the engine recomputes it. A store that "
    "restarts keeps the pages that reached the drive, so a returning conversation still finds them.\n\n"
    "Notes on tenants. Two tenants never share a page, because the salt enters the first page's hash and "
    "every later hash depends on it."
)
TURNS = (
    "In two sentences, what does a tiered KV store do?",
    "Why does loading beat recomputing for long prompts?",
    "What happens to a page whose checksum fails?",
    "Why can two tenants never share a page?",
)


def chat_spec(turns: int, max_tokens: int, connector: dict[str, Any], prefix_caching: bool = False) -> dict[str, Any]:
    return {"system": SYSTEM, "turns": list(TURNS[:turns]), "max_tokens": max_tokens,
            "chunk": LAYOUT["tokens_per_page"], "block_size": LAYOUT["tokens_per_page"],
            "await_saves": connector.get("save", True) is not False,
            "connector": connector, "prefix_caching": prefix_caching}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def run_demo(env: VllmEnv, work: Path, turns: int = 3, max_tokens: int = 32,
             prefix_caching: bool = False, step: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Run the three engines in ``work``; the JSON report (see the module docstring).

    ``prefix_caching``: vLLM's own prefix cache on in all three (then a turn loads only
    the pages beyond what vLLM kept itself, and ``tokens_loaded`` counts vLLM's local hits
    too). ``step()`` is called after each engine run (a progress bar)."""
    cfg = work / "store.toml"
    cfg.write_text(store_config(work / "store"))
    exact = {"save_generated": False}
    with Daemon(cfg, work / "daemon.log") as d:
        without = run_chat(env, chat_spec(turns, max_tokens, {"load": False, "save": False}, prefix_caching), work,
                           "without", d.socket)
        step()
        with_ = run_chat(env, chat_spec(turns, max_tokens, exact, prefix_caching), work, "with", d.socket)
        step()
    with Daemon(cfg, work / "daemon.log") as d:
        again = run_chat(env, chat_spec(turns, max_tokens, exact, prefix_caching), work, "restart", d.socket)
        step()
    rows = []
    for i, (b, w, r) in enumerate(zip(without["turns"], with_["turns"], again["turns"])):
        rows.append({"turn": i + 1, "prompt_tokens": b["prompt_tokens"],
                     "tokens_loaded": w["tokens_loaded"], "tiers": w["store_hits"],
                     "tokens_loaded_after_restart": r["tokens_loaded"], "tiers_after_restart": r["store_hits"],
                     "ttft_s_without": b["ttft_s"], "ttft_s_with": w["ttft_s"], "ttft_s_after_restart": r["ttft_s"],
                     "save_wait_s": w["save_wait_s"], "save_wait_s_after_restart": r["save_wait_s"],
                     "output_matches": w["answer_ids"] == b["answer_ids"],
                     "output_matches_after_restart": r["answer_ids"] == b["answer_ids"],
                     "answer": b["answer"]})
    loaded = [x for x in rows if x["tokens_loaded"]]
    return {
        "engine": "vllm",
        "prefix_caching": prefix_caching,
        "turns": rows,
        "tokens_loaded": sum(x["tokens_loaded"] for x in rows),
        "tokens_loaded_after_restart": sum(x["tokens_loaded_after_restart"] for x in rows),
        "outputs_identical": all(x["output_matches"] and x["output_matches_after_restart"] for x in rows),
        # Over the turns that loaded something (the first turn of a fresh store cannot).
        "ttft_s_with": _median([x["ttft_s_with"] for x in loaded]),
        "ttft_s_without": _median([x["ttft_s_without"] for x in loaded]),
        "ttft_s_after_restart": _median([x["ttft_s_after_restart"] for x in rows if x["tokens_loaded_after_restart"]]),
        "external_prefix_cache_hits": {"with": with_["external_prefix_cache_hits"],
                                       "after_restart": again["external_prefix_cache_hits"]},
        "engine_start_s": _median([without["engine_start_s"], with_["engine_start_s"], again["engine_start_s"]]),
    }
