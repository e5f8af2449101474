"""The NVMe tier and NIXL's POSIX backend in one process, on the same file system, alternating.

The peer harness (``../shared/peers``) runs each store in a process of its own, and on
this project's virtio disk a direct transfer's speed depends on how the buffer's 4 KiB
pages happen to lie in physical memory (docs/benchmarks.md, "Huge-page I/O buffers"):
the same read ran 3 GB/s in one process and 7 in the next. Here NIXL (its three modes,
with the memory its bench gives it: an anonymous shared mmap) and the NVMe tier (from
numpy arrays, as the harness hands them; from page-aligned memory of its own; and from
NIXL's own two buffers, the same physical pages; every transfer checksummed, as the
store's are, so all three go through the tier's huge-page bounce buffers: docs/design.md,
"NVMe I/O") share one process and one minute: every repetition of every variant is
interleaved with the others, in a shuffled order each round. ``tier-shared`` against NIXL
is the same file system, the same minute and the same memory.

Run with the NIXL venv that ``../shared/peers/setup.sh nixl`` makes (it needs tierkv's
dependencies too: the script adds this tree and the system Python's site-packages to the
path, after the venv's own)::

    /tmp/peers/nixl/bin/python tools/nixl_side_by_side.py --dir /tmp/peers/scratch --json

Prints one JSON object: GB/s (1e9 B/s, median of ``--runs``) of every variant, and
``tier_vs_nixl_best``: each tier variant over NIXL's best mode, per op and shape. Every
read is checked byte for byte (its buffer cleared before it, outside the timed region;
every row holds bytes of its own). ``physical_runs``: per buffer, how many physically
contiguous runs its 4 KiB pages make (``/proc/self/pagemap``; null where the process may
not read frame numbers, which takes root): the fewer, the fewer pieces a direct transfer
goes out in (docs/benchmarks.md, "Whose memory is fast").
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import os
import random
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
# lmdb, xxhash and the rest of tierkv's dependencies, where the venv lacks them (after its own)
sys.path.append(sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["purelib"])

import numpy as np  # noqa: E402

from tierkv.tiers.aligned import aligned_empty  # noqa: E402
from tierkv.tiers.nvme import NvmeTier  # noqa: E402

Op = Callable[[], object]


def nixl_ops(fd: int, pb: int, n: int, src: np.ndarray, out: np.ndarray) -> dict[str, Op]:
    """put/get of the whole batch through NIXL's POSIX backend, one agent per mode."""
    from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]

    base, rbase = int(src.ctypes.data), int(out.ctypes.data)
    ops: dict[str, Op] = {}
    for mode, params in (("posixaio", {}), ("aio", {"use_aio": "true"}), ("uring", {"use_uring": "true"})):
        name = f"side-{mode}-{pb}"
        agent = nixl_agent(name, nixl_agent_config(backends=[]))
        agent.create_backend("POSIX", params)
        agent.register_memory([(base, pb * n, 0, "w"), (rbase, pb * n, 0, "r")], "DRAM", ["POSIX"])
        agent.register_memory([(0, pb * n, fd, "f")], "FILE", ["POSIX"])
        wsrc = agent.get_xfer_descs([(base + i * pb, pb, 0) for i in range(n)], "DRAM")
        rdst = agent.get_xfer_descs([(rbase + i * pb, pb, 0) for i in range(n)], "DRAM")
        fdesc = agent.get_xfer_descs([(i * pb, pb, fd) for i in range(n)], "FILE")

        def run(op: str, local: object, agent: object = agent, fdesc: object = fdesc, name: str = name) -> None:
            h = agent.initialize_xfer(op, local, fdesc, name, backends=["POSIX"])  # type: ignore[attr-defined]
            state = agent.transfer(h)  # type: ignore[attr-defined]
            while state == "PROC":
                state = agent.check_xfer_state(h)  # type: ignore[attr-defined]
            agent.release_xfer_handle(h)  # type: ignore[attr-defined]
            if state != "DONE":
                raise RuntimeError(f"NIXL {op} ({mode}) ended {state}")

        ops[f"put nixl-{mode}"] = functools.partial(run, "WRITE", wsrc)
        ops[f"get nixl-{mode}"] = functools.partial(run, "READ", rdst)
    return ops


def physical_runs(buf: np.ndarray) -> int | None:
    """How many runs of physically consecutive frames ``buf``'s pages make (1: contiguous;
    one per page: scattered), or None where ``/proc/self/pagemap`` gives no frame numbers."""
    page = mmap.PAGESIZE
    first, last = buf.ctypes.data // page, (buf.ctypes.data + buf.nbytes - 1) // page
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    except OSError:
        return None
    if not (entries >> np.uint64(63)).all():   # a page not present (never touched, or swapped out)
        return None
    frames = (entries & np.uint64((1 << 55) - 1)).astype(np.int64)
    if not frames.any():                       # frame numbers hidden (no CAP_SYS_ADMIN)
        return None
    return int(1 + np.count_nonzero(np.diff(frames) != 1))


def shape(directory: str, pb: int, n: int, runs: int) -> dict[str, object]:
    rng = np.random.default_rng(0)
    want = np.empty((n, pb), np.uint8)   # every row its own bytes: a row read from another slot shows
    want[:] = rng.integers(1, 255, size=pb, dtype=np.uint8)
    want[:, :8] = np.arange(n, dtype=np.uint64).view(np.uint8).reshape(n, 8)
    nixl_path = os.path.join(directory, f"side-nixl-{os.getpid()}.dat")
    tier_path = os.path.join(directory, f"side-tier-{os.getpid()}.dat")
    fd = os.open(nixl_path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        os.posix_fallocate(fd, 0, pb * n)
        shared = np.frombuffer(mmap.mmap(-1, pb * n), dtype=np.uint8).reshape(n, pb)     # NIXL bench's memory
        shared_out = np.frombuffer(mmap.mmap(-1, pb * n), dtype=np.uint8).reshape(n, pb)
        shared[:] = want
        shared_out[:] = 0
        ops = nixl_ops(fd, pb, n, shared, shared_out)
        numpy_src, numpy_out = np.empty((n, pb), np.uint8), np.zeros((n, pb), np.uint8)   # the harness's arrays
        numpy_src[:] = want
        aligned_src = aligned_empty(pb * n).reshape(n, pb)
        aligned_out = aligned_empty(pb * n).reshape(n, pb)
        aligned_src[:] = want
        outs = {"nixl-posixaio": shared_out, "nixl-aio": shared_out, "nixl-uring": shared_out,
                "tier-numpy": numpy_out, "tier-aligned": aligned_out, "tier-shared": shared_out}
        verified = True
        with NvmeTier(tier_path, n, pb, io_threads=8) as tier:
            slots = list(range(n))
            ops["put tier-numpy"] = lambda: tier.write(slots, numpy_src, checksums=True)
            ops["get tier-numpy"] = lambda: tier.read(slots, numpy_out, checksums=True)
            ops["put tier-aligned"] = lambda: tier.write(slots, aligned_src, checksums=True)
            ops["get tier-aligned"] = lambda: tier.read(slots, aligned_out, checksums=True)
            # NIXL's own buffers (bounced, not on huge pages), which it reads and writes meanwhile:
            # puts read `shared`, gets fill `shared_out`, and no two transfers overlap
            ops["put tier-shared"] = lambda: tier.write(slots, shared, checksums=True)
            ops["get tier-shared"] = lambda: tier.read(slots, shared_out, checksums=True)
            secs: dict[str, list[float]] = {k: [] for k in ops}
            ops["put nixl-posixaio"]()   # both files hold the pages before any get, whatever the order
            ops["put tier-numpy"]()
            for _ in range(runs):
                order = list(ops)
                random.shuffle(order)
                for k in order:
                    op, who = k.split(" ")
                    if op == "get":   # every get's bytes checked: its buffer cleared before it
                        outs[who][:] = 0
                    ops[k]()   # untimed: the same transfer again, as the harness's warm-up
                    if op == "get":
                        verified = verified and bool(np.array_equal(outs[who], want))
                        outs[who][:] = 0
                    t0 = time.perf_counter()
                    ops[k]()
                    secs[k].append(time.perf_counter() - t0)
                    if op == "get":
                        verified = verified and bool(np.array_equal(outs[who], want))
            layout = {"nixl_src": physical_runs(shared), "nixl_out": physical_runs(shared_out),
                      "aligned_src": physical_runs(aligned_src), "aligned_out": physical_runs(aligned_out)}
    finally:
        os.close(fd)
        for p in (nixl_path, tier_path):
            Path(p).unlink(missing_ok=True)
    gbps = {k: round(pb * n / statistics.median(v) / 1e9, 3) for k, v in secs.items()}
    ratios = {}
    for op in ("put", "get"):
        best = max(v for k, v in gbps.items() if k.startswith(f"{op} nixl-"))
        for kind in ("numpy", "aligned", "shared"):
            ratios[f"{op} tier-{kind}"] = round(gbps[f"{op} tier-{kind}"] / best, 3)
    return {"page_bytes": pb, "pages": n, "runs": runs, "verified": verified, "gbps": gbps,
            "tier_vs_nixl_best": ratios, "physical_runs": layout, "pages_4k": pb * n // mmap.PAGESIZE}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/peers/scratch", help="scratch directory on the file system under test")
    p.add_argument("--shapes", default="2097152x64,262144x512", help="page_bytes x pages, comma-separated")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", action="store_true", help="one JSON object (the default prints a table)")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    stdout = os.dup(1)
    os.dup2(2, 1)   # NIXL logs to standard output: to standard error meanwhile, so the JSON stands alone
    try:
        result = [shape(args.dir, pb, n, args.runs) for pb, n in shapes]
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
        os.close(stdout)
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        for r in result:
            print(f"{r['page_bytes']} B x {r['pages']} (GB/s, median of {r['runs']}; verified {r['verified']})")
            for k, v in r["gbps"].items():  # type: ignore[attr-defined]
                print(f"  {k:18} {v:6.2f}  {r['tier_vs_nixl_best'].get(k, '')}")  # type: ignore[attr-defined]
            print(f"  physical runs of {r['pages_4k']} pages: {r['physical_runs']}")
        sys.stdout.flush()
    os._exit(0)   # NIXL's agents do not always stop their threads


if __name__ == "__main__":
    main()
