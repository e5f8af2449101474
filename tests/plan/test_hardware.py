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


def test_profiles_ship_inside_the_package() -> None:
    """Package data, so an installed wheel finds them (tests/cli/test_wheel.py installs one)."""
    import tierkv.plan

    assert PROFILE_DIR == Path(tierkv.plan.__file__).resolve().parent / "profiles"
    assert profile_names() == ["dev-box", "h200-node"]


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
    ("nvme", "bandwidth_bytes_s", 0, "bandwidth_bytes_s must be a bandwidth >= 1 byte/s"),
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


@pytest.mark.parametrize("table, key, value, message", [
    (("gpu",), "hbm_bandwidth_bytes_s", 0, r"\[gpu\] hbm_bandwidth_bytes_s must be a bandwidth >= 1 byte/s, got 0"),
    (("nics", 1), "bandwidth_bytes_s", 0, r"\[nics\[1\]\] bandwidth_bytes_s must be a bandwidth >= 1 byte/s"),
    (("nics", 0), "bandwidth_bytes_s", "0GB", r"\[nics\[0\]\] bandwidth_bytes_s must be a bandwidth >= 1 byte/s"),
    (("tiers", "hbm"), "bandwidth_bytes_s", "1GB", r"unknown key\(s\) bandwidth_bytes_s in \[tiers.hbm\]"),
    (("tiers", "hbm"), "request_bandwidth_bytes_s", "1GB", r"unknown key\(s\) request_bandwidth_bytes_s in"),
    (("tiers", "hbm"), "shared", True, r"unknown key\(s\) shared in \[tiers.hbm\]"),
    (("tiers", "dram"), "capacity_bytes", 1000.5, r"\[tiers.dram\] capacity_bytes must be a whole number of bytes"),
    (("tiers", "hbm"), "capacity_bytes", 1e9 + 0.25, r"\[tiers.hbm\] capacity_bytes must be a whole number"),
    (("gpu",), "hbm_bytes", 141e9 + 0.5, r"\[gpu\] hbm_bytes must be a whole number of bytes"),
    (("tiers", "nvme"), "capacity_bytes", 1e30, r"\[tiers.nvme\] capacity_bytes must be a size from 0 to 1 EiB"),
    (("tiers", "nvme"), "request_bandwidth_bytes_s", "40GB",
     r"\[tiers.nvme\] request_bandwidth_bytes_s \(4e\+10\) must be <= bandwidth_bytes_s \(3e\+10\)"),
    (("tiers", "nvme"), "request_bandwidth_bytes_s", 0, r"request_bandwidth_bytes_s must be a bandwidth >= 1"),
])
def test_review_bad_values(table: tuple[object, ...], key: str, value: object, message: str) -> None:
    """Zero bandwidths, keys HBM does not use, fractional bytes and a request faster than its tier."""
    data = _h200()
    node: object = data
    for part in table:
        node = node[part]  # type: ignore[index]
    node[key] = value  # type: ignore[index]
    with pytest.raises(ConfigError, match=message):
        parse_profile(data, "p.toml")
