"""``tierkv bench vllm``: time to first token in a real vLLM engine, recompute vs loading.

Every request is one shared prefix of ``prefix_tokens`` tokens (2,048 by default) and a
question of its own. Modes, each a new engine process:

- ``recompute``: no connector; every request computes the whole prefix;
- ``example_connector``: vLLM's own ``ExampleConnector`` (KV files in a folder, read
  back through the page cache), after one request stored the prefix;
- ``tierkv_dram``: tierkv, after one request stored the prefix (the run waits until its
  pages have landed: the connector stores them in the background): pages from the
  daemon's DRAM;
- ``tierkv_nvme``: the daemon restarted (its DRAM gone) with ``promote_on_hit`` off, and
  a new engine: every request's pages come from the NVMe tier (O_DIRECT reads: the
  device's speed);
- ``tierkv_nvme_page_cache``: the same with the NVMe tier's ``o_direct`` off, so that its
  reads come through the page cache, as ExampleConnector's do (like for like).

Each engine first runs a short unrelated prompt (its first forward pass is slow), then
``requests`` measured ones. Recompute runs once; the loading modes run in ``rounds``
rounds (ExampleConnector first in one, last in the next), because this machine's speed
drifts by tens of percent over minutes and one engine per mode measured the drift as
much as the modes. A mode reports the median TTFT vLLM measured over all its requests
(and per round), and the median tokens it did not compute (``num_cached_tokens``;
vLLM's prefix cache is off). The ratios are against recompute and against
ExampleConnector in the same run.
"""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierkv.errors import InputError
from tierkv.integrations.vllm.demo import SYSTEM
from tierkv.integrations.vllm.session import Daemon, VllmEnv, run_chat, store_config

QUESTIONS = ("What does a tiered store keep?", "Why does loading beat recomputing?", "What names a page?",
             "What happens to a corrupt page?", "Why can tenants not share pages?", "What survives a restart?",
             "What does a lookup cost?")


def _spec(prefix_tokens: int, questions: list[str], connector: dict[str, Any], settle: bool = False) -> dict[str, Any]:
    # settle: wait after the first prefix request (prompt 1) until its pages are stored.
    return {"prefix_text": SYSTEM, "prefix_tokens": prefix_tokens, "max_tokens": 1, "connector": connector,
            "settle_after": 1 if settle else -1,
            "prompts": [{"question": "Say hello."}] + [{"prefix": True, "question": q} for q in questions]}


def _rows(result: dict[str, Any], measured: int) -> list[dict[str, Any]]:
    return list(result["prompts"][-measured:])


def _mode(rounds: list[list[dict[str, Any]]], start_s: list[float]) -> dict[str, Any]:
    rows = [r for one in rounds for r in one]
    return {"ttft_s": statistics.median(r["ttft_s"] for r in rows),
            "ttft_s_each": [r["ttft_s"] for r in rows],
            "ttft_s_rounds": [statistics.median(r["ttft_s"] for r in one) for one in rounds],
            "tokens_loaded": statistics.median(r["tokens_loaded"] for r in rows),
            "prompt_tokens": rows[0]["prompt_tokens"], "engine_start_s": statistics.median(start_s)}


#: The loading modes, in the order of an even round (an odd one runs ExampleConnector last).
LOADING = ("example_connector", "tierkv_dram", "tierkv_nvme", "tierkv_nvme_page_cache")


def engine_runs(rounds: int) -> int:
    """Engine processes a run starts (a progress bar's steps)."""
    return 1 + len(LOADING) * rounds


def run_vllm_bench(env: VllmEnv, work: Path, *, prefix_tokens: int = 2048, requests: int = 5, rounds: int = 2,
                   step: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Run the modes in ``work``; the JSON report. ``step()`` after each engine run.

    The machine's speed drifts by tens of percent over minutes (shared cores), so the
    loading modes run in ``rounds`` rounds, each mode a new engine per round, the order
    rotated from round to round; a mode's figure is the median over all its requests.
    """
    if not 1 <= requests <= len(QUESTIONS) - 1:
        raise InputError(f"tierkv bench vllm measures 1 to {len(QUESTIONS) - 1} requests per mode (--runs), "
                         f"got {requests}")
    if not 1 <= rounds <= 8:
        raise InputError(f"tierkv bench vllm runs 1 to 8 rounds of its modes, got {rounds}")
    qs = list(QUESTIONS[: requests + 1])
    first, rest = qs[:1], qs[1:]
    res = run_chat(env, _spec(prefix_tokens, rest, {}), work, "recompute", None)
    modes: dict[str, Any] = {"recompute": _mode([_rows(res, requests)], [res["engine_start_s"]])}
    step()
    got: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in LOADING}
    starts: dict[str, list[float]] = {m: [] for m in LOADING}
    cfg = work / "store.toml"
    for r in range(rounds):
        store = work / f"store-{r}"   # each round from an empty store: its tierkv_dram run stores the pages
        shutil.rmtree(store, ignore_errors=True)
        # tierkv's modes in their order (the NVMe ones read what tierkv_dram stored);
        # ExampleConnector first in even rounds, last in odd ones.
        order = LOADING if r % 2 == 0 else LOADING[1:] + LOADING[:1]
        for mode in order:
            if mode == "example_connector":
                example = work / "example-kv"
                shutil.rmtree(example, ignore_errors=True)
                res = run_chat(env, _spec(prefix_tokens, first + rest, {"example_connector": str(example)}), work,
                               "example", None)
            else:
                dram = mode == "tierkv_dram"
                cfg.write_text(store_config(store, promote=dram, o_direct=mode != "tierkv_nvme_page_cache"))
                with Daemon(cfg, work / "daemon.log") as d:
                    res = run_chat(env, _spec(prefix_tokens, first + rest if dram else rest, {}, settle=dram), work,
                                   mode, d.socket)
            got[mode].append(_rows(res, requests))
            starts[mode].append(res["engine_start_s"])
            step()
    for mode in LOADING:
        modes[mode] = _mode(got[mode], starts[mode])

    def ratio(a: str, b: str) -> float:
        return modes[a]["ttft_s"] / modes[b]["ttft_s"] if modes[b]["ttft_s"] else float("inf")

    # A loading mode that loaded less than the prefix measured recompute, not a load: the
    # run is not valid (the CLI exits 1).
    loaded = all(min(r["tokens_loaded"] for one in got[m] for r in one) >= prefix_tokens // 128 * 128
                 for m in LOADING)
    return {"prefix_tokens": prefix_tokens, "requests": requests, "rounds": rounds, "modes": modes,
            "verified": loaded,
            "ttft_dram_vs_recompute": ratio("tierkv_dram", "recompute"),
            "ttft_nvme_vs_recompute": ratio("tierkv_nvme", "recompute"),
            "ttft_dram_vs_example_connector": ratio("tierkv_dram", "example_connector"),
            "ttft_nvme_vs_example_connector": ratio("tierkv_nvme", "example_connector"),
            "ttft_nvme_page_cache_vs_example_connector": ratio("tierkv_nvme_page_cache", "example_connector"),
            "example_connector_vs_recompute": ratio("example_connector", "recompute")}
