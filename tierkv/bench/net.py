"""``tierkv bench net``: page-fetch latency and throughput over RDMA and the TCP fallback,
and incast pushes with and without receive credits, all against one peer in one run.

:func:`run_net_bench` measures against a running :class:`tierkv.net.PeerServer` whose
store published ``pages`` pages under the keys ``i.to_bytes(16, "little")``;
:func:`bench_local` starts such a server in a second process on 127.0.0.1 first (the
host path: TCP only where there is no RDMA device). Results are frozen dataclasses; the
ratios against TCP are computed in the same run. :func:`net_report` is ``tierkv bench
net``; :func:`main` is ``python3 -m tierkv.bench.net [--json] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierkv.net import NetConfig, connect
from tierkv.tiers.peer import PeerDramTier


@dataclass(frozen=True)
class NetBenchResult:
    kind: str           # "rdma" or "tcp"
    case: str           # "fetch-1", "fetch-batch", "incast-credits", "incast-no-credits"
    p50_us: float
    p99_us: float
    pages_per_s: float
    gb_per_s: float
    misses: int
    naks: int           # TCP: NAKs (RNR stand-ins) the server sent; RDMA: rxe RNR counter delta

    def __str__(self) -> str:
        return (f"{self.kind:4} {self.case:18} p50 {self.p50_us:9.1f} us  p99 {self.p99_us:9.1f} us  "
                f"{self.pages_per_s:9.0f} pages/s  {self.gb_per_s:6.3f} GB/s  misses {self.misses}  naks/rnr {self.naks}")


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _rnr_total() -> int:
    import pathlib

    total = 0
    for d in pathlib.Path("/sys/class/infiniband").glob("*/ports/1/hw_counters"):
        for f in d.iterdir():
            if "rnr" in f.name:
                total += int(f.read_text().split()[0])
    return total


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e6, q)) if xs else 0.0


def _fetch(kind: str, host: str, port: int, page_bytes: int, pages: int, fetches: int) -> list[NetBenchResult]:
    with PeerDramTier(connect(host, port, kind, NetConfig(timeout_s=10.0))) as tier:  # type: ignore[arg-type]
        metas = tier.lookup([_key(i) for i in range(pages)])
        found = [m for m in metas if m is not None]
        one = np.empty((1, page_bytes), np.uint8)
        lat, misses = [], 0
        for i in range(fetches):
            t0 = time.perf_counter()
            misses += tier.fetch_remote([found[i % len(found)]], one).misses
            lat.append(time.perf_counter() - t0)
        out = [NetBenchResult(kind, "fetch-1", _pct(lat, 50), _pct(lat, 99), fetches / sum(lat),
                              fetches * page_bytes / sum(lat) / 1e9, misses, 0)]
        dst = np.empty((len(found), page_bytes), np.uint8)
        rounds = max(3, fetches // len(found))
        lat, misses = [], 0
        for _ in range(rounds):
            t0 = time.perf_counter()
            misses += tier.fetch_remote(found, dst).misses
            lat.append(time.perf_counter() - t0)
        n = rounds * len(found)
        out.append(NetBenchResult(kind, "fetch-batch", _pct(lat, 50), _pct(lat, 99), n / sum(lat),
                                  n * page_bytes / sum(lat) / 1e9, misses, 0))
        return out


def _incast(kind: str, host: str, port: int, page_bytes: int, per_sender: int, senders: int,
            credits: bool, base_slot: int) -> NetBenchResult:
    cfg = NetConfig(timeout_s=20.0, links=1, recv_credits=4, window=32 if not credits else 8, credits=credits)
    lat: list[float] = []
    misses = [0]
    lock = threading.Lock()
    rnr0 = _rnr_total() if kind == "rdma" else 0

    def sender(i: int) -> None:
        with connect(host, port, kind, cfg) as tr:  # type: ignore[arg-type]
            src = np.frombuffer(np.random.default_rng(i).bytes(page_bytes), np.uint8).reshape(1, page_bytes)
            futs = []
            for b in range(per_sender):
                futs.append((time.perf_counter(), tr.write([base_slot + i * per_sender + b], [time.time_ns()], src)))
            for t0, f in futs:
                r = f.result(60)
                with lock:
                    lat.append(time.perf_counter() - t0)
                    misses[0] += 0 if r.all_stored else 1
            if kind == "tcp":
                with lock:
                    misses.append(-sum(s.naks for s in tr.stats()))  # NAKs the client saw, negated

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(senders)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    wall = time.perf_counter() - t0
    n = senders * per_sender
    naks = (_rnr_total() - rnr0) if kind == "rdma" else -sum(misses[1:])
    return NetBenchResult(kind, "incast-credits" if credits else "incast-no-credits", _pct(lat, 50), _pct(lat, 99),
                          n / wall, n * page_bytes / wall / 1e9, misses[0], naks)


def run_net_bench(host: str, port: int, kinds: Sequence[str] = ("tcp",), page_bytes: int = 65536,
                  pages: int = 64, fetches: int = 500, senders: int = 4) -> list[NetBenchResult]:
    """Every case for every transport kind against the peer at ``host:port``, which holds
    at least ``pages + senders * fetches // senders`` slots past the published ones."""
    out: list[NetBenchResult] = []
    per = max(8, fetches // senders)
    for kind in kinds:
        out += _fetch(kind, host, port, page_bytes, pages, fetches)
        for credits in (True, False):
            out.append(_incast(kind, host, port, page_bytes, per, senders, credits, base_slot=pages))
    return out


def _serve(port: int, slots: int, page_bytes: int, pages: int, ready: object) -> None:
    from tierkv.net import PeerServer
    from tierkv.tiers.dram import DramTier

    server = PeerServer(DramTier(slots, page_bytes), "127.0.0.1", port, NetConfig(recv_credits=4))
    src = np.frombuffer(np.random.default_rng(0).bytes(pages * page_bytes), np.uint8).reshape(pages, page_bytes)
    server.store.store([_key(i) for i in range(pages)], src)
    ready.set()  # type: ignore[attr-defined]
    while True:
        time.sleep(3600)


def bench_local(page_bytes: int = 65536, pages: int = 64, fetches: int = 500, senders: int = 4) -> list[NetBenchResult]:
    """Start a peer server in a second process on 127.0.0.1 and run :func:`run_net_bench`
    over TCP (and RDMA too where :func:`tierkv.net.rdma_available`; rxe needs a non-loopback address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    per = max(8, fetches // senders)
    proc = ctx.Process(target=_serve, args=(port, pages + senders * per, page_bytes, pages, ready), daemon=True)
    proc.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("bench peer server did not start")
        return run_net_bench("127.0.0.1", port, ("tcp",), page_bytes, pages, fetches, senders)
    finally:
        proc.kill()
        proc.join(10)


def net_report(quick: bool = False) -> dict[str, object]:
    """``tierkv bench net``: :func:`bench_local` as one JSON-ready dict, with the ratios of
    the same run: incast with credits against without, batched against single fetches."""
    return _report(bench_local(**_sizes(quick)))


def _sizes(quick: bool) -> dict[str, int]:
    return {"pages": 16 if quick else 64, "fetches": 50 if quick else 500}


def _report(results: Sequence[NetBenchResult]) -> dict[str, object]:
    by = {(r.kind, r.case): r for r in results}
    out: dict[str, object] = {"results": [r.__dict__ for r in results]}
    for kind in sorted({r.kind for r in results}):
        on, off = by.get((kind, "incast-credits")), by.get((kind, "incast-no-credits"))
        if on and off and off.pages_per_s:
            out[f"{kind}_incast_credits_vs_none_throughput"] = on.pages_per_s / off.pages_per_s
            out[f"{kind}_incast_naks_with_credits"] = on.naks
            out[f"{kind}_incast_naks_without_credits"] = off.naks
        one, batch = by.get((kind, "fetch-1")), by.get((kind, "fetch-batch"))
        if one and batch and one.pages_per_s:
            out[f"{kind}_batch_vs_single_fetch_throughput"] = batch.pages_per_s / one.pages_per_s
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python3 -m tierkv.bench.net``: :func:`bench_local`, one line per case (or
    ``--json``: what ``tierkv bench net --json`` prints). Returns the exit status."""
    p = argparse.ArgumentParser(prog="python3 -m tierkv.bench.net",
                                description="Page fetches and incast pushes against a peer server started in a "
                                            "second process on 127.0.0.1 (TCP; see docs/rdma.md).")
    p.add_argument("--json", action="store_true", help="print one JSON object (as tierkv bench net --json)")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else 2
    results = bench_local(**_sizes(args.quick))
    if args.json:
        print(json.dumps(_report(results)))
    else:
        for r in results:
            print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
