"""Bulk-transfer benchmark of the NVMe tier against fio, measured in the same run.

``bench_nvme`` times :class:`~tierkv.tiers.nvme.NvmeTier` against fio (io_uring,
O_DIRECT) on the same file, block size and queue depth, after letting a short sweep
pick the tier's ``io_threads``; the DRAM tier is measured through the store API, in
:mod:`tierkv.bench.store`. The work is the one of the peer harness
(``/work/shared/peers``): a batch of ``pages`` pages written, then read back.

Figures are decimal GB/s (1e9 B/s) of page payload, the median of ``runs`` timed
repetitions after one untimed warm-up; the baseline's repetitions are interleaved
with the tier's so that both see the same machine. It returns a plain dict and prints
nothing. Called by :mod:`tierkv.bench.headline` (``tierkv bench store``), or by hand::

    python -c "from tierkv.bench.io import bench_nvme; print(bench_nvme('/tmp', 2 << 20, 64, 5, (1, 16)))"
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tierkv.errors import TierKVError
from tierkv.store.pages import PageList
from tierkv.store.transfer import direct_rows
from tierkv.tiers.aligned import aligned_empty
from tierkv.tiers.dram import DramTier
from tierkv.tiers.nvme import DEFAULT_MAX_IO_BYTES, NvmeTier

FIO_TIMEOUT_S = 300

Timed = Callable[[], float]  # runs one repetition, returns its wall seconds
#: Each buffer kind's (rows written from, rows read into).
Buffers = dict[str, tuple[np.ndarray | PageList, np.ndarray]]


def bench_nvme(dir: str | os.PathLike[str], page_bytes: int = 2 << 20, pages: int = 64, runs: int = 5,
               queue_depths: Sequence[int] = (1, 4, 16, 32), *, io_threads_options: Sequence[int] = (1, 2, 4, 8),
               max_io_bytes: int = DEFAULT_MAX_IO_BYTES) -> dict[str, object]:
    """NvmeTier write (with flush) and cold read GB/s against fio on the same file.

    ``dir`` must be on the filesystem under test; one scratch file of
    ``pages * slot_bytes`` is made there and removed at the end. The tier is timed
    with page-aligned caller buffers (what pinned host memory gives), with plain
    numpy buffers (which take the bounce path), with page-aligned buffers on huge
    pages (``*_huge``), and from and into a DRAM tier's slots as a demotion hands them
    down (``*_pool``; ``pool_huge_pages``: whether that memory is on huge pages). Both
    sides are tuned the same way: the tier's I/O threads are swept over ``io_threads_options`` and fio's queue depth over
    ``queue_depths`` (reads and writes each at their best depth), one pass each, before
    the interleaved timed runs. Raises TierKVError if fio is missing.
    """
    fio = shutil.which("fio")
    if fio is None:
        raise TierKVError("bench_nvme needs fio to measure the baseline: apt-get install fio")
    path = Path(dir) / "tierkv-bench-nvme.dat"
    path.unlink(missing_ok=True)
    nbytes = pages * page_bytes
    aligned_src = aligned_empty(nbytes).reshape(pages, page_bytes)
    aligned_src[...] = _random_pages(pages, page_bytes)
    # "unaligned" rows start 64 bytes past a page, as numpy and torch CPU tensors do.
    # "huge": page-aligned rows on transparent huge pages (aligned_empty's ``huge``), which
    # a direct transfer moves in fewer, larger pieces than scattered 4 KiB pages.
    # "pool": a DRAM tier's slots, as a demotion writes them down (through the bounce
    # buffers where the kernel gives its shared memory no huge pages: PageList.scattered),
    # and read into in place.
    pool = DramTier(2 * pages, page_bytes)
    try:
        unaligned_src, huge_src = _shifted(pages, page_bytes, 64), _huge(pages, page_bytes)
        for src in (unaligned_src, huge_src, pool.buffer[:pages, :page_bytes]):
            src[...] = aligned_src
        bufs: Buffers = {
            "aligned": (aligned_src, _shifted(pages, page_bytes, 0)),
            "unaligned": (unaligned_src, _shifted(pages, page_bytes, 64)),
            "huge": (huge_src, _huge(pages, page_bytes)),
            "pool": (direct_rows(pool, list(range(pages)), page_bytes), pool.buffer[pages:, :page_bytes])}
        sweep = {t: _sweep_point(path, pages, page_bytes, t, max_io_bytes, bufs) for t in io_threads_options}
        # Reads decide (writes land in the VM host's cache); both buffer kinds count,
        # since one thread saturates the disk in place but cannot overlap bounce copies.
        best = max(sweep, key=lambda t: (sweep[t]["read_gbps"] + sweep[t]["read_unaligned_gbps"],
                                         sweep[t]["write_gbps"] + sweep[t]["write_unaligned_gbps"]))
        tier = NvmeTier(path, pages, page_bytes, io_threads=best, max_io_bytes=max_io_bytes)
        with tier:  # not ``with NvmeTier(...) as tier``: Tier.__enter__ is typed to return Tier
            slots = list(range(pages))
            fio_sweep = _fio_sweep(fio, path, tier.slot_bytes, pages, queue_depths)
            depth = {rw: max(fio_sweep, key=lambda d: fio_sweep[d][f"{rw}_gbps"]) for rw in ("write", "read")}
            fio_w = _FioRun(fio, path, tier.slot_bytes, pages, depth["write"])
            fio_r = _FioRun(fio, path, tier.slot_bytes, pages, depth["read"])
            timed = {f"nvme_{name}": op for name, op in _tier_ops(tier, bufs).items()}
            timed["fio_write"] = lambda: fio_w("write")
            timed["fio_read"] = lambda: fio_r("read")
            secs = _interleaved(timed, runs)
            verified = _verify(tier, slots, bufs)
            direct = tier.direct
        huge_pool = pool.huge_pages
    finally:
        path.unlink(missing_ok=True)
        pool.close()
    gbps = _rates(secs, nbytes)
    return {
        "dir": os.fspath(dir), "page_bytes": page_bytes, "pages": pages, "runs": runs,
        "fio_queue_depth": depth, "io_threads": best, "max_io_bytes": max_io_bytes, "direct": direct,
        "fio_engine": fio_r.engine, "verified": verified,
        **{f"{k}_gbps": v for k, v in gbps.items()},
        "nvme_write_vs_fio": _ratio(gbps["nvme_write"], gbps["fio_write"]),
        "nvme_read_vs_fio": _ratio(gbps["nvme_read"], gbps["fio_read"]),
        "nvme_write_unaligned_vs_fio": _ratio(gbps["nvme_write_unaligned"], gbps["fio_write"]),
        "nvme_read_unaligned_vs_fio": _ratio(gbps["nvme_read_unaligned"], gbps["fio_read"]),
        "nvme_write_huge_vs_fio": _ratio(gbps["nvme_write_huge"], gbps["fio_write"]),
        "nvme_read_huge_vs_fio": _ratio(gbps["nvme_read_huge"], gbps["fio_read"]),
        "nvme_write_pool_vs_fio": _ratio(gbps["nvme_write_pool"], gbps["fio_write"]),
        "nvme_read_pool_vs_fio": _ratio(gbps["nvme_read_pool"], gbps["fio_read"]),
        "pool_huge_pages": huge_pool,
        "io_threads_sweep": sweep,
        "fio_queue_depth_sweep": fio_sweep,
        "spread_gbps": _spreads(secs, nbytes),
    }


# -- NVMe pieces -------------------------------------------------------------------------
def _put(tier: NvmeTier, slots: list[int], src: np.ndarray | PageList) -> Timed:
    def run() -> float:
        t0 = time.perf_counter()
        tier.write(slots, src)
        tier.flush()  # a put counts once it is durable
        return time.perf_counter() - t0
    return run


def _get(tier: NvmeTier, slots: list[int], dst: np.ndarray) -> Timed:
    return lambda: _clock(tier.read, slots, dst)


def _tier_ops(tier: NvmeTier, bufs: Buffers) -> dict[str, Timed]:
    """write/read (aligned buffers), and write_<kind>/read_<kind> for the other kinds
    (unaligned, huge, pool), over every slot."""
    slots = list(range(tier.num_slots))
    ops: dict[str, Timed] = {}
    for kind, (src, dst) in bufs.items():
        suffix = "" if kind == "aligned" else f"_{kind}"
        ops[f"write{suffix}"] = _put(tier, slots, src)
        ops[f"read{suffix}"] = _get(tier, slots, dst)
    return ops


def _sweep_point(path: Path, pages: int, page_bytes: int, threads: int, max_io_bytes: int,
                 bufs: Buffers) -> dict[str, float]:
    """Quick (three-repetition) figures of every tier op for one ``io_threads``."""
    tier = NvmeTier(path, pages, page_bytes, io_threads=threads, max_io_bytes=max_io_bytes)
    with tier:
        secs = _interleaved(_tier_ops(tier, bufs), 3)
    return {f"{k}_gbps": v for k, v in _rates(secs, pages * page_bytes).items()}


def _verify(tier: NvmeTier, slots: list[int], bufs: Buffers) -> bool:
    """Write then read back each buffer kind (fio has overwritten the file since)."""
    ok = True
    for src, dst in bufs.values():
        tier.write(slots, src)
        dst[...] = 0
        tier.read(slots, dst)
        ok = ok and bool(np.array_equal(np.stack(list(src)) if isinstance(src, PageList) else src, dst))
    return ok


def _fio_sweep(fio: str, path: Path, block_bytes: int, blocks: int,
               depths: Sequence[int]) -> dict[int, dict[str, float]]:
    """fio's write and read GB/s at each queue depth, one run each (write first: it lays
    the file out for the read)."""
    out: dict[int, dict[str, float]] = {}
    nbytes = block_bytes * blocks
    for d in depths:
        run = _FioRun(fio, path, block_bytes, blocks, d)
        w = run("write")
        r = run("read")
        out[d] = {"write_gbps": round(nbytes / w / 1e9, 3), "read_gbps": round(nbytes / r / 1e9, 3)}
    return out


class _FioRun:
    """One fio job on the tier's file: io_uring (libaio where refused), O_DIRECT."""

    def __init__(self, fio: str, path: Path, block_bytes: int, blocks: int, queue_depth: int) -> None:
        self._base = [fio, "--name=tierkv", f"--filename={path}", "--direct=1", f"--bs={block_bytes}",
                      f"--iodepth={queue_depth}", f"--size={block_bytes * blocks}", "--numjobs=1",
                      "--output-format=json"]
        self._bytes = block_bytes * blocks
        self.engine = "io_uring"

    def __call__(self, rw: str) -> float:
        """Seconds fio took for ``rw`` ("write" ends with an fsync, like the tier's put)."""
        extra = ["--end_fsync=1"] if rw == "write" else []
        try:
            return self._run(rw, extra)
        except TierKVError:
            if self.engine != "io_uring":
                raise
            self.engine = "libaio"  # io_uring is disabled in some sandboxes and kernels
            return self._run(rw, extra)

    def _run(self, rw: str, extra: list[str]) -> float:
        cmd = [*self._base, f"--ioengine={self.engine}", f"--rw={rw}", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=FIO_TIMEOUT_S, check=False)
        if proc.returncode != 0 or "{" not in proc.stdout:
            raise TierKVError(f"fio {rw} with {self.engine} exited {proc.returncode}: {proc.stderr.strip()[:300]}")
        side = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0][rw]
        if side["io_bytes"] < self._bytes or side["bw_bytes"] <= 0:
            raise TierKVError(f"fio {rw} moved {side['io_bytes']} of {self._bytes} bytes")
        return float(side["io_bytes"]) / float(side["bw_bytes"])


# -- timing helpers ------------------------------------------------------------------------------
def _clock(fn: Callable[..., object], *args: object) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _interleaved(ops: dict[str, Timed], runs: int) -> dict[str, list[float]]:
    """Seconds per repetition of each op, round-robin, after one untimed warm-up round.

    The order rotates every round: on the VM's disk an op measurably gains or loses
    from what ran just before it (a write after a write meets a busier host cache).
    """
    secs: dict[str, list[float]] = {name: [] for name in ops}
    names = list(ops)
    for rep in range(runs + 1):
        turn = rep % len(names)
        for name in names[turn:] + names[:turn]:
            dt = ops[name]()
            if rep:
                secs[name].append(dt)
    return secs


def _rates(secs: dict[str, list[float]], nbytes: int) -> dict[str, float]:
    return {name: round(statistics.median(nbytes / s / 1e9 for s in ss), 3) for name, ss in secs.items()}


def _spreads(secs: dict[str, list[float]], nbytes: int) -> dict[str, list[float]]:
    """[min, max] GB/s of each op, to judge how far the medians can be trusted."""
    return {name: [round(nbytes / max(ss) / 1e9, 3), round(nbytes / min(ss) / 1e9, 3)] for name, ss in secs.items()}


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def _shifted(pages: int, page_bytes: int, shift: int) -> np.ndarray:
    return aligned_empty(pages * page_bytes + shift)[shift:].reshape(pages, page_bytes)


def _huge(pages: int, page_bytes: int) -> np.ndarray:
    return aligned_empty(pages * page_bytes, huge=True).reshape(pages, page_bytes)


def _random_pages(pages: int, page_bytes: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.frombuffer(rng.bytes(pages * page_bytes), dtype=np.uint8).reshape(pages, page_bytes).copy()
