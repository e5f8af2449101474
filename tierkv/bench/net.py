"""``tierkv bench net``: page-fetch latency and throughput over RDMA and the TCP fallback,
and incast pushes with and without receive credits, all against one peer in one run.

:func:`run_net_bench` measures against a running :class:`tierkv.net.PeerServer` whose
store published ``pages`` pages under the keys ``i.to_bytes(16, "little")``;
:func:`bench_local` starts such a server in a second process on 127.0.0.1 first (the
host path: TCP only where there is no RDMA device). Results are frozen dataclasses; the
ratios against TCP are computed in the same run. :func:`net_report` is ``tierkv bench
net``; :func:`main` is ``python3 -m tierkv.bench.net [--json] [--quick]``.

Incast with credits on and off differs in the credit gate only: both sides send with
the same window (:data:`INCAST_WINDOW`), so the ratio measures the gate, not the window.
Every page is checked twice: by the transport (checksum and generation) and, outside
the timed part, byte for byte against its source (fetched pages against the pages the
peer published, where the caller gives them; incast pushes by reading them back once).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tierkv.net import NetConfig, connect
from tierkv.net.wire import PageMeta
from tierkv.tiers.peer import PeerDramTier

# Both incast sides: one link, 8 requests in flight per connection against a server that
# posts 4 receives, so without credits the sender overruns the receiver and is NAKed.
INCAST_WINDOW = 8
INCAST_LINKS = 1
SERVER_RECV_CREDITS = 4


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
    mismatches: int | None = None  # pages whose bytes differ from their source; None: not byte-checked

    def __str__(self) -> str:
        checked = "unchecked" if self.mismatches is None else str(self.mismatches)
        return (f"{self.kind:4} {self.case:18} p50 {self.p50_us:9.1f} us  p99 {self.p99_us:9.1f} us  "
                f"{self.pages_per_s:9.0f} pages/s  {self.gb_per_s:6.3f} GB/s  misses {self.misses}  "
                f"naks/rnr {self.naks}  mismatches {checked}")


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


def _source(pages: int, page_bytes: int) -> np.ndarray:
    """The pages :func:`_serve` publishes: row ``i`` under key ``i``."""
    return np.frombuffer(np.random.default_rng(0).bytes(pages * page_bytes), np.uint8).reshape(pages, page_bytes)


def _fetch(kind: str, host: str, port: int, page_bytes: int, pages: int, fetches: int,
           source: np.ndarray | None = None) -> list[NetBenchResult]:
    """Single and batched fetches of the published pages; with ``source`` (row ``i``: the
    page under key ``i``), each fetch is compared byte for byte after its timed part."""
    with PeerDramTier(connect(host, port, kind, NetConfig(timeout_s=10.0))) as tier:  # type: ignore[arg-type]
        metas = tier.lookup([_key(i) for i in range(pages)])
        idx = [i for i, m in enumerate(metas) if m is not None]
        found = [m for m in metas if m is not None]
        bad: int | None = None if source is None else 0
        one = np.empty((1, page_bytes), np.uint8)
        lat, misses = [], 0
        for i in range(fetches):
            t0 = time.perf_counter()
            misses += tier.fetch_remote([found[i % len(found)]], one).misses
            lat.append(time.perf_counter() - t0)
            if source is not None:
                bad = _count_bad(bad, one, source[[idx[i % len(found)]]])
        out = [NetBenchResult(kind, "fetch-1", _pct(lat, 50), _pct(lat, 99), fetches / sum(lat),
                              fetches * page_bytes / sum(lat) / 1e9, misses, 0, bad)]
        dst = np.empty((len(found), page_bytes), np.uint8)
        want = None if source is None else source[idx]
        rounds = max(3, fetches // len(found))
        lat, misses, bad = [], 0, None if source is None else 0
        for _ in range(rounds):
            dst.fill(0)  # a round that wrote nothing must not pass on the previous round's bytes
            t0 = time.perf_counter()
            misses += tier.fetch_remote(found, dst).misses
            lat.append(time.perf_counter() - t0)
            if want is not None:
                bad = _count_bad(bad, dst, want)
        n = rounds * len(found)
        out.append(NetBenchResult(kind, "fetch-batch", _pct(lat, 50), _pct(lat, 99), n / sum(lat),
                                  n * page_bytes / sum(lat) / 1e9, misses, 0, bad))
        return out


def _count_bad(so_far: int | None, got: np.ndarray, want: np.ndarray) -> int:
    """``so_far`` plus the rows of ``got`` that differ from ``want``."""
    return (so_far or 0) + int((got != want).any(axis=1).sum())


def _incast(kind: str, host: str, port: int, page_bytes: int, per_sender: int, senders: int,
            credits: bool, base_slot: int) -> NetBenchResult:
    """``senders`` threads each push ``per_sender`` pages at once; credits on or off, nothing
    else changes. After the timed part the stored pages are read back and compared."""
    cfg = NetConfig(timeout_s=20.0, links=INCAST_LINKS, recv_credits=4, window=INCAST_WINDOW, credits=credits)
    lat: list[float] = []
    misses = [0]
    stored: dict[int, tuple[PageMeta | None, int]] = {}  # slot -> (meta written, sender)
    lock = threading.Lock()
    rnr0 = _rnr_total() if kind == "rdma" else 0

    def sender(i: int) -> None:
        with connect(host, port, kind, cfg) as tr:  # type: ignore[arg-type]
            src = _sender_page(i, page_bytes)
            futs = []
            for b in range(per_sender):
                slot = base_slot + i * per_sender + b
                futs.append((slot, time.perf_counter(), tr.write([slot], [time.time_ns()], src)))
            for slot, t0, f in futs:
                r = f.result(60)
                with lock:
                    lat.append(time.perf_counter() - t0)
                    misses[0] += 0 if r.all_stored else 1
                    if r.all_stored:
                        stored[slot] = (r.metas[0] if r.metas else None, i)
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
    bad = _read_back(kind, host, port, page_bytes, stored)
    return NetBenchResult(kind, "incast-credits" if credits else "incast-no-credits", _pct(lat, 50), _pct(lat, 99),
                          n / wall, n * page_bytes / wall / 1e9, misses[0], naks, bad)


def _sender_page(i: int, page_bytes: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(i).bytes(page_bytes), np.uint8).reshape(1, page_bytes)


def _read_back(kind: str, host: str, port: int, page_bytes: int,
               stored: Mapping[int, tuple[PageMeta | None, int]], batch: int = 64) -> int:
    """The pages of ``stored`` that do not read back (checksum, generation) as the bytes their sender pushed."""
    slots = sorted(stored)
    bad = 0
    with connect(host, port, kind, NetConfig(timeout_s=20.0)) as tr:  # type: ignore[arg-type]
        for lo in range(0, len(slots), batch):
            part = slots[lo:lo + batch]
            dst = np.zeros((len(part), page_bytes), np.uint8)
            res = tr.read(part, dst, [stored[s][0] for s in part]).result(60)
            want = np.concatenate([_sender_page(stored[s][1], page_bytes) for s in part])
            bad += sum(1 for j in range(len(part)) if not res.ok[j] or not np.array_equal(dst[j], want[j]))
    return bad


def run_net_bench(host: str, port: int, kinds: Sequence[str] = ("tcp",), page_bytes: int = 65536,
                  pages: int = 64, fetches: int = 500, senders: int = 4,
                  source: np.ndarray | None = None) -> list[NetBenchResult]:
    """Every case for every transport kind against the peer at ``host:port``, which holds
    at least ``pages + senders * fetches // senders`` slots past the published ones.
    ``source`` (``uint8 [pages, page_bytes]``, row ``i`` published under key ``i``), when
    given, has fetched pages compared byte for byte; otherwise their ``mismatches`` is None."""
    out: list[NetBenchResult] = []
    per = max(8, fetches // senders)
    for kind in kinds:
        out += _fetch(kind, host, port, page_bytes, pages, fetches, source)
        for credits in (True, False):
            out.append(_incast(kind, host, port, page_bytes, per, senders, credits, base_slot=pages))
    return out


def _serve(port: int, slots: int, page_bytes: int, pages: int, ready: object) -> None:
    from tierkv.net import PeerServer
    from tierkv.tiers.dram import DramTier

    server = PeerServer(DramTier(slots, page_bytes), "127.0.0.1", port, NetConfig(recv_credits=SERVER_RECV_CREDITS))
    server.store.store([_key(i) for i in range(pages)], _source(pages, page_bytes))
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
        return run_net_bench("127.0.0.1", port, ("tcp",), page_bytes, pages, fetches, senders,
                             source=_source(pages, page_bytes))
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
    out: dict[str, object] = {"results": [r.__dict__ for r in results],
                              "incast": {"window": INCAST_WINDOW, "links": INCAST_LINKS,
                                         "server_recv_credits": SERVER_RECV_CREDITS},
                              "mismatches": _mismatches(results)}
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


def _mismatches(results: Sequence[NetBenchResult]) -> int:
    """Pages, over every case, whose bytes differed from their source."""
    return sum(r.mismatches or 0 for r in results)


def main(argv: Sequence[str] | None = None) -> int:
    """``python3 -m tierkv.bench.net``: :func:`bench_local`, one line per case (or
    ``--json``: what ``tierkv bench net --json`` prints). Returns the exit status: 1 when
    any page's bytes differed from its source (the figures are still printed)."""
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
    bad = _mismatches(results)
    if bad:
        print(f"tierkv.bench.net: {bad} pages differed from their source", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
