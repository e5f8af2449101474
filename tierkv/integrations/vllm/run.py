"""One vLLM engine process running a multi-turn chat, with or without the tierkv connector.

Run with the Python that has vLLM (``tierkv demo --engine vllm`` and ``tierkv bench vllm``
start it, :mod:`tierkv.integrations.vllm.session`)::

    python -m tierkv.integrations.vllm.run --model DIR --chat chat.json [--socket S] --out result.json

``chat.json``: ``{"system": str, "turns": [str, ...], "max_tokens": int, "salt": str,
"block_size": int, "await_saves": bool}`` (``await_saves``: before each next turn, wait
until the store holds the pages of the turn's prompt, ``save_wait_s`` in its result)
(or ``{"prompts": [[token ids], ...]}``: :func:`prompts`; or ``{"engines": [...]}``:
:func:`paired`, several engines at once, for ``tierkv bench vllm``).
Every turn's prompt is the previous prompt, the previous answer and the new user message
as token ids (no re-tokenising, so a turn's pages are the previous turn's plus new ones).
Generation is greedy. Per turn the result holds the answer's token ids, vLLM's own count
of prompt tokens it did not compute (``RequestOutput.num_cached_tokens``: with vLLM's
prefix cache off, exactly the tokens the connector loaded), the time to first token vLLM
measured, and the store's hits by tier over the turn (read from the daemon).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _tier_hits(socket: str | None) -> dict[str, int]:
    if not socket:
        return {}
    from tierkv.serve.client import RemoteStore

    with RemoteStore(socket) as store:
        return {t.kind: t.hits for t in store.stats().tiers.values()}


def _engine(model: str, served: str, socket: str | None, max_model_len: int, extra: dict[str, Any],
            prefix_caching: bool = False, chunk: int | None = None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    if extra.get("example_connector"):   # vLLM's own ExampleConnector (KV files in a folder), for comparison
        ktc = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                               kv_connector_extra_config={"shared_storage_path": extra["example_connector"]})
    elif socket:
        ktc = KVTransferConfig(kv_connector="TierKVConnector", kv_role="kv_both",
                               kv_connector_module_path="tierkv.integrations.vllm.connector",
                               kv_load_failure_policy="recompute",
                               kv_connector_extra_config={"tierkv_socket": socket, **extra})
    return LLM(model=model, served_model_name=served, dtype="bfloat16", max_model_len=max_model_len, enforce_eager=True,
               enable_prefix_caching=prefix_caching, disable_log_stats=False, kv_transfer_config=ktc, seed=0,
               **({"max_num_batched_tokens": chunk, "enable_chunked_prefill": True} if chunk else {}))


def chat(model: str, served: str, spec: dict[str, Any], socket: str | None, max_model_len: int = 4096,
         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the chat ``spec`` in a new engine; the result as a JSON-ready dict."""
    from vllm import SamplingParams

    t0 = time.perf_counter()
    extra = {**(extra or {}), **spec.get("connector", {})}
    llm = _engine(model, served, socket, max_model_len, extra, bool(spec.get("prefix_caching")),
                  spec.get("chunk"))
    tok = llm.get_tokenizer()
    started = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=int(spec.get("max_tokens", 32)))
    salt = spec.get("salt") or None
    text = tok.apply_chat_template([{"role": "system", "content": spec["system"]},
                                    {"role": "user", "content": spec["turns"][0]}],
                                   tokenize=False, add_generation_prompt=True)
    prompt: list[int] = list(tok.encode(text, add_special_tokens=False))
    answer: list[int] = []
    turns = []
    for i, _message in enumerate(spec["turns"]):
        if i:
            nxt = f"<|im_end|>\n<|im_start|>user\n{spec['turns'][i]}<|im_end|>\n<|im_start|>assistant\n"
            prompt = prompt + answer + tok.encode(nxt, add_special_tokens=False)
        before = _tier_hits(socket)
        req: dict[str, Any] = {"prompt_token_ids": prompt}
        if salt:
            req["cache_salt"] = salt
        out = llm.generate([req], params, use_tqdm=False)[0]
        after = _tier_hits(socket)
        # The pages this turn saved are put in the background: wait for them before the
        # next turn (a user's reply takes longer), so that it finds them whatever the load
        # on the machine (on 2 busy cores a put took up to 1.2 s to land); how long is kept.
        waited = (_await_stored(socket, prompt, int(spec.get("block_size", 128)), salt or "")
                  if socket and spec.get("await_saves") else 0.0)
        answer = [t for t in out.outputs[0].token_ids if t != tok.eos_token_id]
        metrics = out.metrics
        turns.append({
            "save_wait_s": waited,
            "prompt_tokens": len(prompt),
            "answer_ids": list(out.outputs[0].token_ids),
            "answer": out.outputs[0].text,
            "tokens_loaded": int(out.num_cached_tokens or 0),
            "ttft_s": float(getattr(metrics, "first_token_latency", 0.0) or 0.0),
            "store_hits": {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)},
        })
    counters = {m.name: m.value for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits"
                and hasattr(m, "value")}
    return {"engine_start_s": started, "turns": turns,
            "external_prefix_cache_hits": int(counters.get("vllm:external_prefix_cache_hits", 0))}


def _await_stored(socket: str, ids: list[int], block_size: int, tenant: str = "", timeout_s: float = 60.0) -> float:
    """Wait until the store holds every full page of ``ids`` but the last token's (of
    ``tenant``); the seconds waited. The connector stores a request's pages in the
    background, and a request arriving before they land computes its prompt again."""
    from tierkv.serve.client import RemoteStore

    want = (len(ids) - 1) // block_size
    t0 = time.monotonic()
    with RemoteStore(socket) as store:
        while store.lookup(ids[: want * block_size], tenant, count=False).cached_pages < want:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"the store did not get the {want} pages of a prompt in {timeout_s:.0f} s")
            time.sleep(0.005)
    return time.monotonic() - t0


def _prompt_ids(tok: Any, spec: dict[str, Any]) -> list[list[int]]:
    """``spec["prompts"]``, each either token ids or ``{"prefix": True, "question": str}``:
    the shared prefix (``spec["prefix_text"]`` as a system message, repeated and cut to
    exactly ``spec["prefix_tokens"]`` tokens; ``"cut": n`` keeps its first n) followed by
    the question as a user turn."""
    prefix: list[int] = []
    if "prefix_text" in spec:
        text = tok.apply_chat_template([{"role": "system", "content": spec["prefix_text"]}], tokenize=False)
        one = list(tok.encode(text, add_special_tokens=False))
        want = int(spec["prefix_tokens"])
        prefix = (one * (want // len(one) + 1))[:want]
    out = []
    for p in spec["prompts"]:
        if isinstance(p, dict):
            q = f"<|im_start|>user\n{p['question']}<|im_end|>\n<|im_start|>assistant\n"
            head = prefix[: int(p.get("cut", len(prefix)))] if p.get("prefix") else []
            out.append(head + list(tok.encode(q, add_special_tokens=False)))
        else:
            out.append(list(p))
    return out


def prompts(model: str, served: str, spec: dict[str, Any], socket: str | None,
            max_model_len: int = 4096) -> dict[str, Any]:
    """Run ``spec["prompts"]`` (token-id lists) one at a time in a new engine: per prompt
    its time to first token and the tokens vLLM did not compute (``tierkv bench vllm``)."""
    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm = _engine(model, served, socket, max_model_len, dict(spec.get("connector", {})),
                  bool(spec.get("prefix_caching")), spec.get("chunk"))
    started = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=int(spec.get("max_tokens", 1)))
    rows = []
    settle = int(spec.get("settle_after", -1))
    for i, ids in enumerate(_prompt_ids(llm.get_tokenizer(), spec)):
        out = llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)[0]
        if i == settle and socket:
            _await_stored(socket, ids, int(spec.get("block_size", 128)))
        rows.append({"prompt_tokens": len(ids), "tokens_loaded": int(out.num_cached_tokens or 0),
                     "ttft_s": float(getattr(out.metrics, "first_token_latency", 0.0) or 0.0),
                     "answer_ids": list(out.outputs[0].token_ids)})
    return {"engine_start_s": started, "prompts": rows}


def _step(progress: str | None) -> None:
    """One step done (``tierkv bench vllm``'s bar counts the bytes of this file)."""
    if progress:
        with open(progress, "ab") as f:
            f.write(b".")


def paired(model: str, served: str, spec: dict[str, Any], max_model_len: int = 4096,
           progress: str | None = None) -> dict[str, Any]:
    """Engines of several modes alive at once in this process, measured requests
    alternating between them (``tierkv bench vllm``): the machine's drift over minutes
    then moves every mode alike instead of whichever ran last.

    ``spec["engines"]``: ``{"name", "connector": {...}, "daemon": {"config", "log"} | None,
    "restart": bool, "fill": bool, "requests": int}``, started in order; each runs a short
    warm-up prompt, then (``fill``) one prefix request whose pages it stores (waiting,
    for a daemon, until they landed; ``restart``: the daemon is then restarted, its DRAM
    gone, the engine reconnecting), then one unmeasured prefix request (the load path's
    first use). Then ``spec["requests"]`` rounds, each a prefix request with the round's
    question (``spec["questions"]``, cycled) on every engine, the order rotated by one
    each round; an engine with its own smaller ``requests`` sits out later rounds. Per
    engine: its start time and its measured rows, each with its round."""
    from vllm import SamplingParams

    from tierkv.integrations.vllm.session import Daemon

    params = SamplingParams(temperature=0.0, max_tokens=1)
    questions = list(spec["questions"])
    engines: list[dict[str, Any]] = []
    daemons: list[Daemon] = []
    try:
        for e in spec["engines"]:
            daemon = None
            if e.get("daemon"):
                daemon = Daemon(Path(e["daemon"]["config"]), Path(e["daemon"]["log"])).start()
                daemons.append(daemon)
            t0 = time.perf_counter()
            llm = _engine(model, served, daemon.socket if daemon else None, max_model_len, dict(e.get("connector", {})))
            started = time.perf_counter() - t0
            ids = _prompt_ids(llm.get_tokenizer(), {**spec, "prompts": [{"question": "Say hello."}] + [
                {"prefix": True, "question": q} for q in ["Fill the store.", "Load it once.", *questions]]})
            llm.generate([{"prompt_token_ids": ids[0]}], params, use_tqdm=False)
            if e.get("fill"):
                llm.generate([{"prompt_token_ids": ids[1]}], params, use_tqdm=False)
                if daemon is not None:
                    _await_stored(daemon.socket, ids[1], int(spec.get("block_size", 128)))
                    if e.get("restart"):
                        daemon.stop()
                        daemon.start()
                llm.generate([{"prompt_token_ids": ids[2]}], params, use_tqdm=False)
            engines.append({"name": e["name"], "llm": llm, "ids": ids[3:], "start_s": started, "rows": [],
                            "requests": int(e.get("requests", spec["requests"]))})
            _step(progress)
        for r in range(int(spec["requests"])):
            order = engines[r % len(engines):] + engines[: r % len(engines)]
            for eng in order:
                if r >= eng["requests"]:
                    continue
                ids = eng["ids"][r % len(questions)]
                out = eng["llm"].generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
                eng["rows"].append({"round": r, "prompt_tokens": len(ids),
                                    "tokens_loaded": int(out.num_cached_tokens or 0),
                                    "ttft_s": float(getattr(out.metrics, "first_token_latency", 0.0) or 0.0)})
            _step(progress)
    finally:
        for d in daemons:
            d.stop()
    return {"engines": {e["name"]: {"engine_start_s": e["start_s"], "prompts": e["rows"]} for e in engines}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--chat", required=True, help="the chat spec (JSON file)")
    ap.add_argument("--served-name", default=None, help="the model's name (the store's model_id); default --model")
    ap.add_argument("--socket", default=None, help="the tierkv daemon's socket; none: no connector")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", required=True)
    ap.add_argument("--progress", default=None, help="a file that gets one byte per step done (paired runs)")
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.chat).read_text())
    if "engines" in spec:
        Path(args.out).write_text(json.dumps(paired(args.model, args.served_name or args.model, spec,
                                                    args.max_model_len, args.progress)))
        return 0
    if "prompts" in spec:
        Path(args.out).write_text(json.dumps(prompts(args.model, args.served_name or args.model, spec, args.socket,
                                                     args.max_model_len)))
        return 0
    result = chat(args.model, args.served_name or args.model, spec, args.socket, args.max_model_len)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
