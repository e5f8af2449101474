"""A store's NVMe tier takes disk space as it fills, not its whole capacity at open."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tests.conftest import PB, make_config, page_data
from tierkv.store.api import Store
from tierkv.tiers.nvme import RESERVE_STEP_BYTES

GiB = 1 << 30


def test_a_large_nvme_tier_with_a_few_pages_uses_little_disk(tmp_path: Path) -> None:
    cfg = make_config(tmp_path / "s", dram_pages=0, nvme_pages=8 * GiB // PB)   # 8 GiB, as configs/default.toml
    tokens, data = np.arange(4 * 16, dtype=np.int64), page_data(3, 4)
    with Store.open(cfg) as s:
        assert s.put(tokens, data).stored == 4
    data_file = Path(cfg.nvme_path())
    st = os.stat(data_file)
    assert st.st_size > 8 * GiB                            # the geometry is the configured one
    assert st.st_blocks * 512 <= 2 * RESERVE_STEP_BYTES    # the disk holds the label and a step of slots
    with Store.open(cfg) as s:                             # and the pages are there after a reopen
        out = np.zeros_like(data)
        assert s.get(tokens, out).pages == 4 and np.array_equal(out, data)
