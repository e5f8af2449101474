"""Hardware profiles: the shipped ones load; missing, negative and unknown fields are refused."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tierkv.errors import ConfigError
from tierkv.plan.hardware import PROFILE_DIR, TierKind, load_profile, parse_profile, profile_names


def test_shipped_profiles() -> None:
    assert {"h200-node", "dev-box"} <= set(profile_names())
    h200 = load_profile("h200-node")
    assert h200.gpu.count == 8 and h200.gpu.hbm_bytes == 141 * 10**9
    assert h200.cluster.disaggregated and h200.cluster.nodes == 2
    assert [t.kind for t in h200.tiers] == list(TierKind)
    nvmeof = h200.tier(TierKind.NVMEOF)
    assert nvmeof is not None and nvmeof.shared and nvmeof.capacity_bytes == 500 * 10**12
    assert any(n.reaches_storage for n in h200.nics) and any(n.reaches_compute for n in h200.nics)
    dev = load_profile(PROFILE_DIR / "dev-box.toml")
    assert not dev.cluster.disaggregated and dev.tier(TierKind.NVMEOF) is None


def _h200() -> dict[str, object]:
    return tomllib.loads((PROFILE_DIR / "h200-node.toml").read_text())


def test_missing_field_names_table_and_field() -> None:
    data = _h200()
    del data["tiers"]["dram"]["bandwidth_bytes_s"]  # type: ignore[index,attr-defined]
    with pytest.raises(ConfigError, match=r"\[tiers.dram\] is missing bandwidth_bytes_s"):
        parse_profile(data, "p.toml")
    data = _h200()
    del data["gpu"]
    with pytest.raises(ConfigError, match=r"missing table \[gpu\]"):
        parse_profile(data, "p.toml")


@pytest.mark.parametrize("table, key, value, message", [
    ("dram", "capacity_bytes", -5, "size >= 0, got -5"),
    ("dram", "capacity_bytes", "-5GiB", "size >= 0, got '-5GiB'"),
    ("nvme", "bandwidth_bytes_s", 0, "bandwidth_bytes_s must be > 0"),
    ("nvme", "latency_s", -1e-6, "finite number >= 0"),
    ("nvme", "bandwith_bytes_s", "1GB", "unknown key"),
    ("dram", "capacity_bytes", "lots", "cannot parse 'lots'"),
])
def test_bad_tier_values(table: str, key: str, value: object, message: str) -> None:
    data = _h200()
    data["tiers"][table][key] = value  # type: ignore[index]
    with pytest.raises(ConfigError, match=message):
        parse_profile(data, "p.toml")


def test_nvmeof_needs_a_storage_nic_and_pd_needs_a_compute_nic() -> None:
    data = _h200()
    data["nics"] = [n for n in data["nics"] if not n.get("reaches_storage")]  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="reaches_storage = true"):
        parse_profile(data, "p.toml")
    data = _h200()
    data["nics"] = [n for n in data["nics"] if n.get("reaches_storage")]  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="reaches compute"):
        parse_profile(data, "p.toml")


def test_unknown_profile_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="h200-node"):
        load_profile("no-such-box")
    (tmp_path / "x.toml").write_text("[gpu\n")
    with pytest.raises(ConfigError, match="not readable TOML"):
        load_profile(tmp_path / "x.toml")


def test_with_capacity() -> None:
    h200 = load_profile("h200-node")
    assert h200.with_capacity(TierKind.NVME, 0).tier(TierKind.NVME) is None
    dram = h200.with_capacity(TierKind.DRAM, 10**12).tier(TierKind.DRAM)
    assert dram is not None and dram.capacity_bytes == 10**12
    with pytest.raises(ConfigError, match="has no nvmeof tier"):
        load_profile("dev-box").with_capacity(TierKind.NVMEOF, 10**12)
