"""tierkv in the peer harness (../shared/peers): the same put/get work, the same JSON lines.

Run through the harness so every peer and baseline is measured in the same run:

    PEERS_YOURS="$(which python3) $PWD/tools/peers_tierkv.py" bash ../shared/peers/run_all.sh

Tiers: ``dram`` (a DRAM-only store) and ``nvme`` (an NVMe-only store on an O_DIRECT file
in the harness's scratch directory, so every get is a cold device read). Both go
through the public Store API: keys, placement, checksums, the LMDB commit and the
copy are all inside the timed region. Every get is verified byte for byte.

The harness hands every store a list of separate page arrays, and ``Store.put`` takes
that list as it is (each page is copied once, straight into its slot or its bounce
buffer); ``get`` fills one batch buffer, whose rows are the pages. One big copy is faster
than many small ones, so a second baseline is emitted beside the harness's page-by-page
memcpy: ``baseline``/``memcpy-batch``, one ``np.copyto`` of the whole stacked batch, the
yardstick for the batched get.

A third tier, ``nvme-aligned``, is the same NVMe store given what NIXL's bench gives its
POSIX backend: pages and a get buffer in page-aligned memory (one anonymous mmap each,
filled outside the timed region), as a serving engine's pinned KV buffer is. The
harness's own arrays start 16 bytes past a page (``np.empty``), which O_DIRECT cannot
take here (``STATX_DIOALIGN`` memory alignment 512). Since the store's transfers are
checksummed, both go through the tier's huge-page bounce buffers, the copy being the
hash's pass (docs/design.md, "NVMe I/O"); before, ``nvme-aligned`` read and wrote the
caller's memory in place, at the speed its pages' physical layout allowed.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PEERS = Path(os.environ.get("PEERS_HARNESS", HERE.parent.parent / "shared" / "peers"))
sys.path.insert(0, str(PEERS))
sys.path.insert(0, str(HERE.parent))
import common  # type: ignore[import-not-found]  # noqa: E402

from tierkv.store.api import Store  # noqa: E402
from tierkv.bench.store import _layout_for  # noqa: E402
from tierkv.config import DramConfig, NvmeConfig, StoreConfig  # noqa: E402
from tierkv.tiers.aligned import aligned_empty  # noqa: E402


def memcpy_batch(args: object, pb: int, n: int) -> None:
    src = np.stack(common.make_pages(np, pb, n))
    dst = np.empty_like(src)
    for op, (a, b) in (("put", (dst, src)), ("get", (src, dst))):
        secs = common.timed(lambda: np.copyto(a, b), args.runs)  # type: ignore[attr-defined]
        common.emit("baseline", "memcpy-batch", op, pb, n, secs, verified=bool(np.array_equal(src, dst)))


def run_tier(args: object, tier: str, pb: int, n: int) -> None:
    listed = common.make_pages(np, pb, n)      # what the harness hands every store
    pages = np.stack(listed)
    out = np.empty_like(pages)
    if tier == "nvme-aligned":                 # NIXL's bench's memory: page-aligned, filled untimed
        held = aligned_empty(pb * n).reshape(n, pb)
        held[:] = pages
        listed = list(held)
        out = aligned_empty(pb * n).reshape(n, pb)
    layout = _layout_for(pb)
    root = Path(tempfile.mkdtemp(prefix=f"tierkv-{tier}-", dir=args.dir))  # type: ignore[attr-defined]
    cfg = StoreConfig(path=str(root), model_id="peers", layout=layout,
                      dram=DramConfig(pb * n) if tier == "dram" else None,
                      nvme=NvmeConfig(pb * n, io_threads=8) if tier.startswith("nvme") else None,
                      persist_on_close=False)
    counter = iter(range(1 << 30))
    tokens: list[np.ndarray] = []

    def fresh_tokens() -> None:  # every put stores new pages (evicting the previous batch)
        tokens.append(np.arange(n * 16, dtype=np.int64) + next(counter) * n * 16)

    try:
        with Store.open(cfg) as store:
            secs = common.timed(lambda: store.put(tokens[-1], listed),  # type: ignore[attr-defined]
                                args.runs, setup=fresh_tokens)
            common.emit("tierkv", tier, "put", pb, n, secs)

            def get() -> None:
                if store.get(tokens[-1], out).pages != n:
                    raise RuntimeError("tierkv get missed pages it had just stored")

            secs = common.timed(get, args.runs)  # type: ignore[attr-defined]
            verified = bool(np.array_equal(out, pages))
            common.emit("tierkv", tier, "get", pb, n, secs, verified=verified)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    args = common.parse_args("tierkv through the peer harness")
    for pb, n in args.shape_list:
        memcpy_batch(args, pb, n)
        for tier in ("dram", "nvme", "nvme-aligned"):
            try:
                run_tier(args, tier, pb, n)
            except Exception as exc:  # one failed cell must not hide the others
                common.emit_error("tierkv", tier, "put/get", pb, n, exc)


if __name__ == "__main__":
    main()
