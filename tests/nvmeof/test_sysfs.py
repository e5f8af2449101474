"""nvmeof.sysfs against fake sysfs trees laid out as Linux 6.1 does for nvme-rdma/nvme-tcp.

The builders here (``add_controller``) are also used by test_host and test_doctor.
Layout (multipath on, Debian's default): the controller lives under
devices/virtual/nvme-fabrics/ctl/nvmeX with a hidden path disk nvme<S>c<X>n<H> and a
generic char dev ng<X>n<H>; the subsystem under devices/virtual/nvme-subsystem/nvme-subsysS
holds a symlink per controller and the head disk nvme<S>n<H>; class/ and block/ are links.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvmeof.sysfs import (ControllerState, FabricAddress, controller_state, find_namespace,
                          get_controller, list_controllers, parse_address)

NQN = "nqn.2024-01.io.example:vmrig-subsys"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:f7536c1e-bc57-4dbb-8ea6-f1ad3af84371"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():                               # a second path to the same head disk
        return
    link.symlink_to(os.path.relpath(target, link.parent))


def add_controller(root: Path, *, ctrl: int, subsys: int, nqn: str = NQN, transport: str = "rdma",
                   address: str = "traddr=10.77.0.1,trsvcid=4420", state: str = "live",
                   heads: dict[int, int] | None = None, multipath: bool = True,
                   dev_root: Path | None = None) -> None:
    """Add controller nvme<ctrl> of subsystem nvme-subsys<subsys>; ``heads`` maps head
    instance -> NSID (default {1: 1}). With ``dev_root`` the /dev nodes are created (files)."""
    sysfs = root
    heads = {1: 1} if heads is None else heads
    cdir = sysfs / "devices/virtual/nvme-fabrics/ctl" / f"nvme{ctrl}"
    for name, value in (("transport", transport), ("address", address), ("subsysnqn", nqn),
                        ("hostnqn", HOSTNQN), ("hostid", "61d17809-4995-4615-b776-c194e0be3b30"),
                        ("state", state), ("cntlid", str(ctrl + 1)), ("serial", "8f1c2e7b0a3d4c5e"),
                        ("model", "Linux" + " " * 35), ("firmware_rev", "6.1.0-28"),
                        ("queue_count", "3"), ("sqsize", "127"), ("kato", "5"),
                        ("ctrl_loss_tmo", "600"), ("reconnect_delay", "10"),
                        ("fast_io_fail_tmo", "off"), ("dev", f"249:{ctrl}")):
        _write(cdir / name, value)
    _write(cdir / "delete_controller", "")
    _write(cdir / "reset_controller", "")
    _link(cdir / "subsystem", sysfs / "class/nvme")
    _link(sysfs / "class/nvme" / f"nvme{ctrl}", cdir)
    sdir = sysfs / "devices/virtual/nvme-subsystem" / f"nvme-subsys{subsys}"
    if not sdir.exists():
        for name, value in (("subsysnqn", nqn), ("model", "Linux"), ("serial", "8f1c2e7b0a3d4c5e"),
                            ("iopolicy", "numa"), ("subsystype", "nvm")):
            _write(sdir / name, value)
        _link(sysfs / "class/nvme-subsystem" / f"nvme-subsys{subsys}", sdir)
    _link(sdir / f"nvme{ctrl}", cdir)
    for head, nsid in heads.items():
        _write(cdir / f"ng{ctrl}n{head}" / "dev", f"240:{head}")
        if multipath:
            _write(cdir / f"nvme{subsys}c{ctrl}n{head}" / "nsid", str(nsid))
            disk = sdir / f"nvme{subsys}n{head}"
            name = f"nvme{subsys}n{head}"
        else:
            disk = cdir / f"nvme{ctrl}n{head}"
            name = f"nvme{ctrl}n{head}"
        for attr, value in (("nsid", str(nsid)), ("size", "524288"), ("wwid", f"uuid.{nsid:08x}")):
            _write(disk / attr, value)
        _link(sysfs / "block" / name, disk)
        if dev_root is not None:
            _write(dev_root / name, "")


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    dev.mkdir()
    return sysfs, dev


def test_parse_address_known_and_extra_keys() -> None:
    a = parse_address("traddr=10.77.0.1,trsvcid=4420,src_addr=10.77.0.2,newkey=x\n")
    assert a == FabricAddress(traddr="10.77.0.1", trsvcid="4420", src_addr="10.77.0.2",
                              extra=(("newkey", "x"),))
    assert parse_address("") == FabricAddress()
    assert parse_address("traddr=fe80::1%eth0,trsvcid=4420,host_traddr=fe80::2").traddr == "fe80::1%eth0"


def test_state_parse() -> None:
    assert ControllerState.parse("live\n") is ControllerState.LIVE
    assert ControllerState.parse("deleting (noio)") is ControllerState.DELETING_NOIO
    assert ControllerState.parse("unknown state") is ControllerState.UNKNOWN
    assert ControllerState.parse("sleeping") is ControllerState.UNKNOWN


def test_list_controllers_multipath(tree: tuple[Path, Path]) -> None:
    sysfs, dev = tree
    add_controller(sysfs, ctrl=0, subsys=0, dev_root=dev)
    add_controller(sysfs, ctrl=1, subsys=1, nqn="nqn.other", transport="tcp",
                   address="traddr=10.77.0.1,trsvcid=4421,src_addr=10.77.0.1", state="connecting",
                   heads={1: 1, 2: 7})
    add_controller(sysfs, ctrl=10, subsys=0, state="resetting", dev_root=dev)  # second path
    ctrls = list_controllers(str(sysfs))
    assert [c.name for c in ctrls] == ["nvme0", "nvme1", "nvme10"]   # numeric order
    c0 = ctrls[0]
    assert (c0.transport, c0.address.traddr, c0.address.trsvcid) == ("rdma", "10.77.0.1", "4420")
    assert (c0.subsysnqn, c0.hostnqn, c0.state, c0.cntlid) == (NQN, HOSTNQN, ControllerState.LIVE, 1)
    assert (c0.model, c0.subsystem, c0.namespaces) == ("Linux", "nvme-subsys0", ("nvme0n1",))
    assert ctrls[1].namespaces == ("nvme1n1", "nvme1n2") and ctrls[1].address.src_addr == "10.77.0.1"
    assert ctrls[2].namespaces == ("nvme0n1",) and ctrls[2].subsystem == "nvme-subsys0"


def test_list_controllers_without_multipath(tree: tuple[Path, Path]) -> None:
    sysfs, dev = tree
    add_controller(sysfs, ctrl=3, subsys=0, multipath=False, dev_root=dev)
    (c,) = list_controllers(str(sysfs))
    assert c.namespaces == ("nvme3n1",)
    assert find_namespace(NQN, sysfs_root=str(sysfs), dev_root=str(dev)) == str(dev / "nvme3n1")


def test_absent_tree_is_empty(tmp_path: Path) -> None:
    assert list_controllers(str(tmp_path)) == []
    assert controller_state("nvme0", str(tmp_path)) is None
    assert get_controller("nvme0", str(tmp_path)) is None
    assert find_namespace(NQN, sysfs_root=str(tmp_path), dev_root=str(tmp_path)) is None


def test_find_namespace_reads_nsid_not_names(tree: tuple[Path, Path]) -> None:
    sysfs, dev = tree
    # subsystem instance 2, heads 1 and 2 carrying NSIDs 5 and 1: names do not say the NSID
    add_controller(sysfs, ctrl=0, subsys=2, heads={1: 5, 2: 1}, dev_root=dev)

    def find(nqn: str, nsid: int = 1, transport: str | None = None) -> str | None:
        return find_namespace(nqn, nsid, transport, sysfs_root=str(sysfs), dev_root=str(dev))
    assert find(NQN, 1) == str(dev / "nvme2n2")
    assert find(NQN, 5) == str(dev / "nvme2n1")
    assert find(NQN, 3) is None
    assert find(NQN, 1, "tcp") is None
    assert find(NQN, 1, "rdma") == str(dev / "nvme2n2")
    assert find("nqn.absent") is None


def test_find_namespace_needs_the_dev_node(tree: tuple[Path, Path]) -> None:
    sysfs, dev = tree
    add_controller(sysfs, ctrl=0, subsys=0)             # udev has not created /dev/nvme0n1 yet
    assert find_namespace(NQN, sysfs_root=str(sysfs), dev_root=str(dev)) is None


def test_controller_state_and_get(tree: tuple[Path, Path]) -> None:
    sysfs, _ = tree
    add_controller(sysfs, ctrl=0, subsys=0, state="connecting")
    assert controller_state("nvme0", str(sysfs)) is ControllerState.CONNECTING
    (sysfs / "devices/virtual/nvme-fabrics/ctl/nvme0/state").write_text("live\n")
    assert controller_state("nvme0", str(sysfs)) is ControllerState.LIVE
    ctrl = get_controller("nvme0", str(sysfs))
    assert ctrl is not None and ctrl.state is ControllerState.LIVE
    with pytest.raises(ValueError, match="nvme0"):
        controller_state("nvme0n1", str(sysfs))


def test_reaches_compares_subsystem_transport_address_and_host(tree: tuple[Path, Path]) -> None:
    sysfs, _ = tree
    add_controller(sysfs, ctrl=0, subsys=0, address="traddr=fe80::1,trsvcid=4420")
    (c,) = list_controllers(str(sysfs))
    assert c.reaches("rdma", "fe80:0:0::1", "4420", NQN, HOSTNQN)      # the same IPv6 address
    assert c.reaches("rdma", "fe80::1", "4420", NQN)                   # no host NQN asked for
    assert not c.reaches("rdma", "fe80::2", "4420", NQN, HOSTNQN)      # another target
    assert not c.reaches("rdma", "fe80::1", "4421", NQN, HOSTNQN)      # another port
    assert not c.reaches("tcp", "fe80::1", "4420", NQN, HOSTNQN)
    assert not c.reaches("rdma", "fe80::1", "4420", "nqn.other", HOSTNQN)
    assert not c.reaches("rdma", "fe80::1", "4420", NQN, "nqn.2026-12.io.tierkv:another-host")


def test_a_loop_controller_has_no_address_and_still_matches(tree: tuple[Path, Path]) -> None:
    sysfs, _ = tree
    add_controller(sysfs, ctrl=0, subsys=0, transport="loop")
    (sysfs / "devices/virtual/nvme-fabrics/ctl/nvme0/address").unlink()  # nvme-loop has no get_address
    (c,) = list_controllers(str(sysfs))
    assert c.address == FabricAddress()
    assert c.reaches("loop", "", "4420", NQN, HOSTNQN) and c.reaches("loop", None, None, NQN)


def test_find_namespace_only_through_the_named_controllers(tree: tuple[Path, Path]) -> None:
    sysfs, dev = tree
    # Two targets export the same NQN: nvme0 reaches one (head nvme1n1), nvme1 the other (nvme2n2).
    add_controller(sysfs, ctrl=0, subsys=1, address="traddr=10.99.0.2,trsvcid=4420", dev_root=dev)
    add_controller(sysfs, ctrl=1, subsys=2, heads={2: 1}, dev_root=dev)
    assert find_namespace(NQN, 1, "rdma", sysfs_root=str(sysfs), dev_root=str(dev)) == str(dev / "nvme1n1")
    assert find_namespace(NQN, 1, "rdma", controllers={"nvme1"}, sysfs_root=str(sysfs),
                          dev_root=str(dev)) == str(dev / "nvme2n2")
    assert find_namespace(NQN, 1, "rdma", controllers=set(), sysfs_root=str(sysfs), dev_root=str(dev)) is None
    # without multipath the disk hangs off the controller itself
    add_controller(sysfs, ctrl=3, subsys=3, nqn="nqn.b", multipath=False, dev_root=dev)
    add_controller(sysfs, ctrl=4, subsys=4, nqn="nqn.b", heads={5: 1}, multipath=False, dev_root=dev)
    assert find_namespace("nqn.b", 1, controllers={"nvme4"}, sysfs_root=str(sysfs),
                          dev_root=str(dev)) == str(dev / "nvme4n5")
