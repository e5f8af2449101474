"""The DRAM tier's own behaviour beyond the conformance suite."""

from __future__ import annotations

import errno

import pytest

import tierkv.tiers.dram as dram
from tierkv.errors import CapacityError


def test_a_tier_that_does_not_fit_in_memory_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(nbytes: int) -> object:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(dram, "aligned_empty", no_memory)
    with pytest.raises(CapacityError, match=r"dram tier: cannot allocate 64\.0 GiB .*capacity_bytes"):
        dram.DramTier(1 << 20, 1 << 16)
