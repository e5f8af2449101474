"""``tierkv bench serve``: the node service against an in-process store, in one run.

One daemon (``tierkv serve``'s :class:`~tierkv.serve.daemon.NodeService`, in a process
of its own) serves a DRAM store; 1, 2 and 4 client processes each put a 128 MiB batch of new
pages and get it back, round after round, starting together; an in-process ``Store``
of the same config does the same work on one thread of this process, the baseline
(after a warm-up through every DRAM slot; the median of three runs, as the clients').
Reported per page size and client count: aggregate put and get GB/s and their ratio
to the in-process store (``put_vs_inprocess``, ``get_vs_inprocess``), and the scaling
of 2 and 4 clients over 1 (each the median of three runs; the in-process runs alternate
with the one-client runs, so that both see the same machine), beside
``memcpy_2_threads_vs_1``: np.copyto on two threads at once over one, the most two
clients' copies can gain on the machine. Clients put from and get into a ``page_buffer`` (the
one-copy path); ``put_vs_inprocess_scratch`` is one client whose batch is its own
array (copied through its scratch segment). ``lookup_p50_us`` / ``lookup_p99_us``: a
lookup of a new 131,072-token prompt (nothing of it cached) through a connected client,
beside the in-process lookup; ``lookup_cached_p50_us`` / ``_p99_us``: the same prompt
with every page cached (every key hashed: the most a lookup costs), in a store of
64-byte pages, through a daemon and in process. Every get is checked against what was put (``verified``). ``shmem_huge_pages``:
the kernel's ``transparent_hugepage/shmem_enabled`` mode, which decides whether the
page buffers and the DRAM pool (memfds) get huge pages (docs/serve.md, "Huge pages").
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tierkv.bench.store import _layout_for
from tierkv.config import DramConfig, StoreConfig
from tierkv.tiers.hugepages import shmem_huge_pages

PAGE_SIZES = (2 << 20, 256 << 10)
CLIENTS = (1, 2, 4)
LOOKUP_TOKENS = 131072
#: Runs of each client count (and of the scratch path); the median of each rate is reported.
REPEATS = 3


def _config(path: str, page_bytes: int, pages: int) -> StoreConfig:
    return StoreConfig(path=path, model_id="bench-serve", layout=_layout_for(page_bytes),
                       dram=DramConfig(page_bytes * pages), policy="lru", persist_on_close=False)


def _tokens(client: int, rnd: int, pages: int) -> np.ndarray:
    base = (client * 100003 + rnd) * pages * 16
    return (np.arange(pages * 16, dtype=np.int64) + base) % 2_000_000_000


def _work(store: Any, client: int, rounds: int, src: np.ndarray, dst: np.ndarray) -> tuple[float, float, bool]:
    """``rounds`` puts of ``src`` under new tokens, each got back into ``dst``: (put s, get s, exact)."""
    pages = src.shape[0]
    put_s = get_s = 0.0
    ok = True
    for r in range(rounds):
        tokens = _tokens(client, r, pages)
        src[:, :8] = np.frombuffer(np.int64(r * 7 + client).tobytes(), np.uint8)   # each round's bytes differ
        t0 = time.perf_counter()
        stored = store.put(tokens, src).stored
        t1 = time.perf_counter()
        got = store.get(tokens, dst).pages
        t2 = time.perf_counter()
        put_s += t1 - t0
        get_s += t2 - t1
        ok &= stored == pages and got == pages and bool(np.array_equal(dst, src))
    return put_s, get_s, ok


def _client(sock: str, client: int, rounds: int, pages: int, page_bytes: int, registered: bool,
            barrier: Any, results: Any) -> None:
    from tierkv.store.api import Store

    store = Store.connect(sock)
    try:
        if registered:
            src, dst = store.page_buffer(pages), store.page_buffer(pages)
        else:
            src, dst = np.empty((pages, page_bytes), np.uint8), np.empty((pages, page_bytes), np.uint8)
        src[:] = np.random.default_rng(client).integers(0, 256, src.shape, dtype=np.uint8)
        _work(store, client + 50000, 1, src, dst)         # warm-up: faults, first mappings
        barrier.wait()
        t0 = time.perf_counter()
        put_s, get_s, ok = _work(store, client, rounds, src, dst)
        results.put((client, put_s, get_s, time.perf_counter() - t0, ok))
        del src, dst
    finally:
        store.close()


def _start_daemon(cfg_path: Path, sock: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tierkv", "serve", "--config", str(cfg_path), "--socket", str(sock),
                             "--json", "--foreground", "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if not proc.stdout.readline():
        proc.wait()
        raise RuntimeError("tierkv serve did not start (its stderr is above)")
    return proc


def _toml(cfg: StoreConfig) -> str:
    lay = cfg.layout
    assert cfg.dram is not None
    return (f'[store]\npath = "{cfg.path}"\nmodel_id = "{cfg.model_id}"\npolicy = "lru"\npersist_on_close = false\n'
            f'[layout]\nnum_layers = {lay.num_layers}\nnum_kv_heads = {lay.num_kv_heads}\nhead_dim = {lay.head_dim}\n'
            f'dtype = "{lay.dtype.value}"\ntokens_per_page = {lay.tokens_per_page}\n'
            f'[tiers.dram]\ncapacity_bytes = {cfg.dram.capacity_bytes}\nprefault = true\n')


def _inprocess(page_bytes: int, pages: int, rounds: int, tmp: str, run: int) -> dict[str, Any]:
    from tierkv.store.api import Store

    cfg = _config(os.path.join(tmp, f"inproc-{page_bytes}-{run}"), page_bytes, pages * 2 * max(CLIENTS))
    src = np.random.default_rng(0).integers(0, 256, (pages, page_bytes), dtype=np.uint8)
    dst = np.empty_like(src)
    with Store.open(cfg) as store:
        # Warm-up through every slot of the DRAM tier (its background prefault is over
        # by then too), as the daemon's has been by the time its clients start.
        _work(store, 50000, 2 * max(CLIENTS), src, dst)
        put_s, get_s, ok = _work(store, 0, rounds, src, dst)
    nbytes = rounds * pages * page_bytes
    return {"put_gbps": nbytes / put_s / 1e9, "get_gbps": nbytes / get_s / 1e9, "verified": ok}


def _remote(sock: Path, clients: int, page_bytes: int, pages: int, rounds: int, registered: bool,
            run: int) -> dict[str, Any]:
    """``clients`` processes at once; ``run`` keeps each run's prompts new to the store."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(clients), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(str(sock), run * 64 + c, rounds, pages, page_bytes, registered,
                                               barrier, results)) for c in range(clients)]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    nbytes = clients * rounds * pages * page_bytes
    # Aggregate rates: all clients' bytes over the longest client's time in that phase.
    put_s = max(g[1] for g in got)
    get_s = max(g[2] for g in got)
    return {"clients": clients, "put_gbps": nbytes / put_s / 1e9, "get_gbps": nbytes / get_s / 1e9,
            "verified": all(g[4] for g in got)}


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One figure per measurement from repeated runs: the median of each rate."""
    out = dict(runs[0])
    for key in ("put_gbps", "get_gbps"):
        out[key] = statistics.median(r[key] for r in runs)
        out[key.replace("gbps", "runs")] = [r[key] for r in runs]
    out["verified"] = all(r["verified"] for r in runs)
    return out


def _memcpy_scaling(nbytes: int, reps: int) -> dict[str, float]:
    """np.copyto of ``nbytes`` on one thread, then on two at once (each its own buffers):
    the most that two clients' copies can gain on this machine."""
    bufs = [(np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)) for _ in range(2)]

    def copy(i: int) -> None:
        src, dst = bufs[i]
        for _ in range(reps):
            np.copyto(dst, src)
    copy(0)
    copy(1)
    t0 = time.perf_counter()
    copy(0)
    one = reps * nbytes / (time.perf_counter() - t0) / 1e9
    threads = [threading.Thread(target=copy, args=(i,)) for i in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    two = 2 * reps * nbytes / (time.perf_counter() - t0) / 1e9
    return {"memcpy_1_thread_gbps": one, "memcpy_2_threads_gbps": two, "memcpy_2_threads_vs_1": two / one}


def _lookups(store: Any, tokens: np.ndarray, n: int) -> tuple[float, float]:
    store.lookup(tokens)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        store.lookup(tokens)
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def _cached_lookups(tmp: str, n: int) -> dict[str, float]:
    """The lookup figures for a prompt whose every page is cached (the worst case of a
    lookup that stops at its first miss: every key hashed), through a daemon and in
    process: a store of 64-byte pages, so that the 8,192 pages of the prompt fit."""
    from tierkv.store.api import Store

    tokens = np.arange(LOOKUP_TOKENS, dtype=np.int64)
    pages = LOOKUP_TOKENS // 16
    cfg = _config(os.path.join(tmp, "cached"), 64, pages + 8)
    cfg_path = Path(tmp) / "cached.toml"
    cfg_path.write_text(_toml(cfg))
    sock = Path(tmp) / "cached.sock"
    out: dict[str, float] = {}
    daemon = _start_daemon(cfg_path, sock)
    try:
        with Store.connect(sock) as client:
            if client.put(tokens, np.zeros((pages, 64), np.uint8)).stored != pages:
                raise RuntimeError("the cached-lookup daemon did not store the whole prompt")
            out["lookup_cached_p50_us"], out["lookup_cached_p99_us"] = _lookups(client, tokens, n)
    finally:
        daemon.terminate()
        daemon.wait(60)
    with Store.open(_config(os.path.join(tmp, "cached-inprocess"), 64, pages + 8)) as store:
        store.put(tokens, np.zeros((pages, 64), np.uint8))
        out["inprocess_lookup_cached_p50_us"], out["inprocess_lookup_cached_p99_us"] = _lookups(store, tokens, n)
    return out


def run_serve_bench(quick: bool = False, where: str | None = None) -> dict[str, Any]:
    """The suite's JSON object (see the module docstring)."""
    from tierkv.store.api import Store

    rounds = 4 if quick else 12
    shapes = []
    lookup: dict[str, float] = {}
    verified = True
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-serve-", dir=where) as tmp:
        for page_bytes in PAGE_SIZES[:1] if quick else PAGE_SIZES:
            pages = max(1, (128 << 20) // page_bytes)         # a 128 MiB batch per client, as in the peer harness
            cfg = _config(os.path.join(tmp, f"served-{page_bytes}"), page_bytes, pages * 2 * max(CLIENTS) + 8)
            cfg_path = Path(tmp) / f"served-{page_bytes}.toml"
            cfg_path.write_text(_toml(cfg))
            sock = Path(tmp) / "d.sock"
            daemon = _start_daemon(cfg_path, sock)
            try:
                counts = CLIENTS[:2] if quick else CLIENTS
                reps = 1 if quick else REPEATS
                # The baseline and one client alternate, run for run, so that both see
                # the same machine; each is the median of its runs.
                pairs = [(_inprocess(page_bytes, pages, rounds, tmp, k),
                          _remote(sock, 1, page_bytes, pages, rounds, True, 1 + k)) for k in range(reps)]
                base = _median([b for b, _ in pairs])
                runs = [_median([r for _, r in pairs])]
                runs += [_median([_remote(sock, c, page_bytes, pages, rounds, True, 1 + i * reps + k)
                                  for k in range(reps)]) for i, c in enumerate(counts) if i > 0]
                scratch = _median([_remote(sock, 1, page_bytes, pages, rounds, False, 1 + len(counts) * reps + k)
                                   for k in range(reps)])
                if page_bytes == PAGE_SIZES[0]:
                    with Store.connect(sock) as client:
                        tokens = np.arange(LOOKUP_TOKENS, dtype=np.int64)
                        lookup["lookup_p50_us"], lookup["lookup_p99_us"] = _lookups(client, tokens, 50 if quick else 300)
            finally:
                daemon.terminate()
                daemon.wait(60)
            one = runs[0]
            shape: dict[str, Any] = {
                "page_bytes": page_bytes, "pages_per_batch": pages, "rounds": rounds,
                "inprocess": base, "clients": runs, "scratch_1_client": scratch,
                "put_vs_inprocess": one["put_gbps"] / base["put_gbps"],
                "get_vs_inprocess": one["get_gbps"] / base["get_gbps"],
                "put_vs_inprocess_scratch": scratch["put_gbps"] / base["put_gbps"],
                "get_vs_inprocess_scratch": scratch["get_gbps"] / base["get_gbps"],
            }
            for r in runs[1:]:
                shape[f"put_{r['clients']}_clients_vs_1"] = r["put_gbps"] / one["put_gbps"]
                shape[f"get_{r['clients']}_clients_vs_1"] = r["get_gbps"] / one["get_gbps"]
            verified &= bool(base["verified"]) and all(r["verified"] for r in runs) and bool(scratch["verified"])
            shapes.append(shape)
        with Store.open(_config(os.path.join(tmp, "lookup"), PAGE_SIZES[0], 4)) as store:
            p50, p99 = _lookups(store, np.arange(LOOKUP_TOKENS, dtype=np.int64), 50 if quick else 300)
        lookup["inprocess_lookup_p50_us"], lookup["inprocess_lookup_p99_us"] = p50, p99
        lookup.update(_cached_lookups(tmp, 50 if quick else 300))
    first = shapes[0]
    memcpy = statistics.median([_memcpy_scaling(128 << 20, 4 if quick else 8)["memcpy_2_threads_vs_1"]
                                for _ in range(1 if quick else REPEATS)])
    return {"suite": "serve", "cpus": os.cpu_count(), "shmem_huge_pages": shmem_huge_pages(), "shapes": shapes, **lookup,
            "memcpy_2_threads_vs_1": memcpy,
            "put_vs_inprocess": first["put_vs_inprocess"], "get_vs_inprocess": first["get_vs_inprocess"],
            "clients": [r["clients"] for r in first["clients"]], "verified": verified}
