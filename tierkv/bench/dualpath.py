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
prompt new to it, and checks every page's bytes; that is done once per policy
(``pe-only``, ``shorter-queue``, ``split``), each with a fresh prefill node, in the same
run. Reported per policy: the load throughput and its ratio to ``pe-only``, the share of
the bytes the prefill node read itself, and pages a helper failed to deliver.
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


def _tokens(policy: int, request: int, pages: int) -> np.ndarray:
    return np.arange(pages * 16, dtype=np.int64) + (policy * 100_003 + request) * 1_000_003 % 40_000_000


def _data(policy: int, request: int, pages: int, page_bytes: int) -> np.ndarray:
    return np.random.default_rng(policy * 10_007 + request).integers(0, 256, (pages, page_bytes), dtype=np.uint8)


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


def run_dualpath_bench(requests: int = 24, pages: int = 32, page_kib: int = 64, storage_mbit: float = 400.0,
                       where: str | None = None, step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the benchmark (module docstring); ``step`` is told each phase as it starts."""
    from tierkv.serve.client import connect

    if requests < 1 or pages < 1:
        raise ValueError(f"--requests and --pages must be >= 1, got {requests} and {pages}")
    if page_kib < LAYER_KIB or page_kib % LAYER_KIB:
        raise ValueError(f"--page-kib must be a multiple of {LAYER_KIB}, got {page_kib}")
    say = step or (lambda _what: None)
    layout = _layout(page_kib)
    page_bytes = page_kib << 10
    per_policy = (requests + 1) * pages * page_bytes   # one warm-up request each
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
        storage_cfg = _config(work, socks, "storage", layout, int(per_policy * len(POLICIES) * 1.25) + (64 << 20),
                              {"serve": f"0.0.0.0:{STORAGE_PORT}", **common})
        decode_cfg = _config(work, socks, "decode", layout, 64 << 20,
                             {"serve": f"{d_c_ip}:{HELPER_PORT}", "fetch": [f"{s_d_ip}:{STORAGE_PORT}"], "helper": True,
                              **common})
        say("starting the storage and decode node daemons")
        storage = Daemon(storage_cfg, work / "storage.log", prefix=nets.exec(s_ns)).start()
        stack.callback(storage.stop)
        decode = Daemon(decode_cfg, work / "decode.log", prefix=nets.exec(d_ns)).start()
        stack.callback(decode.stop)
        say(f"putting {len(POLICIES) * (requests + 1) * pages:,} pages of {page_kib} KiB into the storage node")
        with connect(storage.socket) as client:
            for i in range(len(POLICIES)):
                for r in range(requests + 1):
                    client.put(_tokens(i, r, pages), _data(i, r, pages, page_bytes))
        results: dict[str, dict[str, Any]] = {}
        wrong = 0
        for i, policy in enumerate(POLICIES):
            say(f"{policy}: a fresh prefill node, {requests} requests of {pages} pages")
            prefill_cfg = _config(work, socks, f"prefill-{policy}", layout, per_policy + (64 << 20),
                                  {"fetch": [f"{s_p_ip}:{STORAGE_PORT}"], "helpers": [f"{d_c_ip}:{HELPER_PORT}"],
                                   "landing": f"{p_c_ip}:{LANDING_PORT}", "landing_pages": pages,
                                   "dualpath": policy, **common})
            prefill = Daemon(prefill_cfg, work / f"prefill-{policy}.log", prefix=nets.exec(p_ns)).start()
            try:
                with connect(prefill.socket) as client:
                    out = np.empty((pages, page_bytes), np.uint8)
                    short = 0
                    for r in range(requests + 1):
                        if r == 1:   # the first request connects to the peers: not timed
                            before = client.stats().dualpath.get("loads", {})
                            began = time.perf_counter()
                        got = client.get(_tokens(i, r, pages), out)
                        short += pages - got.pages
                        wrong += int(not np.array_equal(out[:got.pages], _data(i, r, pages, page_bytes)[:got.pages]))
                    seconds = time.perf_counter() - began
                    stats = client.stats().dualpath
            finally:
                prefill.stop()
            loads = {k: v - before.get(k, 0) for k, v in stats.get("loads", {}).items()}
            total = loads.get("pages_self", 0) + loads.get("pages_helpers", 0)
            loaded = requests * pages - short
            results[policy] = {
                "seconds": round(seconds, 4),
                "pages_loaded": loaded,
                "pages_missed": short,
                "load_bytes_s": round(loaded * page_bytes / seconds),
                "prefill_bytes_fraction": round(loads.get("pages_self", 0) / total, 4) if total else None,
                "pages_fallback": int(loads.get("pages_fallback", 0)),
                "helper_errors": int(loads.get("helper_errors", 0)),
                "rates_bytes_s": {k: round(v) for k, v in stats.get("rates_bytes_s", {}).items()},
            }
        base = results["pe-only"]["load_bytes_s"]
        for res in results.values():
            res["throughput_vs_pe_only"] = round(res["load_bytes_s"] / base, 3) if base else None
        nic = storage_mbit * 1e6 / 8
        return {
            "requests": requests, "pages_per_request": pages, "page_bytes": page_bytes,
            "storage_mbit": storage_mbit, "storage_nic_bytes_s": round(nic),
            "policies": results,
            "split_vs_pe_only": results["split"]["throughput_vs_pe_only"],
            "shorter_queue_vs_pe_only": results["shorter-queue"]["throughput_vs_pe_only"],
            "split_prefill_bytes_fraction": results["split"]["prefill_bytes_fraction"],
            "pe_only_vs_one_nic": round(base / nic, 3),
            "mismatches": wrong,
        }
