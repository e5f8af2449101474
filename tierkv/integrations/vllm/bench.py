"""``tierkv bench vllm``: time to first token in a real vLLM engine, recompute vs loading.

Every request is one shared prefix of ``prefix_tokens`` tokens (2,048 by default) and a
question of its own. Modes, each an engine of its own:

- ``recompute``: no connector; every request computes the whole prefix;
- ``example_connector``: vLLM's own ``ExampleConnector`` (KV files in a folder, read
  back through the page cache), after one request stored the prefix;
- ``tierkv_dram``: tierkv, after one request stored the prefix (the run waits until its
  pages have landed: the connector stores them in the background): pages from the
  daemon's DRAM;
- ``tierkv_nvme``: the same, then the daemon restarted (its DRAM gone) with
  ``promote_on_hit`` off: every request's pages come from the NVMe tier (O_DIRECT reads:
  the device's speed); the engine reconnects;
- ``tierkv_nvme_page_cache``: the same with the NVMe tier's ``o_direct`` off, so that its
  reads come through the page cache, as ExampleConnector's do (like for like).

All engines live at once in one process (:func:`tierkv.integrations.vllm.run.paired`;
each tierkv mode with a daemon of its own), and the measured requests go round them:
round r sends the round's question to every engine, the order rotated by one each
round. This machine's speed drifts by tens of percent over minutes (shared cores); with
one engine per mode after another, the drift moved whichever mode ran last (the same
mode measured 36% apart minutes later), where interleaved it moves every mode alike.
Each engine first runs a short unrelated prompt (its first forward pass is slow) and,
for the loading modes, stores the prefix and loads it once unmeasured. A mode reports
the median TTFT vLLM measured over its requests (recompute: ``recompute_requests`` of
them, 4-5 s each) and the median tokens it did not compute (``num_cached_tokens``;
vLLM's prefix cache is off); the tierkv modes also their ratio to ExampleConnector
round by round (``vs_example_connector_rounds``: the spread). The headline ratios are
median against median, against recompute and against ExampleConnector.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierkv.errors import InputError
from tierkv.integrations.vllm.demo import SYSTEM
from tierkv.integrations.vllm.session import VllmEnv, run_chat, store_config

QUESTIONS = ("What does a tiered store keep?", "Why does loading beat recomputing?", "What names a page?",
             "What happens to a corrupt page?", "Why can tenants not share pages?", "What survives a restart?",
             "What does a lookup cost?")

#: The modes, in the order their engines start (and of the first round).
MODES = ("recompute", "example_connector", "tierkv_dram", "tierkv_nvme", "tierkv_nvme_page_cache")
MAX_REQUESTS = 32


def steps(requests: int) -> int:
    """Steps a run reports (a progress bar's): each engine started, then each round."""
    return len(MODES) + requests


def _engines(work: Path, requests: int, recompute_requests: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": "recompute", "requests": min(requests, recompute_requests)},
                                 {"name": "example_connector", "fill": True,
                                  "connector": {"example_connector": str(work / "example-kv")}}]
    for name, promote, o_direct in (("tierkv_dram", True, True), ("tierkv_nvme", False, True),
                                    ("tierkv_nvme_page_cache", False, False)):
        cfg = work / f"{name}.toml"
        cfg.write_text(store_config(work / name, dram="256MiB", nvme="512MiB", promote=promote, o_direct=o_direct))
        out.append({"name": name, "fill": True, "restart": name != "tierkv_dram",
                    "daemon": {"config": str(cfg), "log": str(work / f"{name}.daemon.log")}})
    return out


def run_vllm_bench(env: VllmEnv, work: Path, *, prefix_tokens: int = 2048, requests: int = 10,
                   recompute_requests: int = 3, step: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Run the modes in ``work`` (which must hold no earlier run's stores); the JSON report.
    ``step()`` after each engine start and each round."""
    if not 1 <= requests <= MAX_REQUESTS:
        raise InputError(f"tierkv bench vllm measures 1 to {MAX_REQUESTS} requests per mode (--runs), got {requests}")
    if not 1 <= recompute_requests:
        raise InputError(f"recompute_requests must be >= 1, got {recompute_requests}")
    if any((work / m).exists() for m in MODES) or (work / "example-kv").exists():
        raise InputError(f"{work} holds an earlier run's stores: give tierkv bench vllm an empty --dir")
    spec = {"prefix_text": SYSTEM, "prefix_tokens": prefix_tokens, "questions": list(QUESTIONS),
            "requests": requests, "engines": _engines(work, requests, recompute_requests)}
    res = run_chat(env, spec, work, "bench", None, timeout_s=1800.0, step=step)["engines"]
    example = {r["round"]: r["ttft_s"] for r in res["example_connector"]["prompts"]}
    modes: dict[str, Any] = {}
    for name in MODES:
        rows = res[name]["prompts"]
        modes[name] = {"ttft_s": statistics.median(r["ttft_s"] for r in rows),
                       "ttft_s_each": [r["ttft_s"] for r in rows],
                       "tokens_loaded": statistics.median(r["tokens_loaded"] for r in rows),
                       "prompt_tokens": rows[0]["prompt_tokens"], "engine_start_s": res[name]["engine_start_s"]}
        if name.startswith("tierkv"):
            modes[name]["vs_example_connector_rounds"] = [round(r["ttft_s"] / example[r["round"]], 3)
                                                          for r in rows if example.get(r["round"])]

    def ratio(a: str, b: str) -> float:
        return modes[a]["ttft_s"] / modes[b]["ttft_s"] if modes[b]["ttft_s"] else float("inf")

    # A loading mode that loaded less than the prefix measured recompute, not a load: the
    # run is not valid (the CLI exits 1).
    loaded = all(min(r["tokens_loaded"] for r in res[m]["prompts"]) >= prefix_tokens // 128 * 128
                 for m in MODES[1:])
    return {"prefix_tokens": prefix_tokens, "requests": requests, "interleaved": True, "modes": modes,
            "verified": loaded,
            "ttft_dram_vs_recompute": ratio("tierkv_dram", "recompute"),
            "ttft_nvme_vs_recompute": ratio("tierkv_nvme", "recompute"),
            "ttft_dram_vs_example_connector": ratio("tierkv_dram", "example_connector"),
            "ttft_nvme_vs_example_connector": ratio("tierkv_nvme", "example_connector"),
            "ttft_nvme_page_cache_vs_example_connector": ratio("tierkv_nvme_page_cache", "example_connector"),
            "example_connector_vs_recompute": ratio("example_connector", "recompute")}
