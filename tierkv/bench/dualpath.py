"""``tierkv bench dualpath``: DualPath's two paths measured between real node daemons in
network namespaces, each storage NIC shaped by ``tc``.

Three namespaces, one ``tierkv serve`` daemon in each: a *storage* node holding every
page in DRAM (it stands for the storage pool of disaggregated serving), a *prefill* node
that loads prompts' pages from it, and a *decode* node that may read for the prefill
node (``[peers] helper = true``). Each engine node reaches the storage node over a veth
pair of its own (its *storage NIC*), whose storage side sends at most ``--storage-mbit``
(a token bucket); the prefill and decode nodes are joined by a third, unshaped pair (the
*compute link*). The driver, in this namespace, asks the prefill node (through its Unix
socket) for ``--requests`` prompts of ``--pages`` pages each, one after another, every
prompt new to it (a fresh prefill node per policy and round: the decode node keeps
nothing it forwards), and checks every page's bytes; policies (``pe-only``,
``shorter-queue``, ``split``) take turns, ``rounds`` times, in the same run. Reported per
policy: the load throughput over all its rounds and its ratio to ``pe-only`` (also per
round), the share of the bytes the prefill node read itself, and pages a helper failed
to deliver.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from tierkv.bench.netns import Namespaces
from tierkv.dualpath.scheduler import POLICIES
from tierkv.serve.child import Daemon

MODEL = "tierkv-bench-dualpath"
STORAGE_PORT, HELPER_PORT, LANDING_PORT = 7000, 7001, 7002
#: 8 KiB a layer (2 KV heads of 64 dims in bf16, 16 tokens); ``--page-kib`` / 8 layers.
LAYER_KIB = 8


def _layout(page_kib: int) -> dict[str, object]:
    return {"num_layers": page_kib // LAYER_KIB, "num_kv_heads": 2, "head_dim": 64, "dtype": "bf16",
            "tokens_per_page": 16}


def _tokens(request: int, pages: int) -> np.ndarray:
    return np.arange(pages * 16, dtype=np.int64) + request * 1_000_003 % 40_000_000


def _data(request: int, pages: int, page_bytes: int) -> np.ndarray:
    return np.random.default_rng(request).integers(0, 256, (pages, page_bytes), dtype=np.uint8)


def _config(where: Path, socks: Path, name: str, layout: dict[str, object], dram_bytes: int,
            peers: dict[str, object]) -> Path:
    q = json.dumps
    lay = "\n".join(f"{k} = {q(v)}" for k, v in layout.items())
    peer_lines = "\n".join(f"{k} = {q(v)}" for k, v in peers.items())
    text = (f"[store]\npath = {q(str(where / name))}\nmodel_id = {q(MODEL)}\n\n[layout]\n{lay}\n\n"
            f"[tiers.dram]\ncapacity_bytes = {dram_bytes}\n\n[serve]\nsocket = {q(str(socks / (name + '.sock')))}\n\n"
            f"[peers]\n{peer_lines}\n")
    path = where / f"{name}.toml"
    path.write_text(text)
    return path


def _run(nets: Namespaces, ns: str, work: Path, socks: Path, name: str, layout: dict[str, object], dram: int,
         requests: int, pages: int, page_bytes: int, peers: dict[str, object]) -> tuple[dict[str, Any], int]:
    """One policy's run: a fresh prefill node in ``ns`` loads prompt 0 (untimed: it
    connects to its peers), then prompts 1..requests, each checked; (its figures, prompts
    with wrong bytes). A prompt with wrong bytes counts as missed."""
    from tierkv.serve.client import connect

    prefill = Daemon(_config(work, socks, name, layout, dram, peers), work / f"{name}.log", prefix=nets.exec(ns)).start()
    wrong = short = 0
    try:
        with connect(prefill.socket) as client:
            out = np.empty((pages, page_bytes), np.uint8)
            for r in range(requests + 1):
                if r == 1:
                    before = client.stats().dualpath.get("loads", {})
                    began = time.perf_counter()
                got = client.get(_tokens(r, pages), out)
                bad = not np.array_equal(out[:got.pages], _data(r, pages, page_bytes)[:got.pages])
                wrong += int(bad)
                if r:   # a prompt with wrong bytes counts as loading nothing
                    short += pages if bad else pages - got.pages
            seconds = time.perf_counter() - began
            stats = client.stats().dualpath
    finally:
        prefill.stop()
    loads = {k: v - before.get(k, 0) for k, v in stats.get("loads", {}).items()}
    return {
        "seconds": round(seconds, 4),
        "pages_loaded": requests * pages - short,
        "pages_missed": short,
        "pages_self": int(loads.get("pages_self", 0)),
        "pages_helpers": int(loads.get("pages_helpers", 0)),
        "pages_fallback": int(loads.get("pages_fallback", 0)),
        "helper_errors": int(loads.get("helper_errors", 0)),
        "rates_bytes_s": {k: round(v) for k, v in stats.get("rates_bytes_s", {}).items()},
        "latency_ms": {k: round(v * 1e3, 2) for k, v in stats.get("latency_s", {}).items()},
    }, wrong


def run_dualpath_bench(requests: int = 12, pages: int = 128, page_kib: int = 64, storage_mbit: float = 400.0,
                       rounds: int = 3, where: str | None = None,
                       step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the benchmark (module docstring); ``step`` is told each phase as it starts."""
    from tierkv.serve.client import connect

    if requests < 1 or pages < 1 or rounds < 1:
        raise ValueError(f"--requests, --pages and --runs must be >= 1, got {requests}, {pages} and {rounds}")
    if page_kib < LAYER_KIB or page_kib % LAYER_KIB:
        raise ValueError(f"--page-kib must be a multiple of {LAYER_KIB}, got {page_kib}")
    say = step or (lambda _what: None)
    layout = _layout(page_kib)
    page_bytes = page_kib << 10
    per_run = (requests + 1) * pages * page_bytes + (64 << 20)   # one warm-up request each
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-dualpath-", dir=where) as tmp, ExitStack() as stack:
        work = Path(tmp)
        # Unix socket paths are short (107 bytes): theirs is a folder of its own in the system's temp dir.
        socks = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tkvdp-")))
        os.chmod(work, 0o755)
        secret = work / "peers.secret"
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32).hex().encode())
        say(f"making 3 network namespaces, storage NICs shaped to {storage_mbit:g} Mbit/s")
        nets = stack.enter_context(Namespaces())
        s_ns, p_ns, d_ns = nets.add("s"), nets.add("p"), nets.add("d")
        (s_p_dev, s_p_ip), (_, _) = nets.link(s_ns, p_ns)          # the prefill node's storage NIC
        (s_d_dev, s_d_ip), (_, _) = nets.link(s_ns, d_ns)          # the decode node's storage NIC
        (_, p_c_ip), (_, d_c_ip) = nets.link(p_ns, d_ns)           # the compute link, unshaped
        nets.shape(s_ns, s_p_dev, storage_mbit)
        nets.shape(s_ns, s_d_dev, storage_mbit)
        common = {"transport": "tcp", "timeout_s": 30.0, "secret_file": str(secret)}
        storage_cfg = _config(work, socks, "storage", layout, int(per_run * 1.25),
                              {"serve": f"0.0.0.0:{STORAGE_PORT}", **common})
        decode_cfg = _config(work, socks, "decode", layout, 64 << 20,
                             {"serve": f"{d_c_ip}:{HELPER_PORT}", "fetch": [f"{s_d_ip}:{STORAGE_PORT}"], "helper": True,
                              **common})
        say("starting the storage and decode node daemons")
        storage = Daemon(storage_cfg, work / "storage.log", prefix=nets.exec(s_ns)).start()
        stack.callback(storage.stop)
        decode = Daemon(decode_cfg, work / "decode.log", prefix=nets.exec(d_ns)).start()
        stack.callback(decode.stop)
        say(f"putting {(requests + 1) * pages:,} pages of {page_kib} KiB into the storage node")
        with connect(storage.socket) as client:
            for r in range(requests + 1):
                client.put(_tokens(r, pages), _data(r, pages, page_bytes))
        runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in POLICIES}
        wrong = 0
        for k in range(rounds):
            for policy in POLICIES:
                say(f"round {k + 1} of {rounds}, {policy}: a fresh prefill node, {requests} requests of {pages} pages")
                run, bad = _run(nets, p_ns, work, socks, f"prefill-{k}-{policy}", layout, per_run, requests, pages,
                                page_bytes, {"fetch": [f"{s_p_ip}:{STORAGE_PORT}"], "helpers": [f"{d_c_ip}:{HELPER_PORT}"],
                                             "landing": f"{p_c_ip}:{LANDING_PORT}", "landing_pages": pages,
                                             "dualpath": policy, **common})
                runs[policy].append(run)
                wrong += bad
        results: dict[str, dict[str, Any]] = {}
        for name, each in runs.items():
            seconds = sum(r["seconds"] for r in each)
            loaded = sum(r["pages_loaded"] for r in each)
            self_pages = sum(r["pages_self"] for r in each)
            total = self_pages + sum(r["pages_helpers"] for r in each)
            results[name] = {
                "seconds": round(seconds, 4),
                "pages_loaded": loaded,
                "pages_missed": sum(r["pages_missed"] for r in each),
                "load_bytes_s": round(loaded * page_bytes / seconds),
                "prefill_bytes_fraction": round(self_pages / total, 4) if total else None,
                "pages_fallback": sum(r["pages_fallback"] for r in each),
                "helper_errors": sum(r["helper_errors"] for r in each),
                "rounds": each,
            }
        base = results["pe-only"]
        for res in results.values():
            res["throughput_vs_pe_only"] = round(res["load_bytes_s"] / base["load_bytes_s"], 3)
            res["throughput_vs_pe_only_rounds"] = [
                round(r["pages_loaded"] / r["seconds"] / (b["pages_loaded"] / b["seconds"]), 3) if b["pages_loaded"] else None
                for r, b in zip(res["rounds"], base["rounds"])]
        nic = storage_mbit * 1e6 / 8
        return {
            "requests": requests, "pages_per_request": pages, "page_bytes": page_bytes, "rounds": rounds,
            "storage_mbit": storage_mbit, "storage_nic_bytes_s": round(nic),
            "policies": results,
            "split_vs_pe_only": results["split"]["throughput_vs_pe_only"],
            "shorter_queue_vs_pe_only": results["shorter-queue"]["throughput_vs_pe_only"],
            "split_prefill_bytes_fraction": results["split"]["prefill_bytes_fraction"],
            "pe_only_vs_one_nic": round(base["load_bytes_s"] / nic, 3),
            "mismatches": wrong,   # prompts with any wrong byte
        }
