"""FabricLink over a sysfs tree laid out as Linux 6.1 does for nvme-rdma: finding the
namespace, following the controller's state, and the tier degrading and recovering with it.

The controller is already connected in the tree, so no connect is attempted; the block
device node is a plain file. The rig runs the same link against the kernel.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.nvmeof.test_sysfs import HOSTNQN, add_controller
from tests.polling import wait_for
from tierkv.config import NvmeofConfig
from tierkv.errors import ConfigError, TierIOError
from tierkv.tiers.aligned import round_up
from tierkv.tiers.fabric import FabricLink, _read_secret, open_nvmeof_tier

NQN = "nqn.2026-12.io.tierkv:rig"
PAGE = 8192
HEADER = 4096


def cfg(**kw: object) -> NvmeofConfig:
    # The controllers in the tree carry HOSTNQN: name it, or the link takes this machine's
    # /etc/nvme/hostnqn (random on a fresh machine) and matches none of them.
    base: dict[str, object] = dict(transport="rdma", traddr="10.77.0.1", subnqn=NQN, hostnqn=HOSTNQN,
                                   io_timeout_s=1.0, monitor_interval_s=0.05)
    base.update(kw)
    return NvmeofConfig(**base)  # type: ignore[arg-type]


def fabric(tmp_path: Path, state: str = "live") -> tuple[Path, Path, Path]:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    add_controller(sysfs, ctrl=0, subsys=1, nqn=NQN, state=state, dev_root=dev)
    node = dev / "nvme1n1"
    with open(node, "r+b") as f:
        f.truncate(HEADER + 8 * round_up(PAGE))
    return sysfs, dev, sysfs / "class" / "nvme" / "nvme0" / "state"


def test_status_follows_the_controller(tmp_path: Path) -> None:
    sysfs, dev, state = fabric(tmp_path)
    link = FabricLink(cfg(), connect=False, sysfs_root=str(sysfs), dev_root=str(dev))
    st = link.status()
    assert st.live and st.device == str(dev / "nvme1n1")
    assert link.attach() == str(dev / "nvme1n1")
    state.write_text("connecting\n")
    st = link.status()
    assert not st.live and "connecting" in st.detail
    assert link.reattach() is None  # the kernel is retrying: the link waits for it
    other = FabricLink(cfg(transport="tcp"), connect=False, sysfs_root=str(sysfs), dev_root=str(dev))
    assert "no tcp controller" in other.status().detail


def test_read_only_link_never_connects(tmp_path: Path) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    link = FabricLink(cfg(), connect=False, sysfs_root=str(sysfs), dev_root=str(dev))
    with pytest.raises(TierIOError, match="may not connect"):
        link.attach()


def test_tier_degrades_with_the_controller_and_recovers(tmp_path: Path) -> None:
    sysfs, dev, state = fabric(tmp_path)
    link = FabricLink(cfg(), connect=False, sysfs_root=str(sysfs), dev_root=str(dev))
    tier = open_nvmeof_tier(cfg(), PAGE, header_bytes=HEADER, connect=False, link=link)
    try:
        assert tier.num_slots == 8  # the whole namespace past the label
        tier.write_header(b"label")
        tier.expect_header(b"label")
        state.write_text("resetting\n")
        assert wait_for(lambda: not tier.available)
        assert "resetting" in str(tier.state()["reason"])
        state.write_text("live\n")
        assert wait_for(lambda: tier.available)
    finally:
        tier.close()


def test_capacity_larger_than_the_namespace_is_refused(tmp_path: Path) -> None:
    sysfs, dev, _ = fabric(tmp_path)
    link = FabricLink(cfg(), connect=False, sysfs_root=str(sysfs), dev_root=str(dev))
    with pytest.raises(ConfigError, match="exceeds"):
        open_nvmeof_tier(cfg(capacity_bytes="1GiB"), PAGE, header_bytes=HEADER, connect=False, link=link)


def test_dhchap_secret_files(tmp_path: Path) -> None:
    good = tmp_path / "k"
    good.write_text("DHHC-1:00:abc:\n")
    assert _read_secret(str(good), "dhchap_secret_file") == "DHHC-1:00:abc:"
    bad = tmp_path / "b"
    bad.write_text("hunter2\n")
    with pytest.raises(ConfigError, match="does not hold a DHHC-1") as err:
        _read_secret(str(bad), "dhchap_secret_file")
    assert "hunter2" not in str(err.value)
    with pytest.raises(ConfigError, match="cannot read"):
        _read_secret(str(tmp_path / "none"), "dhchap_secret_file")
