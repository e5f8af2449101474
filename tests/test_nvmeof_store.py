"""A store over an NVMe-oF tier losing its namespace: misses while degraded, nothing wrong,
nothing durable lost, full service after recovery and after a restart.

The namespace is a file named by ``[tiers.nvmeof] device`` (a StaticLink): moving the
file away is a real loss the tier's monitor sees. tests/rig runs the same scenario
against the kernel's NVMe-oF target over soft-RoCE.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tests.conftest import LAYOUT, PB, page_data
from tests.polling import wait_for
from tierkv.api import Store
from tierkv.config import DramConfig, NvmeofConfig, StoreConfig
from tierkv.opening import LABEL_BYTES
from tierkv.tiers.base import TierKind

TPP = LAYOUT.tokens_per_page
SLOTS = 32


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed + 7000).integers(0, 50000, pages * TPP, dtype=np.int64)


def make(tmp_path: Path) -> tuple[StoreConfig, Path]:
    dev = tmp_path / "ns1.img"
    if not dev.exists():
        with open(dev, "wb") as f:
            f.truncate(LABEL_BYTES + SLOTS * PB)
    cfg = StoreConfig(path=str(tmp_path / "store"), model_id="m", layout=LAYOUT, dram=DramConfig(4 * PB),
                      nvmeof=NvmeofConfig(device=str(dev), io_timeout_s=2.0, monitor_interval_s=0.05))
    return cfg, dev


def load(store: Store, tokens: np.ndarray, n: int) -> tuple[int, np.ndarray]:
    out = np.zeros((n, PB), dtype=np.uint8)
    return store.get(tokens, out).pages, out


def state(store: Store) -> str:
    return store.stats().tiers["nvmeof"].state


def test_whole_namespace_is_the_default_capacity(tmp_path: Path) -> None:
    cfg, _ = make(tmp_path)
    with Store.open(cfg) as s:
        assert s.stats().tiers["nvmeof"].capacity_slots == SLOTS


def test_loss_turns_pages_into_misses_and_recovery_brings_them_back(tmp_path: Path) -> None:
    cfg, dev = make(tmp_path)
    prompts = [(prompt(i, 2), page_data(i, 2)) for i in range(6)]  # 12 pages, DRAM holds 4
    with Store.open(cfg) as s:
        for tokens, data in prompts:
            assert s.put(tokens, data).stored == 2
        first, first_data = prompts[0]
        assert s.lookup(first).tiers == (TierKind.NVMEOF,) * 2

        away = dev.with_suffix(".away")
        os.rename(dev, away)
        assert wait_for(lambda: state(s) == "degraded")
        assert s.lookup(first).cached_pages == 0
        n, out = load(s, first, 2)
        assert n == 0 and not out.any()
        # Stores still work: DRAM takes the pages, its victims are dropped, not demoted.
        new_tokens, new_data = prompt(50, 3), page_data(50, 3)
        assert s.put(new_tokens, new_data).stored == 3
        n, out = load(s, new_tokens, 3)
        assert n == 3 and np.array_equal(out, new_data)

        os.rename(away, dev)
        assert wait_for(lambda: state(s) == "available")
        n, out = load(s, first, 2)
        assert n == 2 and np.array_equal(out, first_data)

    with Store.open(cfg) as s:  # the index survived the episode and the restart
        for i, (tokens, data) in enumerate(prompts):
            n, out = load(s, tokens, 2)
            # Prompts 4 and 5 lived only in DRAM during the loss, so their victims were dropped.
            assert n == 2 if i < 4 else n <= 2
            assert np.array_equal(out[:n], data[:n])


def test_close_while_degraded_keeps_the_index(tmp_path: Path) -> None:
    cfg, dev = make(tmp_path)
    prompts = [(prompt(i, 2), page_data(i, 2)) for i in range(5)]
    s = Store.open(cfg)
    for tokens, data in prompts:
        s.put(tokens, data)
    away = dev.with_suffix(".away")
    os.rename(dev, away)
    assert wait_for(lambda: state(s) == "degraded")
    s.close()  # no flush, no writeback possible: must neither hang nor drop the index
    os.rename(away, dev)
    with Store.open(cfg) as s:
        tokens, data = prompts[0]
        n, out = load(s, tokens, 2)
        assert n == 2 and np.array_equal(out, data)
