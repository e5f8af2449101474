"""The HBM tier beyond the conformance suite: device-tensor I/O, the DRAM <-> HBM copy table,
its config, and a store with an HBM tier on top (on device="cpu" here; on CUDA when present)."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import LAYOUT, PB, page_data
from tests.engine.targets import DEVICES, random_bytes
from tierkv.store.api import Store
from tierkv.config import DramConfig, HbmConfig, NvmeConfig, StoreConfig, config_from_dict
from tierkv.errors import CapacityError, ConfigError, InputError, StoreClosedError
from tierkv.keys import as_token_array
from tierkv.tiers.base import TierKind
from tierkv.tiers.dram import DramTier
from tierkv.tiers.hbm import HbmTier, dram_rows, dram_to_hbm, hbm_to_dram
from tierkv.store.transfer import COPY_TABLE

TIMEOUT_S = 30
WIDTH = 4096


def host(t: torch.Tensor, device: str) -> torch.Tensor:
    return t.pin_memory() if device == "cuda" else t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("side", ["device", "host"])
def test_tensor_io_round_trip(device: str, side: str) -> None:
    with HbmTier(16, WIDTH, device=device) as tier:
        src = random_bytes((5, WIDTH), seed=1)
        src = src.to(device) if side == "device" else host(src, device)
        kept = src.cpu().clone()
        everything = torch.from_numpy(np.full((16, WIDTH), 7, dtype=np.uint8))
        tier.write(list(range(16)), everything.numpy())
        slots = [9, 2, 3, 15, 0]
        tier.write_from(slots, src).result(timeout=TIMEOUT_S)
        assert torch.equal(src.cpu(), kept)
        dst = torch.zeros((8, WIDTH), dtype=torch.uint8)
        dst = dst.to(device) if side == "device" else host(dst, device)
        tier.read_into(slots, dst, rows=[7, 1, 2, 3, 0]).result(timeout=TIMEOUT_S)
        assert torch.equal(dst.cpu()[[7, 1, 2, 3, 0]], kept)
        assert not dst.cpu()[[4, 5, 6]].any()
        expected = everything.clone()
        expected[slots] = kept
        back = np.zeros((16, WIDTH), dtype=np.uint8)
        tier.read(list(range(16)), back)
        np.testing.assert_array_equal(back, expected.numpy())
        assert tier.pool.shape == (16, WIDTH) and tier.pool.device.type == device


@pytest.mark.parametrize("device", DEVICES)
def test_partial_width_rows_leave_the_slot_tail(device: str) -> None:
    with HbmTier(4, WIDTH, device=device) as tier:
        tier.write([0, 1], np.full((2, WIDTH), 1, dtype=np.uint8))
        tier.write_from([1], torch.full((1, 100), 9, dtype=torch.uint8, device=device)).result(timeout=TIMEOUT_S)
        back = np.zeros((2, WIDTH), dtype=np.uint8)
        tier.read([0, 1], back)
        assert (back[0] == 1).all() and (back[1, :100] == 9).all() and (back[1, 100:] == 1).all()


def test_tensor_io_checks_arguments() -> None:
    tier = HbmTier(4, WIDTH, device="cpu")
    ok = torch.zeros((2, WIDTH), dtype=torch.uint8)
    bad_cases = [
        (lambda: tier.write_from([0, 0], ok), "same destination twice"),
        (lambda: tier.read_into([0, 1], ok, rows=[1, 1]), "same destination twice"),
        (lambda: tier.write_from([0, 4], ok), "slot 4 out of range"),
        (lambda: tier.write_from([0], ok), "1 slots but 2 rows"),
        (lambda: tier.read_into([0, 1], ok, rows=[0, 2]), "row 2 out of range"),
        (lambda: tier.write_from([0, 1], torch.zeros((2, WIDTH + 1), dtype=torch.uint8)), "exceed the slot size"),
        (lambda: tier.write_from([0, 1], ok.float()), "uint8"),
        (lambda: tier.write_from([0, 1], torch.zeros((2, 2 * WIDTH), dtype=torch.uint8)[:, ::2]), "contiguous"),
    ]
    for call, message in bad_cases:
        with pytest.raises(InputError, match=message):
            call()
    tier.close()
    with pytest.raises(StoreClosedError):
        tier.read_into([0], ok[:1])
    with pytest.raises(StoreClosedError):
        _ = tier.pool


def test_copy_table_registers_hbm_pairs() -> None:
    # The table holds thin wrappers so that torch loads only for stores with an HBM tier.
    assert COPY_TABLE[(TierKind.HBM, TierKind.DRAM)].__name__ == hbm_to_dram.__name__
    assert COPY_TABLE[(TierKind.DRAM, TierKind.HBM)].__name__ == dram_to_hbm.__name__


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots", [([4, 5, 6], [0, 1, 2]), ([7, 0, 3], [5, 2, 6])], ids=["runs", "scattered"])
def test_dram_hbm_copies(device: str, slots: tuple[list[int], list[int]]) -> None:
    hbm_slots, dram_slots = slots
    with HbmTier(8, WIDTH, device=device) as hbm, DramTier(8, WIDTH) as dram:
        if device == "cuda":
            assert dram_rows(dram).is_pinned()
        h0, d0 = page_bytes(8, 1), page_bytes(8, 2)
        hbm.write(list(range(8)), h0)
        dram.write(list(range(8)), d0)
        staged = hbm_to_dram(hbm, hbm_slots, dram, dram_slots, WIDTH)
        np.testing.assert_array_equal(staged, h0[hbm_slots])
        expected_dram = d0.copy()
        expected_dram[dram_slots] = h0[hbm_slots]
        np.testing.assert_array_equal(read_all(dram, 8), expected_dram)
        np.testing.assert_array_equal(read_all(hbm, 8), h0)  # the source is unchanged
        dram.write(dram_slots, page_bytes(3, 3))
        staged = dram_to_hbm(dram, dram_slots, hbm, hbm_slots, WIDTH)
        np.testing.assert_array_equal(staged, page_bytes(3, 3))
        expected_hbm = h0.copy()
        expected_hbm[hbm_slots] = page_bytes(3, 3)
        np.testing.assert_array_equal(read_all(hbm, 8), expected_hbm)


def test_copy_functions_fall_back_for_other_tier_types() -> None:
    with HbmTier(2, WIDTH, device="cpu") as a, HbmTier(2, WIDTH, device="cpu") as b:
        a.write([0, 1], page_bytes(2, 4))
        np.testing.assert_array_equal(hbm_to_dram(a, [1], b, [0], WIDTH), page_bytes(2, 4)[1:])
        np.testing.assert_array_equal(read_all(b, 1), page_bytes(2, 4)[1:])


def page_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, WIDTH), dtype=np.uint8)


def read_all(tier: HbmTier | DramTier, n: int) -> np.ndarray:
    out = np.zeros((n, WIDTH), dtype=np.uint8)
    tier.read(list(range(n)), out)
    return out


# -- config and the store ------------------------------------------------------------------------
BASE = {"store": {"path": "/tmp/x", "model_id": "m"}, "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8}}


def test_hbm_config_parses() -> None:
    cfg = config_from_dict({**BASE, "tiers": {"hbm": {"capacity_bytes": "2GiB", "device": "cuda:1"},
                                              "dram": {"capacity_bytes": "1MiB"}}})
    assert cfg.hbm == HbmConfig(2 << 30, "cuda:1")
    assert config_from_dict({**BASE, "tiers": {"dram": {"capacity_bytes": "1MiB"}}}).hbm is None


@pytest.mark.parametrize(("hbm", "match"), [
    ({"capacity_bytes": "lots"}, "cannot parse"), ({"capacity_bytes": 1, "device": "tpu"}, "hbm.device"),
    ({"capacity_bytes": 1, "pinned": True}, "unknown key"),
])
def test_bad_hbm_configs(hbm: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_dict({**BASE, "tiers": {"hbm": hbm, "dram": {"capacity_bytes": "1MiB"}}})


def store_config(path: Path, hbm_pages: int, device: str = "cpu") -> StoreConfig:
    return StoreConfig(path=str(path), model_id="test-model", layout=LAYOUT, dram=DramConfig(8 * PB),
                       nvme=NvmeConfig(32 * PB), hbm=HbmConfig(hbm_pages * PB, device))


@pytest.mark.parametrize("device", DEVICES)
def test_store_with_an_hbm_tier(tmp_path: Path, device: str) -> None:
    """HBM on top: puts land there, evictions demote through the HBM -> DRAM copy-table entry."""
    tpp = LAYOUT.tokens_per_page
    prompts = [as_token_array(np.arange(4 * tpp) + 10_000 * (i + 1)) for i in range(4)]
    pages = [page_data(7 + i, 4) for i in range(4)]
    # LRU, so that which tier holds what is predictable: each prompt fills HBM and
    # pushes the previous one down.
    cfg = dataclasses.replace(store_config(tmp_path / "s", hbm_pages=4, device=device), policy="lru")
    with Store.open(cfg) as store:
        assert [t.kind for t in store._manager.tiers] == [TierKind.HBM, TierKind.DRAM, TierKind.NVME]
        for tokens, data in zip(prompts, pages):
            assert store.put(tokens, data).stored == 4
        for i, (tokens, data) in enumerate(zip(prompts, pages)):
            out = np.zeros_like(data)
            got = store.get(tokens, out)
            assert got.pages == 4
            np.testing.assert_array_equal(out, data)
            if i == 0:
                assert TierKind.HBM not in got.tiers  # the first prompt was demoted
        stats = store.stats()
        assert stats.tiers["hbm"].used_slots == 4
        assert stats.bytes_moved.get("hbm->dram", 0) > 0


def test_zero_hbm_capacity_disables_the_tier(tmp_path: Path) -> None:
    with Store.open(store_config(tmp_path / "s", hbm_pages=0)) as store:
        assert TierKind.HBM not in [t.kind for t in store._manager.tiers]


def test_hbm_smaller_than_a_page_is_refused(tmp_path: Path) -> None:
    cfg = StoreConfig(path=str(tmp_path / "s"), model_id="m", layout=LAYOUT, dram=DramConfig(4 * PB),
                      hbm=HbmConfig(PB - 1, "cpu"))
    with pytest.raises(ConfigError, match="holds no page"):
        Store.open(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_hbm_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        HbmTier(4, WIDTH, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_oversized_hbm_names_the_numbers() -> None:
    with pytest.raises(CapacityError, match=r"asked for .* GiB of HBM tier on cuda.*GiB free"):
        HbmTier(1 << 20, 1 << 30, device="cuda")  # 1 PiB
