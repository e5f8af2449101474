"""The store's NVMe-oF tier against the kernel's target, inside the rig guest.

A store whose lower tier is the rig's namespace, connected by the store itself
(``[tiers.nvmeof]`` with transport/traddr/subnqn): round trips over RDMA and TCP,
reopen after a restart, and faults injected on the target through ``nvmeof.configfs``
(namespace disabled, port unlinked) while the store runs: reads turn into misses within
the deadline, nothing wrong is returned, and the tier recovers when the target does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.rig.conftest import RIG_ADDR, RIG_HOSTNQN, RIG_NQN
from tests.polling import wait_for
from tierkv.store.api import Store
from tierkv.config import DramConfig, NvmeofConfig, StoreConfig
from tierkv.errors import ConfigError
from tierkv.layout import KVLayout
from tierkv.store.medium import format_medium
from tierkv.tiers.base import TierKind
from tierkv.tiers.nvmeof import NvmeofTier

pytestmark = pytest.mark.rig

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_page=16)  # 32 KiB pages
PB = LAYOUT.page_bytes
PORTS = {"rdma": ("4420", 1), "tcp": ("4421", 2)}  # transport -> (trsvcid, portid in rig-rdma.toml)
DEADLINE_S = 3.0


def pages(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, PB), dtype=np.uint8)


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed + 99).integers(0, 50000, n * LAYOUT.tokens_per_page, dtype=np.int64)


def tier_state(store: Store) -> str:
    return store.stats().tiers["nvmeof"].state


@pytest.fixture(params=["rdma", "tcp"])
def store_config(request: pytest.FixtureRequest, rig_target: object, tmp_path: Path) -> Iterator[StoreConfig]:
    trsvcid, _ = PORTS[request.param]
    fabric = NvmeofConfig(capacity_bytes=64 << 20, transport=request.param, traddr=RIG_ADDR, trsvcid=trsvcid,
                          subnqn=RIG_NQN, hostnqn=RIG_HOSTNQN, io_timeout_s=DEADLINE_S, monitor_interval_s=0.5,
                          ctrl_loss_tmo_s=-1, reconnect_delay_s=1, fast_io_fail_tmo_s=1, disconnect_on_close=True)
    yield StoreConfig(path=str(tmp_path / "store"), model_id="rig", layout=LAYOUT,
                      dram=DramConfig(4 * PB), nvmeof=fabric)


def fill(store: Store, n_prompts: int) -> list[tuple[np.ndarray, np.ndarray]]:
    out = [(tokens(i, 4), pages(i, 4)) for i in range(n_prompts)]
    for t, p in out:
        assert store.put(t, p).stored == 4
    return out


def check(store: Store, prompts: list[tuple[np.ndarray, np.ndarray]]) -> int:
    """Loads every prompt; every page returned must be exact. Returns the pages hit."""
    hit = 0
    for t, p in prompts:
        out = np.zeros_like(p)
        n = store.get(t, out).pages
        assert np.array_equal(out[:n], p[:n]), "wrong bytes returned"
        assert not out[n:].any(), "bytes written past the pages reported"
        hit += n
    return hit


def test_round_trip_and_reopen(store_config: StoreConfig) -> None:
    with Store.open(store_config) as s:
        prompts = fill(s, 16)  # 64 pages; DRAM holds 4, the rest go over the fabric
        assert s.lookup(prompts[0][0]).tiers == (TierKind.NVMEOF,) * 4
        assert check(s, prompts) == 64
        assert s.stats().bytes_moved.get("dram->nvmeof", 0) > 0
    with Store.open(store_config) as s:  # a restart: reconnect, adopt the index
        assert check(s, prompts) == 64


def test_namespace_disabled_mid_run(store_config: StoreConfig) -> None:
    from nvmeof.configfs import set_namespace_enabled
    with Store.open(store_config) as s:
        prompts = fill(s, 8)
        set_namespace_enabled(RIG_NQN, 1, False)
        try:
            start = time.monotonic()
            check(s, prompts)  # misses or exact pages, never wrong ones, never a hang
            assert time.monotonic() - start < 2 * DEADLINE_S * len(prompts)
            assert wait_for(lambda: tier_state(s) == "degraded", 2 * DEADLINE_S, step=0.1)
            assert check(s, prompts[:4]) <= 4 * 4
        finally:
            set_namespace_enabled(RIG_NQN, 1, True)
        assert wait_for(lambda: tier_state(s) == "available", 30, step=0.1)
        assert check(s, prompts) == 32


def test_port_removed_mid_run(store_config: StoreConfig) -> None:
    from nvmeof.configfs import link_port, unlink_port
    transport = store_config.nvmeof.transport  # type: ignore[union-attr]
    _, portid = PORTS[transport or "rdma"]
    with Store.open(store_config) as s:
        prompts = fill(s, 8)
        unlink_port(portid, RIG_NQN)
        try:
            assert wait_for(lambda: tier_state(s) == "degraded", 4 * DEADLINE_S, step=0.1)
            start = time.monotonic()
            assert check(s, prompts) <= 4  # only what DRAM holds
            assert time.monotonic() - start < DEADLINE_S
            # Stores keep working while the fabric is down.
            t, p = tokens(100, 2), pages(100, 2)
            assert s.put(t, p).stored == 2
        finally:
            link_port(portid, RIG_NQN)
        assert wait_for(lambda: tier_state(s) == "available", 30, step=0.1)
        # Prompts 0-6 live on the namespace; prompt 7 lived only in DRAM, and the put
        # while the fabric was down dropped two of its pages (no tier to demote them to).
        assert check(s, prompts[:7]) == 28
        assert check(s, prompts[7:]) <= 4


def test_a_namespace_of_another_store_is_refused_until_handed_over(store_config: StoreConfig) -> None:
    with Store.open(store_config) as s:
        prompts = fill(s, 2)
    other = replace(store_config, path=store_config.path + "-other")
    with pytest.raises(ConfigError, match="belongs to another tierkv store"):
        Store.open(other)                    # a second store on this namespace would destroy the first's pages
    with Store.open(store_config) as s:      # nothing was changed by the refusal
        assert check(s, prompts) == sum(len(p) for _, p in prompts) > 0
        fabric = next(t for t in s._manager.tiers if t.kind is TierKind.NVMEOF)
        assert isinstance(fabric, NvmeofTier)
        format_medium(fabric.path)           # handed over, as tierkv format --yes does (the device goes at close)
    with Store.open(other) as s:             # the other store labels it as its own
        assert check(s, prompts) == 0
    with pytest.raises(ConfigError, match="belongs to another tierkv store"):
        Store.open(store_config)             # now the first store is the stranger


def test_a_namespace_holding_foreign_data_needs_format(store_config: StoreConfig, rig_spec: object) -> None:
    """Issue 28 item 1: a namespace with non-tierkv data (here an XFS superblock's magic,
    written into the target's backing file) was labelled; now it is refused unchanged,
    and taken with format = true."""
    backing = Path(rig_spec.namespaces[0].path)  # type: ignore[attr-defined]
    with open(backing, "r+b") as f:
        f.write(b"XFSB" + b"\x00\x00\x10\x00" * 8)
        f.flush()
        os.fsync(f.fileno())
    with pytest.raises(ConfigError, match=r"holds data that is not this store's .*xfs superblock"):
        Store.open(store_config)
    with open(backing, "rb") as f:
        assert f.read(4) == b"XFSB"
    assert store_config.nvmeof is not None
    with Store.open(replace(store_config, nvmeof=replace(store_config.nvmeof, format=True))) as s:
        assert check(s, fill(s, 1)) == 4
