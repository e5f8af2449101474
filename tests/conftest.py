"""Shared fixtures: small layouts and stores on a real O_DIRECT file and a real LMDB index."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tierkv.store.api import Store
from tierkv.config import DramConfig, NvmeConfig, StoreConfig
from tierkv.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", tokens_per_page=16)
PB = LAYOUT.page_bytes  # 16 KiB: four 4 KiB blocks on the NVMe tier


def page_data(key_seed: int, n: int) -> np.ndarray:
    """Deterministic page bytes for a test prompt."""
    return np.random.default_rng(key_seed).integers(0, 256, (n, PB), dtype=np.uint8)


def make_config(path: Path, dram_pages: int = 4, nvme_pages: int = 16, **kw: object) -> StoreConfig:
    return StoreConfig(path=str(path), model_id="test-model", layout=LAYOUT,
                       dram=DramConfig(dram_pages * PB) if dram_pages else None,
                       nvme=NvmeConfig(nvme_pages * PB) if nvme_pages else None, **kw)  # type: ignore[arg-type]


@pytest.fixture
def store_config(tmp_path: Path) -> StoreConfig:
    return make_config(tmp_path / "store")


@pytest.fixture
def store(store_config: StoreConfig) -> Iterator[Store]:
    s = Store.open(store_config)
    yield s
    s.close()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the reliability suite's randomized scenarios many more times")


@pytest.fixture
def soak(request: pytest.FixtureRequest) -> bool:
    """Whether ``--soak`` was given: randomized reliability tests then run far longer."""
    return bool(request.config.getoption("--soak"))


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for Unix sockets (pytest's tmp paths can pass their 107-byte limit)."""
    d = Path(tempfile.mkdtemp(prefix="tkv-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def llama() -> object:
    """A small transformers Llama (random weights, from a config) for the splice and lossy
    tests (tests/splice/llama.py); skipped where torch or transformers is missing."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.splice.llama import make_llama
    return make_llama()
