"""``tierkv bench vllm``: time to first token in a real vLLM engine, recompute vs loading.

Every request is one shared prefix of ``prefix_tokens`` tokens (2,048 by default) and a
question of its own. Four engine processes, one mode each, in one run:

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
``requests`` measured ones; a mode reports the median TTFT vLLM measured and the median
tokens it did not compute (``num_cached_tokens``; vLLM's prefix cache is off). The
ratios are against recompute and against ExampleConnector in the same run.
"""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _mode(result: dict[str, Any], measured: int) -> dict[str, Any]:
    rows = result["prompts"][-measured:]
    return {"ttft_s": statistics.median(r["ttft_s"] for r in rows),
            "ttft_s_each": [r["ttft_s"] for r in rows],
            "tokens_loaded": statistics.median(r["tokens_loaded"] for r in rows),
            "prompt_tokens": rows[0]["prompt_tokens"], "engine_start_s": result["engine_start_s"]}


#: Engine processes one run starts (a progress bar's steps).
ENGINE_RUNS = 5


def run_vllm_bench(env: VllmEnv, work: Path, *, prefix_tokens: int = 2048, requests: int = 3,
                   step: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Run the modes in ``work``; the JSON report. ``step()`` after each engine run."""
    qs = list(QUESTIONS[: requests + 1])
    first, rest = qs[:1], qs[1:]
    modes: dict[str, Any] = {}
    modes["recompute"] = _mode(run_chat(env, _spec(prefix_tokens, rest, {}), work, "recompute", None), requests)
    step()
    example = work / "example-kv"
    shutil.rmtree(example, ignore_errors=True)
    res = run_chat(env, _spec(prefix_tokens, first + rest, {"example_connector": str(example)}), work, "example", None)
    modes["example_connector"] = _mode(res, requests)
    step()
    cfg = work / "store.toml"
    cfg.write_text(store_config(work / "store"))
    with Daemon(cfg, work / "daemon.log") as d:
        res = run_chat(env, _spec(prefix_tokens, first + rest, {}, settle=True), work, "tierkv_dram", d.socket)
    modes["tierkv_dram"] = _mode(res, requests)
    step()
    cfg.write_text(store_config(work / "store", promote=False))
    with Daemon(cfg, work / "daemon.log") as d:
        res = run_chat(env, _spec(prefix_tokens, rest, {}), work, "tierkv_nvme", d.socket)
    modes["tierkv_nvme"] = _mode(res, requests)
    step()
    cfg.write_text(store_config(work / "store", promote=False, o_direct=False))
    with Daemon(cfg, work / "daemon.log") as d:
        res = run_chat(env, _spec(prefix_tokens, rest, {}), work, "tierkv_nvme_page_cache", d.socket)
    modes["tierkv_nvme_page_cache"] = _mode(res, requests)
    step()

    def ratio(a: str, b: str) -> float:
        return modes[a]["ttft_s"] / modes[b]["ttft_s"] if modes[b]["ttft_s"] else float("inf")

    # A loading mode that loaded less than the prefix measured recompute, not a load: the
    # run is not valid (the CLI exits 1).
    loaded = all(m["tokens_loaded"] >= prefix_tokens // 128 * 128 for k, m in modes.items() if k != "recompute")
    return {"prefix_tokens": prefix_tokens, "requests": requests, "modes": modes, "verified": loaded,
            "ttft_dram_vs_recompute": ratio("tierkv_dram", "recompute"),
            "ttft_nvme_vs_recompute": ratio("tierkv_nvme", "recompute"),
            "ttft_dram_vs_example_connector": ratio("tierkv_dram", "example_connector"),
            "ttft_nvme_vs_example_connector": ratio("tierkv_nvme", "example_connector"),
            "ttft_nvme_page_cache_vs_example_connector": ratio("tierkv_nvme_page_cache", "example_connector"),
            "example_connector_vs_recompute": ratio("example_connector", "recompute")}
