"""Stores written by an earlier tierkv reopen with every durable page.

``data/stores-before-tier-names.tar.gz`` holds two store directories that
:func:`write_stores` made with tierkv as of commit 7c5861a, before tiers had names
apart from their kinds (its index names each tier's records, geometry and label by the
kind: ``nvme``, ``nvmeof``):

- ``plain``: NVMe and NVMe-oF (over a file) tiers, 10 pages spread over both;
- ``coded``: an NVMe tier with ``codec = "lossless"``, whose records carry extents.

To remake it (only when the on-disk format changes on purpose, which also needs a
format upgrade path): ``PYTHONPATH=<old tree> python3 -c "from tests.store.test_reopen_compat
import write_stores; write_stores('out')"``, then tar ``out/plain`` and ``out/coded``.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import lmdb
import numpy as np

from tierkv.config import NvmeConfig, NvmeofConfig, StoreConfig
from tierkv.layout import KVLayout
from tierkv.store.api import Store
from tierkv.store.index import PersistentIndex
from tierkv.store.index_runs import live_records

ARCHIVE = Path(__file__).parent / "data" / "stores-before-tier-names.tar.gz"
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="bf16", tokens_per_page=16)
PB = LAYOUT.page_bytes  # 4 KiB
LABEL = 4096
PLAIN_PAGES, CODED_PAGES = 10, 5


def smooth_pages(n: int, seed: int) -> np.ndarray:
    """BF16 pages of small-range values (they code to well under a block each)."""
    x = np.random.default_rng(seed).normal(0, 1, (n, PB // 2)).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, PB).copy()


def tokens(n: int) -> np.ndarray:
    return np.arange(n * LAYOUT.tokens_per_page, dtype=np.int64)


def configs(root: Path) -> tuple[StoreConfig, StoreConfig]:
    plain = root / "plain"
    return (StoreConfig(path=str(plain), model_id="compat", layout=LAYOUT,
                        nvme=NvmeConfig(6 * PB), nvmeof=NvmeofConfig(6 * PB, device=str(plain / "ns.img"))),
            StoreConfig(path=str(root / "coded"), model_id="compat", layout=LAYOUT,
                        nvme=NvmeConfig(6 * PB, codec="lossless")))


def write_stores(root: str | Path) -> None:
    """Make both stores under ``root`` with whatever tierkv is imported, and check them."""
    root = Path(root)
    plain, coded = configs(root)
    Path(plain.path).mkdir(parents=True)
    with open(Path(plain.path) / "ns.img", "wb") as f:
        f.truncate(LABEL + 6 * PB)
    for cfg, n, seed in ((plain, PLAIN_PAGES, 1), (coded, CODED_PAGES, 2)):
        with Store.open(cfg) as s:
            s.put(tokens(n), smooth_pages(n, seed))
        with Store.open(cfg) as s:
            assert s.get(tokens(n), np.empty((n, PB), np.uint8)).pages == n


def _records(store_dir: Path) -> dict[str, int]:
    """Records per tier database of a store's index (read straight from LMDB)."""
    env = lmdb.open(str(store_dir / "index.lmdb"), readonly=True, max_dbs=8, lock=False)
    try:
        with env.begin() as txn:
            names = [bytes(k).decode() for k, _ in txn.cursor()]
        out = {}
        for name in names:
            if name != "meta":
                with env.begin(db=env.open_db(name.encode(), create=False)) as txn:
                    out[name] = txn.stat()["entries"]
        return out
    finally:
        env.close()


def test_a_store_from_before_tier_names_reopens_with_every_page(tmp_path: Path) -> None:
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(tmp_path, filter="data")
    plain, coded = configs(tmp_path)
    before = _records(tmp_path / "plain")
    assert set(before) == {"nvme", "nvmeof"} and all(before.values())  # pages on both persistent tiers
    # A reader first (it changes nothing); readers see the NVMe tier's pages, 6 of the plain store's.
    for cfg, n, seed, seen in ((plain, PLAIN_PAGES, 1, 6), (coded, CODED_PAGES, 2, CODED_PAGES)):
        want = smooth_pages(n, seed)
        with Store.open(cfg, read_only=True) as s:
            got = np.zeros_like(want)
            assert s.get(tokens(n), got).pages == seen
            np.testing.assert_array_equal(got[:seen], want[:seen])
        with Store.open(cfg) as s:
            got = np.zeros_like(want)
            assert s.get(tokens(n), got).pages == n
            np.testing.assert_array_equal(got, want)
    after = _records(tmp_path / "plain")
    # The writer added the (empty) database of derived pages' origins, and carried the slot
    # tiers' per-key records into runs (format 4): every page is there.
    assert after.pop("derived:origins") == 0
    assert after == {"nvme": 0, "nvmeof": 0, "nvme:runs": 1, "nvmeof:runs": 1}
    index = PersistentIndex(tmp_path / "plain", ["nvme", "nvmeof"], read_only=True)
    try:
        assert sum(len(live_records(index, t)) for t in ("nvme", "nvmeof")) >= sum(before.values())
    finally:
        index.close()
    assert set(_records(tmp_path / "coded")) == {"nvme", "derived:origins"}
