"""``tierkv bench lossy``: what lossy pages cost in quality, on SmolLM2-135M (transformers, CPU).

A held text (docstrings of Python's standard library, :data:`HELD_MODULES`,
``--context`` tokens, so nothing is downloaded and the text is the same on every
machine; ``--text FILE``: a text of the caller's, for a measurement on what the caller
serves) is prefilled; its KV, rounded to BF16 as the store holds it, is cut into
pages of ``--page-tokens`` tokens, each coded at every budget (average bits per element,
headers and parameters included) twice: with the rate-distortion allocation
(:func:`tierkv.lossy.alloc.allocate`: importance from the scoring pass, sensitivities
from a calibration measured in the same run on *another* text), the same keeping every
token (``evict=False``: what an engine with paged attention can use) and the uniform
one (:func:`~tierkv.lossy.alloc.uniform`), stored in a DRAM store as lossy pages
(one tenant per allocation) and got back through it (``get(..., accept_lossy=budget)``);
and, as a lossy tier converts them (``tier_``: flat importance, the calibration, no
eviction), put exact into a store whose NVMe tier sets ``lossy_bits`` to the budget,
pushed down, converted there and got back the same way. Each
decoded cache then predicts the text that follows (``--continuation`` tokens,
teacher-forced NLL per token) and the lossless cache's greedy continuation
(``--generate`` tokens, teacher-forced top-1 agreement). Reported per budget:
``delta_nll``, ``no_evict_delta_nll``, ``tier_delta_nll`` and ``uniform_delta_nll`` (nats
per token over the lossless BF16 cache), the same ``agreement`` fields, ``bytes_ratio``
(blob bytes over the BF16 pages'; ``tier_bytes_ratio``: the NVMe tier's used 4 KiB
blocks) and ``kept_fraction`` (tokens not evicted).
"""

from __future__ import annotations

import ast
import hashlib
import platform
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tierkv.config import DramConfig, NvmeConfig, StoreConfig
from tierkv.errors import InputError
from tierkv.layout import KVLayout
from tierkv.lossy.alloc import allocate, uniform
from tierkv.lossy.format import encode
from tierkv.store.api import Store
from tierkv.tiers.base import TierId

DEFAULT_BUDGETS = (2.5, 3.0, 4.0, 8.0)


#: Modules of Python's standard library whose docstrings are the texts (stable for a
#: Python version, installed everywhere tierkv runs, nothing downloaded): calibration, held.
CALIBRATION_MODULES = ("socketserver.py", "statistics.py", "argparse.py", "json/__init__.py")
HELD_MODULES = ("http/client.py", "pydoc.py", "unittest/__init__.py", "heapq.py", "io.py", "ssl.py", "sched.py",
                "uuid.py", "urllib/parse.py", "doctest.py")


def docstring_text(first_half: bool) -> str:
    """The docstrings of :data:`CALIBRATION_MODULES` (``first_half``) or
    :data:`HELD_MODULES`, joined: English prose about code, the same on every machine
    with this Python version (tierkv's own docstrings change with every commit)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for name in CALIBRATION_MODULES if first_half else HELD_MODULES:
        try:
            doc = ast.get_docstring(ast.parse((root / name).read_text()))
        except (OSError, SyntaxError, UnicodeDecodeError) as exc:
            raise ValueError(f"the lossy benchmark's text is Python's {name} docstring, which cannot be read here "
                             f"({exc}): its figures would not compare with others'") from None
        docs.append(doc or "")
    return "\n\n".join(docs)


def code_cache(kv: np.ndarray, budget: float, page_tokens: int, mode: str, importance: Any,
               calibration: Any, store: Any, prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``kv`` ([L, 2, N, H, D], BF16 values) coded page by page at ``budget`` with the
    ``mode``'s allocation, stored in ``store`` as lossy pages of ``prompt`` (a tenant per
    mode) and got back through it (``accept_lossy``): the decoded KV, which tokens are
    kept, and the blobs' bytes."""
    from tierkv.lossy.alloc import Importance
    from tierkv.store.lossy_pages import put_coded, to_float
    from tierkv.tiers.blocks import lossy_length

    L, _, N, H, D = kv.shape
    n = N // page_tokens
    rows = np.zeros((n, store.layout.page_bytes), np.uint8)
    for i in range(n):
        sl = slice(i * page_tokens, (i + 1) * page_tokens)
        page = kv[:, :, sl]
        if mode in ("rd", "rd_keep"):
            imp = Importance(importance.a2[:, :, sl], importance.qe)
            alloc = allocate(page, budget, imp, calibration, evict=mode == "rd")
        else:
            alloc = uniform(page.shape, budget)
        blob = encode(page, alloc, "bf16", budget)
        rows[i, :len(blob)] = np.frombuffer(blob, np.uint8)
    size = sum(lossy_length(r) for r in rows)
    tenant = f"bench-{mode}"
    put_coded(store, prompt, rows, tenant, budget)
    out = np.zeros_like(rows)
    got = store.get(prompt, out, tenant, accept_lossy=budget)
    if got.lossy != n or got.evicted is None:
        raise RuntimeError(f"the store returned {got.lossy} of {n} lossy pages")
    pages = to_float(out, "bf16", store.layout.page_shape)            # [n, L, 2, T, H, D]
    dec = pages.transpose(1, 2, 0, 3, 4, 5).reshape(L, 2, N, H, D)
    return dec, ~got.evicted.reshape(-1), size


def through_a_lossy_tier(kv: np.ndarray, budget: float, layout: KVLayout, calibration: Any,
                         prompt: np.ndarray, model_id: str) -> tuple[np.ndarray, np.ndarray, int]:
    """``kv`` put exact into a store of one DRAM page over an NVMe tier with ``lossy_bits
    = budget``, pushed down, converted there and got back: as :func:`code_cache`, the
    bytes being the tier's used blocks."""
    from tierkv.store.lossy_pages import from_float, to_float

    L, _, N, H, D = kv.shape
    T = layout.tokens_per_page
    n = N // T
    pages = kv.reshape(L, 2, n, T, H, D).transpose(2, 0, 1, 3, 4, 5)
    rows = np.stack([from_float(np.ascontiguousarray(p), "bf16") for p in pages])
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-lossy-tier-") as where:
        cal_path = Path(where) / "calibration.json"
        calibration.save(cal_path)
        cfg = StoreConfig(path=where, model_id=model_id, layout=layout, dram=DramConfig(layout.page_bytes),
                          nvme=NvmeConfig(2 * n * layout.page_bytes, codec="lossless", lossy_bits=budget,
                                          lossy_calibration=str(cal_path)))
        with Store.open(cfg) as store:
            store.put(prompt, rows)
            store.put(np.full(T, 1, np.int64), rows[:1])     # pushes the prompt's first page down
            if store.wait_converted(600.0):
                raise RuntimeError("the lossy tier did not convert the prompt's pages in 10 minutes")
            out = np.zeros_like(rows)
            got = store.get(prompt, out, accept_lossy=budget)
            if got.lossy != n or got.evicted is None:
                raise RuntimeError(f"the store returned {got.lossy} of {n} pages lossy")
            size = store._manager.tier(TierId("nvme")).used_bytes   # type: ignore[attr-defined]  # a BlockPageTier
    dec = to_float(out, "bf16", layout.page_shape).transpose(1, 2, 0, 3, 4, 5).reshape(L, 2, N, H, D)
    return dec, ~got.evicted.reshape(-1), size


def run_lossy_bench(budgets: Sequence[float] = DEFAULT_BUDGETS, context: int = 1024, continuation: int = 256,
                    generate: int = 64, page_tokens: int = 128,
                    say: Callable[[str], None] = lambda _m: None, held_text: str | None = None,
                    text_name: str = "") -> dict[str, Any]:
    """The benchmark (module docstring); ``held_text``: another held text than the
    standard library's docstrings (``text_name`` names it in the result)."""
    from tierkv.integrations import smollm2
    from tierkv.lossy import scoring

    if context % page_tokens:
        raise ValueError(f"--context must be whole pages of --page-tokens ({page_tokens}), got {context}")
    t0 = time.perf_counter()
    say("loading SmolLM2-135M (fp32)")
    lm = smollm2.load("fp32")
    model, tok = lm.model, lm.tokenizer
    cal_ids = np.array(tok.encode(docstring_text(True), add_special_tokens=False), np.int64)
    held = docstring_text(False) if held_text is None else held_text
    held_ids = np.array(tok.encode(held, add_special_tokens=False), np.int64)
    need = context + continuation
    if held_text is not None and held_ids.size < need:
        raise InputError(f"--text {text_name} is {held_ids.size} tokens; the bench needs {need} (--context "
                         f"{context} and a continuation of {continuation})")
    if cal_ids.size < need or held_ids.size < need:
        raise ValueError(f"the calibration and held texts are {cal_ids.size} and {held_ids.size} tokens; the bench "
                         f"needs {need} of each")
    say("calibrating per-layer sensitivities on the calibration text")
    cal = scoring.calibrate(model, cal_ids[:context], cal_ids[context:need], model_id=smollm2.MODEL_ID,
                            page_tokens=page_tokens)
    say(f"prefilling and scoring {context} tokens of the held text")
    prompt, follow = held_ids[:context], held_ids[context:need]
    pre = scoring.prefill(model, prompt)
    kv = pre.kv
    L, _, N, H, D = kv.shape
    all_kept = np.ones(N, bool)
    first = int(pre.last_logits.argmax())
    gen = scoring.greedy(model, kv, first, generate + 1)
    nll_ref = scoring.nll(model, kv, all_kept, follow)
    bf16_bytes = kv.size * 2
    layout = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="bf16", tokens_per_page=page_tokens)
    where = tempfile.TemporaryDirectory(prefix="tierkv-bench-lossy-")
    store = Store.open(StoreConfig(path=where.name, model_id=smollm2.MODEL_ID, layout=layout,
                                   dram=DramConfig(N // page_tokens * layout.page_bytes), policy="lru"))
    rows: dict[str, list[Any]] = {k: [] for k in (
        "delta_nll", "agreement", "bytes_ratio", "kept_fraction",
        "no_evict_delta_nll", "no_evict_agreement", "no_evict_bytes_ratio",
        "tier_delta_nll", "tier_agreement", "tier_bytes_ratio",
        "uniform_delta_nll", "uniform_agreement", "uniform_bytes_ratio")}
    prefixes = {"rd": "", "rd_keep": "no_evict_", "tier": "tier_", "uniform": "uniform_"}
    with where, store:
        for budget in budgets:
            for mode, pre_ in prefixes.items():
                if mode == "tier":
                    say(f"budget {budget} bits per element, converted by a lossy NVMe tier")
                    dec, kept, size = through_a_lossy_tier(kv, budget, layout, cal, prompt, smollm2.MODEL_ID)
                else:
                    say(f"budget {budget} bits per element, {mode} allocation, through a store")
                    dec, kept, size = code_cache(kv, budget, page_tokens, mode, pre.importance, cal, store, prompt)
                d_nll = scoring.nll(model, dec, kept, follow) - nll_ref
                agree = scoring.agreement(model, dec, kept, gen)
                rows[pre_ + "delta_nll"].append(round(d_nll, 4))
                rows[pre_ + "agreement"].append(round(agree, 4))
                rows[pre_ + "bytes_ratio"].append(round(size / bf16_bytes, 4))
                if mode == "rd":
                    rows["kept_fraction"].append(round(float(kept.mean()), 4))
    text = "stdlib docstrings" if held_text is None else \
        f"{text_name} (sha256 {hashlib.sha256(held_text.encode()).hexdigest()[:12]})"
    return {"model": smollm2.MODEL_ID, "python": platform.python_version(), "text": text,
            "context_tokens": context, "continuation_tokens": continuation,
            "generated_tokens": generate, "page_tokens": page_tokens, "budgets": list(budgets),
            "nll_lossless": round(nll_ref, 4), **rows,
            "calibration_key": [round(x, 6) for x in cal.key], "calibration_value": [round(x, 6) for x in cal.value],
            "seconds": round(time.perf_counter() - t0, 1)}
