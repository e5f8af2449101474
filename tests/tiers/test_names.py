"""A tier's identity (its name) apart from its kind (its medium)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiers.conftest import lossless
from tierkv.errors import InputError
from tierkv.tiers.aligned import ALIGN
from tierkv.tiers.base import TierKind, tier_id
from tierkv.tiers.blocks import BlockPageTier
from tierkv.tiers.dram import DramTier
from tierkv.tiers.nvme import NvmeTier
from tierkv.tiers.peer import loopback_peer_tier


def test_a_tier_is_named_after_its_kind_unless_named(tmp_path: Path) -> None:
    with DramTier(2, 4096) as d, NvmeTier(tmp_path / "a", 2, 4096) as a, \
            NvmeTier(tmp_path / "b", 2, 4096, name="nvme-b") as b:
        assert (d.name, d.kind) == ("dram", TierKind.DRAM)
        assert (a.name, a.kind) == ("nvme", TierKind.NVME)
        assert (b.name, b.kind) == ("nvme-b", TierKind.NVME)


@pytest.mark.parametrize("bad", ["", "Nvme", "2nd", "nvme b", "caller", "meta", "x" * 33, "nvme->dram"])
def test_bad_tier_names_are_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(InputError, match="tier name"):
        tier_id(bad)
    with pytest.raises(InputError, match="tier name"):
        DramTier(2, 4096, name=bad)


def test_a_block_tier_is_its_medium_addressed_in_pages(tmp_path: Path) -> None:
    blocks = NvmeTier(tmp_path / "b", 8, ALIGN, name="nvme-coded")
    with BlockPageTier(blocks, 4, 8192, lossless(8192)) as t:
        assert (t.name, t.kind) == ("nvme-coded", TierKind.NVME)


def test_the_peer_tier_does_not_pose_as_dram() -> None:
    with loopback_peer_tier(2, 4096) as peer:
        assert peer.kind is TierKind.PEER and peer.name == "peer"
