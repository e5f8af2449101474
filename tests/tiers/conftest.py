"""Fixtures for the tier conformance suite: one ``tier_factory`` per tier.

Every test that takes ``tier_factory`` runs once per entry of ``_BUILDERS``. To put a
new tier through the suite, add one line there (a builder taking the scratch
directories, ``num_slots`` and ``page_bytes``), plus a marker in ``_MARKS`` if it
needs hardware (``gpu``, ``rdma``, ``rig``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tierkv.codec import Codec, CodecMode
from tierkv.layout import DType, KVLayout, LayoutKind
from tierkv.store.coding import CodecChoice
from tierkv.tiers.aligned import ALIGN, round_up
from tierkv.tiers.base import Tier
from tierkv.tiers.blocks import BlockPageTier
from tierkv.tiers.dram import DramTier
from tierkv.tiers.hbm import HbmTier
from tierkv.tiers.nvme import NvmeTier
from tierkv.tiers.nvmeof import NvmeofTier, StaticLink
from tierkv.tiers.peer import loopback_peer_tier

SHM = Path("/dev/shm")


@dataclass(frozen=True)
class Scratch:
    """Where file-backed tiers put their files; ``name`` is unique per tier built."""

    disk: Path
    shm: Callable[[], Path]
    name: str


Builder = Callable[[Scratch, int, int], Tier]


def lossless(page_bytes: int) -> CodecChoice:
    """The lossless codec over pages of exactly ``page_bytes`` bytes (one FP8 latent row
    per page), so the suite's compressible rows are stored coded and the rest raw."""
    layout = KVLayout(1, 1, page_bytes, DType.FP8_E4M3, 1, LayoutKind.LATENT)
    return CodecChoice(CodecMode.LOSSLESS, Codec(layout))


def blocks(page_bytes: int) -> int:
    """4 KiB blocks per raw page: what a block tier reserves for each."""
    return round_up(page_bytes) // ALIGN


def _nvmeof_on_file(s: Scratch, n: int, p: int) -> NvmeofTier:
    """The NVMe-oF tier's own code (deadlines, monitor) over a file standing in for the namespace."""
    path = s.disk / s.name
    with open(path, "wb") as f:
        f.truncate(n * round_up(p))
    return NvmeofTier(StaticLink(path), n, p, io_timeout_s=10.0, monitor_interval_s=0.2)


_BUILDERS: dict[str, Builder] = {
    "dram": lambda s, n, p: DramTier(n, p),
    "nvme-odirect": lambda s, n, p: NvmeTier(s.disk / s.name, n, p),
    "nvme-buffered": lambda s, n, p: NvmeTier(s.shm() / s.name, n, p, o_direct=False),
    "hbm-cpu": lambda s, n, p: HbmTier(n, p, device="cpu"),
    "hbm-cuda": lambda s, n, p: HbmTier(n, p, device="cuda") if torch.cuda.is_available() else pytest.skip("no CUDA"),
    "nvmeof-file": _nvmeof_on_file,
    # The coded tiers ([tiers.nvme] or [tiers.nvmeof] codec = "lossless"): pages in runs of 4 KiB blocks.
    "nvme-coded": lambda s, n, p: BlockPageTier(NvmeTier(s.disk / s.name, n * blocks(p), ALIGN), n, p, lossless(p)),
    "nvmeof-coded": lambda s, n, p: BlockPageTier(_nvmeof_on_file(s, n * blocks(p), ALIGN), n, p, lossless(p)),
    "peer-tcp": lambda s, n, p: loopback_peer_tier(n, p),  # a PeerServer on 127.0.0.1 in this process
}
_MARKS: dict[str, pytest.MarkDecorator] = {"hbm-cuda": pytest.mark.gpu}

TierFactory = Callable[[int, int], Tier]


@pytest.fixture
def shm_dir() -> Iterator[Callable[[], Path]]:
    """A lazily made private directory in /dev/shm (tmpfs); skips where there is none."""
    made: list[Path] = []

    def get() -> Path:
        if not made:
            if not SHM.is_dir():
                pytest.skip("/dev/shm is absent")
            made.append(Path(tempfile.mkdtemp(prefix="tierkv-test-", dir=SHM)))
        return made[0]

    yield get
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=[pytest.param(name, marks=_MARKS.get(name, ())) for name in _BUILDERS])
def tier_factory(request: pytest.FixtureRequest, tmp_path: Path,
                 shm_dir: Callable[[], Path]) -> Iterator[TierFactory]:
    """``make(num_slots, page_bytes)`` builds an open tier; all are closed at teardown."""
    built: list[Tier] = []
    build = _BUILDERS[request.param]

    def make(num_slots: int, page_bytes: int) -> Tier:
        scratch = Scratch(disk=tmp_path, shm=shm_dir, name=f"tier{len(built)}.dat")
        tier = build(scratch, num_slots, page_bytes)
        built.append(tier)
        return tier

    yield make
    for tier in built:
        tier.close()


@pytest.fixture
def nvme_path(tmp_path: Path) -> Path:
    """A not-yet-existing file path on the real disk (ext4 here), where O_DIRECT works."""
    return tmp_path / "nvme.dat"
