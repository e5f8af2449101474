"""``tierkv bench scale``: what the store's page table costs per page at node scale, against a
plain Python dict of the same keys measured in the same run (issue 20).

A store of ``pages`` 4 KiB pages (16 tokens each) on an NVMe-tier file (sparse, in a
temporary directory), with a DRAM tier of 1% of them and the default policy, is driven
through the public API only (:class:`tierkv.Store`, :class:`tierkv.StoreConfig`), so the
figures stay comparable while the store's internals change. Every page gets a key from
the store's own key chain: the pages are prompts of :data:`BATCH_PAGES` pages (fewer when
the DRAM tier holds fewer), one ``put``, ``get`` or ``lookup`` call per prompt, as an
engine makes one call per request. Child processes, one after another, so that
each resident-memory figure starts from a fresh interpreter:

- *build*: opens the store, puts twice as many warm-up pages as the DRAM tier holds (so
  its buffer, and the NVMe tier's bounce buffers its demotions go through, are resident
  before the baseline: they hold data, not entries), reads the RSS,
  puts ``pages`` pages, reads the RSS again (``bytes_per_page_entry``), then closes the
  store cleanly (DRAM pages are written back to the NVMe tier);
- *reopen* (:data:`REOPEN_ROUNDS` times, each in a fresh process; the figures are the
  rounds' medians, each round's in ``*_runs``): opens and closes a tiny store first (imports and one-off set-up), reads the
  RSS, times ``Store.open`` of the big one (``reopen_s_per_million_pages``, and the RSS
  growth as ``reopen_bytes_per_page_entry``), looks up every page (no I/O), then puts
  fresh pages into the DRAM tier, which is empty after a reopen, so no eviction and no
  I/O (``put_us_per_page``), and gets those back, all DRAM hits (``get_us_per_page``),
  checking through ``stats()`` that this is what happened;
- *dict*: the same keys into ``{key: (tier, slot, checksum)}``: insert, ``get``, ``in``,
  its RSS growth, and ``pickle.load`` of the dict from a file as its "reopen".

Times are per page, summed over the calls (a progress bar's updates fall outside them).
Called by :mod:`tierkv.cli.bench`; ``python -m tierkv.bench.scale <step> <json>`` is the
child's entry point, not a command.
"""

from __future__ import annotations

import gc
import json
import math
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from tierkv.bench import check_dir
from tierkv.errors import InputError, TierKVError
from tierkv.progress import task_progress

DEFAULT_PAGES = 1_000_000
#: ``--quick``: a smoke run of a few seconds.
QUICK_PAGES = 4096
#: Token ids are uint32 and every page here has its own 16: room for this many pages.
MAX_PAGES = 200_000_000
PAGE_BYTES = 4096
TOKENS_PER_PAGE = 16
#: Pages per put/get/lookup call: one prompt of 4,096 tokens.
BATCH_PAGES = 256
#: The DRAM tier holds this fraction of ``pages``.
DRAM_FRACTION = 0.01
#: Timed DRAM gets repeat over the same pages until about this many are timed.
GET_PAGES_TIMED = 65_536
#: The reopen step runs this many times, each in a fresh process with pages of its own to
#: put; its figures are the medians (a round's 10,000 timed puts last some 20 ms, which
#: one unlucky moment of a shared machine can double).
REOPEN_ROUNDS = 3
#: Warm-up pages before the build's baseline, in DRAM tiers' worth: one fills the DRAM tier,
#: the next demotes it to the NVMe tier once, so that what stays resident whatever the page
#: count (the DRAM buffer, the NVMe tier's bounce buffers) is there before the baseline.
WARM_FILLS = 2
#: The reopen step's figures reported as the median of its rounds (each round's in ``*_runs``).
ROUND_FIGURES = ("reopen_s", "reopen_s_per_million_pages", "reopen_bytes_per_page_entry", "lookup_us_per_page",
                 "put_us_per_page", "get_us_per_page", "copy_us_per_page")
MODEL_ID = "bench-scale"

#: What each figure times, word for word in the JSON and the tables.
TIMED = {
    "bytes_per_page_entry": "RSS growth of a fresh process over putting `pages` pages, divided by them; "
                            "the DRAM tier's buffer is filled before the baseline",
    "reopen_bytes_per_page_entry": "RSS growth of a fresh process over Store.open of the closed store, per page; "
                                   "the median of the reopen rounds",
    "reopen_s_per_million_pages": "Store.open of the cleanly closed store (index check included), in a fresh "
                                  "process, scaled to 1M pages; the median of the reopen rounds",
    "put_us_per_page": "Store.put of new pages into the DRAM tier while it has room (after the reopen, with "
                       "every page in the index): keys, bookkeeping and a 4 KiB copy; no eviction, no I/O; "
                       "the median of the reopen rounds, each with pages of its own",
    "get_us_per_page": "Store.get of pages resident in the DRAM tier (all hits there): keys, bookkeeping and "
                       "a 4 KiB copy; the median of the reopen rounds",
    "lookup_us_per_page": "Store.lookup of every page after the reopen: keys and the index, no I/O; the "
                          "median of the reopen rounds",
    "load_us_per_page": "Store.put of all `pages` pages into a full DRAM tier: demotions to the NVMe file "
                        "with fdatasync and index commits included",
    "table_bytes_per_page": "Store.stats().page_table_bytes after the puts, divided by `pages`: the page "
                            "table's allocation (per-page columns, and its keys and map unless it shares the "
                            "slowest tier's policy's key table; capacity ahead of use included)",
    "policy_bytes_per_page": "the tiers' policy_bytes in the same stats, summed, per page (null where a policy "
                             "cannot tell): the leaf heaps and the ghost with their key table (the page "
                             "table's keys too, for the slowest tier), allocated",
    "index_file_bytes_per_page": "index_file_bytes in the same stats, per page: the LMDB file in use (a slot "
                                 "tier's runs; the writer hands its mapping back to the kernel after use)",
    "dict": "{key: (tier, slot, checksum)} of the same 16-byte keys, computed beforehand: insert, dict.get, "
            "`in`, one Python loop iteration per page; reopen: pickle.load of the dict from a file",
}


def check_pages(value: object) -> int:
    """``value`` (an int, or its text) as a page count; InputError naming ``--pages`` otherwise."""
    expected = f"expected a whole number of pages from 1 to {MAX_PAGES:,}"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InputError(f"--pages: {expected}, got {value!r}")
    try:
        pages = int(value)
    except ValueError:
        raise InputError(f"--pages: {expected}, got {value!r}") from None
    if not 1 <= pages <= MAX_PAGES:
        raise InputError(f"--pages: {expected}, got {pages:,}")
    return pages


def sizes(pages: int) -> dict[str, int]:
    """The run's sizes: DRAM tier pages, pages per call, NVMe tier pages (the bulk, the
    warm-up pages and each reopen round's timed puts, all written back: nothing is ever
    dropped)."""
    dram = max(1, int(pages * DRAM_FRACTION))
    return {"pages": pages, "dram_pages": dram, "batch_pages": min(BATCH_PAGES, dram),
            "nvme_pages": pages + (WARM_FILLS + REOPEN_ROUNDS) * dram}


def run_scale(pages: int = DEFAULT_PAGES, where: str | None = None) -> dict[str, object]:
    """Run the child steps on a store under ``where`` (None: a temporary directory)
    and return the figures; TierKVError when a step fails, InputError for bad arguments."""
    pages = check_pages(pages)
    check_dir(where)
    params: dict[str, Any] = sizes(pages)
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-scale-", dir=where) as tmp:
        params["dir"] = tmp
        build = _child("build", params)
        rounds = [_child("reopen", {**params, "round": r}) for r in range(REOPEN_ROUNDS)]
        ref = _child("dict", params)
    reopen = {**rounds[0], **{k: statistics.median(r[k] for r in rounds) for k in ROUND_FIGURES},
              **{f"{k}_runs": [r[k] for r in rounds] for k in ROUND_FIGURES if k != "reopen_s"},
              "reopen_rounds": REOPEN_ROUNDS,
              "pages_found": min(r["pages_found"] for r in rounds),
              "timed_put_evictions": sum(r["timed_put_evictions"] for r in rounds),
              "timed_gets_from_dram": all(r["timed_gets_from_dram"] for r in rounds),
              "bytes_match": all(r["bytes_match"] for r in rounds)}
    store = {**build, **reopen}
    ratios = {k: _ratio(store.get(k), ref.get(k)) for k in
              ("bytes_per_page_entry", "reopen_s_per_million_pages", "put_us_per_page", "get_us_per_page",
               "lookup_us_per_page")}
    verified = (build["pages_stored"] == pages and reopen["pages_found"] == pages and reopen["timed_put_evictions"] == 0
                and reopen["timed_gets_from_dram"] and reopen["bytes_match"])
    return {**{k: v for k, v in params.items() if k != "dir"}, "page_bytes": PAGE_BYTES,
            "tokens_per_page": TOKENS_PER_PAGE, **store, "dict": ref, "store_vs_dict": ratios,
            "verified": verified, "timed": TIMED, "python": sys.version.split()[0]}


def _ratio(a: object, b: object) -> float | None:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0
    return a / b if ok else None  # type: ignore[operator]


def _child(step: str, params: dict[str, Any]) -> dict[str, Any]:
    """Run one step in a fresh interpreter; its stderr (progress, warnings) is this one's."""
    cmd = [sys.executable, "-m", "tierkv.bench.scale", step, json.dumps(params)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise TierKVError(f"bench scale: the {step} step exited with status {proc.returncode} (its error is above)")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


# --------------------------------------------------------------------------------------
# The child steps.


def _rss() -> tuple[int, int]:
    """(resident bytes, of which file-backed or shared): /proc/self/statm, in bytes."""
    gc.collect()
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    page = os.sysconf("SC_PAGE_SIZE")
    return int(fields[1]) * page, int(fields[2]) * page


def _prompts(first: int, count: int, batch: int) -> Iterator[Any]:
    """Token ids of pages ``first .. first+count-1``, one prompt of ``batch`` pages (the
    last may be shorter) at a time; every page has its own tokens, so its own key chain."""
    import numpy as np

    for start in range(first, first + count, batch):
        end = min(first + count, start + batch)
        yield np.arange(start * TOKENS_PER_PAGE, end * TOKENS_PER_PAGE, dtype=np.uint32)


def _config(path: str, p: dict[str, Any]) -> Any:
    from tierkv import DramConfig, KVLayout, NvmeConfig, StoreConfig

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=PAGE_BYTES // (2 * 2 * TOKENS_PER_PAGE), dtype="bf16",
                      tokens_per_page=TOKENS_PER_PAGE)  # K and V, BF16: 4 KiB pages
    assert layout.page_bytes == PAGE_BYTES
    return StoreConfig(path=path, model_id=MODEL_ID, layout=layout, dram=DramConfig(p["dram_pages"] * PAGE_BYTES),
                       nvme=NvmeConfig(p["nvme_pages"] * PAGE_BYTES))


def _rows(n: int) -> Any:
    import numpy as np

    return np.random.default_rng(20).integers(0, 256, (n, PAGE_BYTES), dtype=np.uint8)


def step_build(p: dict[str, Any]) -> dict[str, Any]:
    """Put the warm-up pages, then ``pages`` pages; RSS growth and load time; close cleanly."""
    from tierkv import Store

    n, dram, batch = p["pages"], p["dram_pages"], p["batch_pages"]
    src = _rows(batch)
    store = Store.open(_config(os.path.join(p["dir"], "store"), p))
    # warm-up: pages after the bulk's, filling the DRAM tier and then pushing it down once
    for tokens in _prompts(n, WARM_FILLS * dram, batch):
        store.put(tokens, src[:len(tokens) // TOKENS_PER_PAGE])
    base, base_file = _rss()
    stored, seconds = 0, 0.0
    with task_progress(f"bench scale: put {n:,} pages", total=-(-n // batch)) as step:
        for tokens in _prompts(0, n, batch):
            t0 = time.perf_counter()
            stored += store.put(tokens, src[:len(tokens) // TOKENS_PER_PAGE]).stored
            seconds += time.perf_counter() - t0
            step()
    rss, rss_file = _rss()
    stats = store.stats()
    policies = [t.policy_bytes for t in stats.tiers.values()]
    t0 = time.perf_counter()
    store.close()
    return {"policy": store.config.policy, "pages_stored": stored, "load_us_per_page": seconds / n * 1e6,
            "close_s": time.perf_counter() - t0, "bytes_per_page_entry": (rss - base) / n,
            "anon_bytes_per_page_entry": ((rss - rss_file) - (base - base_file)) / n,
            "table_bytes_per_page": stats.page_table_bytes / n,
            "policy_bytes_per_page": None if None in policies else sum(p or 0 for p in policies) / n,
            "index_file_bytes_per_page": stats.index_file_bytes / n}


def step_reopen(p: dict[str, Any]) -> dict[str, Any]:
    """Time the reopen and its RSS growth, then lookups, DRAM puts and DRAM gets."""
    from tierkv import Store

    n, dram, batch = p["pages"], p["dram_pages"], p["batch_pages"]
    with Store.open(_config(os.path.join(p["dir"], "tiny"), {**p, "nvme_pages": 2 * dram})) as tiny:
        tiny.lookup(next(_prompts(0, 1, 1)))  # imports and one-off set-up, outside the baseline
    base, _ = _rss()
    t0 = time.perf_counter()
    store = Store.open(_config(os.path.join(p["dir"], "store"), p))
    open_s = time.perf_counter() - t0
    rss, _ = _rss()
    with store:
        out = {"reopen_s": open_s, "reopen_s_per_million_pages": open_s * 1e6 / n,
               "reopen_bytes_per_page_entry": (rss - base) / n, **_timed_lookups(store, n, batch)}
        out.update(_timed_dram(store, n, dram, batch, int(p.get("round", 0))))
    return out


def _timed_lookups(store: Any, n: int, batch: int) -> dict[str, Any]:
    found, seconds = 0, 0.0
    with task_progress(f"bench scale: look up {n:,} pages", total=-(-n // batch)) as step:
        for tokens in _prompts(0, n, batch):
            t0 = time.perf_counter()
            found += store.lookup(tokens).cached_pages
            seconds += time.perf_counter() - t0
            step()
    return {"pages_found": found, "lookup_us_per_page": seconds / n * 1e6, "lookup_pages_timed": n}


def _timed_dram(store: Any, n: int, dram: int, batch: int, rnd: int = 0) -> dict[str, Any]:
    """Put ``dram`` new pages (round ``rnd``'s own) into the empty DRAM tier, then get them
    back (repeated)."""
    import numpy as np

    src, dst = _rows(batch), np.empty((batch, PAGE_BYTES), dtype=np.uint8)
    first = n + dram * (WARM_FILLS + rnd)  # after the bulk, the warm-up pages and the rounds before
    tier = next(name for name, t in store.stats().tiers.items() if t.kind == "dram")
    before = store.stats()
    put_s = 0.0
    for tokens in _prompts(first, dram, batch):
        rows = src[:len(tokens) // TOKENS_PER_PAGE]
        t0 = time.perf_counter()
        store.put(tokens, rows)
        put_s += time.perf_counter() - t0
    mid = store.stats()
    reps = max(1, math.ceil(GET_PAGES_TIMED / dram))
    get_s, got, match = 0.0, 0, True
    for _ in range(reps):
        for tokens in _prompts(first, dram, batch):
            k = len(tokens) // TOKENS_PER_PAGE
            t0 = time.perf_counter()
            got += store.get(tokens, dst[:k]).pages
            get_s += time.perf_counter() - t0
            match = match and bool(np.array_equal(dst[:k], src[:k]))
    after = store.stats()
    copy_s = 0.0
    for _ in range(reps):  # the bytes a get copies, alone: what of its time is not bookkeeping
        for tokens in _prompts(first, dram, batch):
            k = len(tokens) // TOKENS_PER_PAGE
            t0 = time.perf_counter()
            np.copyto(dst[:k], src[:k])
            copy_s += time.perf_counter() - t0
    timed = reps * dram
    return {"put_us_per_page": put_s / dram * 1e6, "put_pages_timed": dram,
            "timed_put_evictions": mid.evictions - before.evictions,
            "timed_put_into_dram": mid.tiers[tier].used_slots - before.tiers[tier].used_slots,
            "get_us_per_page": get_s / timed * 1e6, "get_pages_timed": timed,
            "timed_gets_from_dram": got == timed and after.tiers[tier].hits - mid.tiers[tier].hits == timed,
            "bytes_match": match, "copy_us_per_page": copy_s / timed * 1e6}


def step_dict(p: dict[str, Any]) -> dict[str, Any]:
    """The reference: the same keys in a dict of small tuples; its RSS growth and timings."""
    from tierkv.keys import chain_keys, namespace_digest, split_keys, tenant_salt

    n, batch = p["pages"], p["batch_pages"]
    ns = namespace_digest(MODEL_ID, _config(p["dir"], p).layout, tenant_salt(""))
    prompts = list(_prompts(0, n, batch))
    base, _ = _rss()
    table: dict[bytes, tuple[int, int, int]] = {}
    keys_s = insert_s = 0.0
    slot = 0
    for tokens in prompts:
        t0 = time.perf_counter()
        keys = split_keys(chain_keys(tokens, TOKENS_PER_PAGE, ns))
        t1 = time.perf_counter()
        for k in keys:
            table[k] = (1, slot, slot ^ 0x9E3779B97F4A7C15)  # a 64-bit checksum-sized int
            slot += 1
        insert_s += time.perf_counter() - t1
        keys_s += t1 - t0
    rss, _ = _rss()
    every = list(table)
    t0 = time.perf_counter()
    for key in every:
        table.get(key)
    get_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for key in every:
        key in table  # the membership test is what is timed
    in_s = time.perf_counter() - t0
    path = os.path.join(p["dir"], "dict.pickle")
    with open(path, "wb") as f:
        pickle.dump(table, f, protocol=pickle.HIGHEST_PROTOCOL)
    del table, every
    gc.collect()
    with open(path, "rb") as f:
        t0 = time.perf_counter()
        loaded = pickle.load(f)
        load_s = time.perf_counter() - t0
    if len(loaded) != n:
        raise AssertionError(f"the pickled dict came back with {len(loaded)} entries, not {n}")
    return {"bytes_per_page_entry": (rss - base) / n, "put_us_per_page": insert_s / n * 1e6,
            "get_us_per_page": get_s / n * 1e6, "lookup_us_per_page": in_s / n * 1e6,
            "reopen_s_per_million_pages": load_s * 1e6 / n, "key_chain_us_per_page": keys_s / n * 1e6}


STEPS = {"build": step_build, "reopen": step_reopen, "dict": step_dict}


if __name__ == "__main__":
    print(json.dumps(STEPS[sys.argv[1]](json.loads(sys.argv[2]))))
