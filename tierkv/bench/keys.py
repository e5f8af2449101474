"""Benchmark of page keys plus index lookup against a chained-sha256 baseline.

Measures, in the same run and on the same tokens, (a) tierkv: validating the prompt
(:func:`tierkv.keys.as_token_array`), chaining its page keys (:func:`tierkv.keys.chain_keys`)
and scanning them with ``prefix_len`` against a key set holding every one of them; and
(b) the baseline a serving engine would write by hand: ``sha256(prev_digest + page_bytes)``
in a Python loop plus a dict prefix scan. The full-hit case is the worst case for a scan.
The headline ``keys_vs_sha256`` is taken through the public API (``Store.lookup`` on a
store holding every page of the prompt), so validation, the chain, the scan and the
per-tier result all count; the component times are reported beside it.
Called by ``tierkv bench``; timing claims live here, not in tests.
"""

from __future__ import annotations

import hashlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from tierkv.store.api import LookupResult, Store
from tierkv.config import DramConfig, StoreConfig
from tierkv.errors import InputError, TierKVError
from tierkv.keys import as_token_array, chain_keys, namespace_digest, native_available, new_keyset
from tierkv.layout import DType, KVLayout

_VOCAB = 128_000  # token ids drawn below a typical vocabulary size


def _sha256_chain(raw: bytes, step: int, n_pages: int, seed: bytes) -> list[bytes]:
    sha = hashlib.sha256
    prev = seed
    out = []
    for i in range(n_pages):
        prev = sha(prev + raw[i * step:(i + 1) * step]).digest()
        out.append(prev)
    return out


def _dict_prefix_len(index: dict[bytes, int], keys: list[bytes]) -> int:
    n = 0
    for key in keys:
        if key not in index:
            break
        n += 1
    return n


@contextmanager
def _full_store(tokens: np.ndarray, tokens_per_page: int) -> Iterator[tuple[Store, Callable[[], LookupResult]]]:
    """A DRAM-only store holding every page of ``tokens`` (pages of a tiny layout: the
    lookup's cost does not depend on page size), and a call that looks the prompt up."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=DType.BF16, tokens_per_page=tokens_per_page)
    n_pages = tokens.size // tokens_per_page
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-keys-") as tmp:
        cfg = StoreConfig(path=tmp, model_id="bench/model", layout=layout,
                          dram=DramConfig(n_pages * layout.page_bytes))
        with Store.open(cfg) as store:
            store.put(tokens, np.zeros((n_pages, layout.page_bytes), dtype=np.uint8))
            yield store, lambda: store.lookup(tokens)


def _ms(ns: int) -> float:
    return ns / 1e6


def bench_keys(prompt_tokens: int = 131072, tokens_per_page: int = 16, runs: int = 5) -> dict[str, float | int | bool]:
    """Times keys + lookup of one prompt, tierkv against chained sha256; medians of ``runs``.

    Returns times in milliseconds (``tierkv_keys_ms``, ``tierkv_lookup_ms``, ``tierkv_ms``,
    ``store_lookup_ms``, ``sha256_keys_ms``, ``sha256_lookup_ms``, ``sha256_ms``),
    ``keys_vs_sha256`` (baseline total over ``Store.lookup``), ``components_vs_sha256``
    (baseline total over the bare chain plus scan), ``native`` (whether the compiled chain
    and key set were used) and the sizes. One unrecorded warm-up run precedes the timed ones.
    """
    if prompt_tokens < tokens_per_page or tokens_per_page <= 0 or runs <= 0:
        raise InputError(f"need prompt_tokens >= tokens_per_page > 0 and runs > 0, got "
                         f"{prompt_tokens}, {tokens_per_page}, {runs}")
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_page=tokens_per_page)
    namespace = namespace_digest("bench/model", layout)
    seed = hashlib.sha256(namespace).digest()  # the baseline chains 32-byte digests
    tokens = np.random.default_rng(0).integers(0, _VOCAB, prompt_tokens, dtype=np.uint32)
    n_pages = prompt_tokens // tokens_per_page
    step = tokens_per_page * 4

    keyset = new_keyset()
    blob = chain_keys(as_token_array(tokens), tokens_per_page, namespace)
    for i in range(n_pages):
        keyset.add(blob[i * 16:(i + 1) * 16])
    index = {key: i for i, key in enumerate(
        _sha256_chain(tokens.tobytes(), step, n_pages, seed))}

    timings: dict[str, list[int]] = {name: [] for name in ("tk", "tl", "sk", "sl", "store")}
    with _full_store(tokens, tokens_per_page) as (store, lookup):
        for run in range(runs + 1):
            t0 = time.perf_counter_ns()
            if lookup().cached_pages != n_pages:
                raise TierKVError(f"bench store lost pages of the prompt ({n_pages} stored)")
            if run:
                timings["store"].append(time.perf_counter_ns() - t0)
    for run in range(runs + 1):
        t0 = time.perf_counter_ns()
        blob = chain_keys(as_token_array(tokens), tokens_per_page, namespace)
        t1 = time.perf_counter_ns()
        hit = keyset.prefix_len(blob)
        t2 = time.perf_counter_ns()
        digests = _sha256_chain(tokens.tobytes(), step, n_pages, seed)
        t3 = time.perf_counter_ns()
        base_hit = _dict_prefix_len(index, digests)
        t4 = time.perf_counter_ns()
        if hit != n_pages or base_hit != n_pages:
            raise TierKVError(f"bench expected a full hit of {n_pages} pages, got {hit} (tierkv) "
                              f"and {base_hit} (sha256)")
        if run:  # run 0 warms caches and the allocator
            for name, ns in zip(("tk", "tl", "sk", "sl"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                timings[name].append(ns)

    tierkv_ns = statistics.median(k + lk for k, lk in zip(timings["tk"], timings["tl"]))
    store_ns = statistics.median(timings["store"])
    sha_ns = statistics.median(k + lk for k, lk in zip(timings["sk"], timings["sl"]))
    return {
        "prompt_tokens": prompt_tokens,
        "tokens_per_page": tokens_per_page,
        "pages": n_pages,
        "runs": runs,
        "native": native_available(),
        "tierkv_keys_ms": _ms(int(statistics.median(timings["tk"]))),
        "tierkv_lookup_ms": _ms(int(statistics.median(timings["tl"]))),
        "tierkv_ms": _ms(int(tierkv_ns)),
        "sha256_keys_ms": _ms(int(statistics.median(timings["sk"]))),
        "sha256_lookup_ms": _ms(int(statistics.median(timings["sl"]))),
        "sha256_ms": _ms(int(sha_ns)),
        "store_lookup_ms": _ms(int(store_ns)),
        "components_vs_sha256": sha_ns / max(tierkv_ns, 1),
        "keys_vs_sha256": sha_ns / max(store_ns, 1),
    }
