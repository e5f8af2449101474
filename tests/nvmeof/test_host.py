"""nvmeof.host and nvmeof.nvmecli without a kernel: argv as data, nvme-cli JSON, failure
classification, and the sysfs-side halves of connect/disconnect on fake trees. The real
connect/disconnect runs in the QEMU rig."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from nvmeof import nvmecli
from nvmeof.errors import NvmeofError
from nvmeof.host import (Backend, ConnectError, ConnectFailure, DiscoveryRecord, HostError,
                         HostTimeoutError, SubsystemType, _await_live, _choose, classify, connect,
                         disconnect, host_identity, wait_for_state)
from nvmeof.nvmecli import ConnectOptions
from nvmeof.sysfs import ControllerState
from tests.nvmeof.test_sysfs import HOSTNQN, NQN, add_controller

OPTS = ConnectOptions("rdma", "10.77.0.1", "4420", NQN, hostnqn=HOSTNQN,
                      hostid="61d17809-4995-4615-b776-c194e0be3b30")

# nvme-cli 2.3, `nvme discover -t rdma -a 10.77.0.1 -s 4420 -o json` against nvmet
DISCOVER_2X = """{
  "device" : "nvme0",
  "genctr" : 3,
  "records" : [
    {
      "trtype" : "rdma",
      "adrfam" : "ipv4",
      "subtype" : "current discovery subsystem",
      "treq" : "not specified, sq flow control disable supported",
      "portid" : 1,
      "trsvcid" : "4420",
      "subnqn" : "nqn.2014-08.org.nvmexpress.discovery",
      "traddr" : "10.77.0.1",
      "eflags" : "explicit discovery connections, duplicate discovery information",
      "rdma_prtype" : "not specified",
      "rdma_qptype" : "connected",
      "rdma_cms" : "rdma-cm",
      "rdma_pkey" : "0x0000"
    },
    {
      "trtype" : "rdma",
      "adrfam" : "ipv4",
      "subtype" : "nvme subsystem",
      "treq" : "not specified, sq flow control disable supported",
      "portid" : 1,
      "trsvcid" : "4420",
      "subnqn" : "nqn.2024-01.io.example:vmrig-subsys",
      "traddr" : "10.77.0.1",
      "eflags" : "none",
      "rdma_prtype" : "not specified",
      "rdma_qptype" : "connected",
      "rdma_cms" : "rdma-cm",
      "rdma_pkey" : "0x0000"
    }
  ]
}
"""
# nvme-cli 1.x: fixed-width fields padded with spaces, a text line before the JSON
DISCOVER_1X = """Discovery Log Number of Records 1, Generation counter 2
{
  "genctr" : 2,
  "records" : [
    {
      "trtype" : "tcp",
      "adrfam" : "ipv4",
      "subtype" : "nvme subsystem",
      "treq" : "not specified",
      "portid" : 2,
      "trsvcid" : "4421                            ",
      "subnqn" : "nqn.2024-01.io.example:vmrig-subsys",
      "traddr" : "10.77.0.1                                                                                                                                                                                                                                                       ",
      "sectype" : "none"
    }
  ]
}
"""


def test_connect_args_full() -> None:
    opts = ConnectOptions("rdma", "10.77.0.1", "4420", NQN, HOSTNQN, "61d17809-4995-4615-b776-c194e0be3b30",
                          "DHHC-1:00:aGVsbG8=:", "DHHC-1:00:d29ybGQ=:", 30, 2, 5, 15)
    assert nvmecli.connect_args(opts) == [
        "nvme", "connect", "--transport=rdma", "--traddr=10.77.0.1", "--trsvcid=4420",
        f"--nqn={NQN}", f"--hostnqn={HOSTNQN}", "--hostid=61d17809-4995-4615-b776-c194e0be3b30",
        "--dhchap-secret=DHHC-1:00:aGVsbG8=:", "--dhchap-ctrl-secret=DHHC-1:00:d29ybGQ=:",
        "--ctrl-loss-tmo=30", "--reconnect-delay=2", "--keep-alive-tmo=15",
        "--fast_io_fail_tmo=5", "--output-format=json"]
    assert "--fast_io_fail_tmo=5" not in nvmecli.connect_args(opts, fast_io_fail_flag=False)


def test_connect_and_discover_args_minimal() -> None:
    assert nvmecli.connect_args(ConnectOptions("tcp", "10.77.0.1", "4421", NQN)) == [
        "nvme", "connect", "--transport=tcp", "--traddr=10.77.0.1", "--trsvcid=4421",
        f"--nqn={NQN}", "--output-format=json"]
    assert nvmecli.discover_args("rdma", "10.77.0.1", "4420", hostnqn=HOSTNQN) == [
        "nvme", "discover", "--transport=rdma", "--traddr=10.77.0.1", "--trsvcid=4420",
        f"--hostnqn={HOSTNQN}", "--output-format=json"]


def test_connect_args_over_loop_carry_no_address_and_no_reconnect_settings() -> None:
    opts = ConnectOptions("loop", "", "4420", NQN, HOSTNQN, None, None, None, 600, 1, 2, None)
    assert nvmecli.connect_args(opts) == [
        "nvme", "connect", "--transport=loop", f"--nqn={NQN}", f"--hostnqn={HOSTNQN}",
        "--fast_io_fail_tmo=2", "--output-format=json"]


@pytest.mark.skipif(shutil.which("nvme") is None, reason="nvme-cli not installed")
def test_options_against_the_installed_nvme_cli() -> None:
    """Every option we build, except --fast_io_fail_tmo (nvme-cli >= 2.4), is one the real
    nvme-cli lists; the unsupported list is exactly what it lacks."""
    supported = nvmecli.connect_options()
    full = ConnectOptions("rdma", "a", "1", "n", "h", "i", "s", "c", 1, 1, 1, 1)
    missing = nvmecli.unsupported_options(full, supported)
    assert set(missing) <= {nvmecli.FAST_IO_FAIL_FLAG}
    assert "--ctrl-loss-tmo" in supported and "--dhchap-ctrl-secret" in supported


def test_parse_discovery_versions() -> None:
    recs = [DiscoveryRecord.from_json(r) for r in nvmecli.parse_discovery(DISCOVER_2X)]
    assert [r.subtype for r in recs] == [SubsystemType.CURRENT_DISCOVERY, SubsystemType.NVME]
    assert recs[1] == DiscoveryRecord("rdma", "10.77.0.1", "4420", NQN, SubsystemType.NVME, "ipv4", 1,
                                      "not specified, sq flow control disable supported")
    (old,) = [DiscoveryRecord.from_json(r) for r in nvmecli.parse_discovery(DISCOVER_1X)]
    assert (old.transport, old.traddr, old.trsvcid, old.portid) == ("tcp", "10.77.0.1", "4421", 2)
    with pytest.raises(ValueError, match="JSON"):
        nvmecli.parse_discovery("Failed to write to /dev/nvme-fabrics: Connection refused")
    with pytest.raises(ValueError, match="records"):
        nvmecli.parse_discovery('{"genctr": 1}')


def test_libnvme_record_shape() -> None:
    rec = DiscoveryRecord.from_json({"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.77.0.1",
                                     "trsvcid": "4420", "subnqn": NQN, "subtype": "nvme", "portid": 1})
    assert rec.subtype is SubsystemType.NVME and rec.portid == 1
    assert SubsystemType.parse(1) is SubsystemType.DISCOVERY_REFERRAL
    assert SubsystemType.parse("odd") is SubsystemType.UNKNOWN


def test_connected_device() -> None:
    assert nvmecli.connected_device('{\n  "device" : "nvme3"\n}\n') == "nvme3"
    assert nvmecli.connected_device("connecting to device: nvme4\n") == "nvme4"
    assert nvmecli.connected_device("") is None


@pytest.mark.parametrize(("text", "reason"), [
    ("could not add new controller: failed to write to nvme-fabrics device\n"
     "nvme nvme1: Connect for subsystem nqn.2024-01.io.example:vmrig-subsys is not allowed, hostnqn: "
     "nqn.2014-08.org.nvmexpress:uuid:0000", ConnectFailure.HOST_REFUSED),
    ("nvmet: connect by host nqn.x for subsystem nqn.y not allowed", ConnectFailure.HOST_REFUSED),
    ("nvme nvme1: qid 0: authentication failed", ConnectFailure.AUTH_FAILED),
    ('nvme nvme1: Connect Invalid Data Parameter, subsysnqn "nqn.nope"', ConnectFailure.NO_SUBSYSTEM),
    ("nvme_fabrics: found same hostid 61d17809-4995-4615-b776-c194e0be3b30 but different hostnqn x",
     ConnectFailure.HOSTID_CONFLICT),
    ("nvme nvme0: rdma_resolve_route failed (-110).", ConnectFailure.UNREACHABLE),
    ("could not add new controller: connection refused", ConnectFailure.UNREACHABLE),
    ("Failed to open /dev/nvme-fabrics: No such file or directory", ConnectFailure.NO_FABRICS),
    ("Failed to scan topology: No such file or directory", ConnectFailure.NO_FABRICS),
    ("something else", ConnectFailure.OTHER),
])
def test_classify(text: str, reason: ConnectFailure) -> None:
    assert classify(text) is reason


def test_connect_error_hierarchy_and_message() -> None:
    err = ConnectError("rdma:10.77.0.1:4420 nqn=x", ConnectFailure.HOST_REFUSED, "line one\nline two")
    assert isinstance(err, HostError) and isinstance(err, NvmeofError)
    assert "not on its allow-list" in str(err) and "line one | line two" in str(err)
    assert issubclass(HostTimeoutError, HostError)


def test_host_identity(tmp_path: Path) -> None:
    nqn, hid = host_identity("nqn.2014-08.org.nvmexpress:uuid:0f0e0d0c-0b0a-4908-8706-050403020100", None)
    assert hid == "0f0e0d0c-0b0a-4908-8706-050403020100"
    _, hid1 = host_identity("nqn.2024-01.io.example:other-host", None)
    _, hid2 = host_identity("nqn.2024-01.io.example:other-host", None)
    assert hid1 == hid2 and hid1 is not None                # deterministic: 1:1 with the NQN
    assert host_identity("nqn.a", "given") == ("nqn.a", "given")


def test_libnvme_cannot_take_ctrl_secret() -> None:
    opts = ConnectOptions("rdma", "a", "1", "n", dhchap_ctrl_secret="DHHC-1:00:c2VjcmV0:")
    with pytest.raises(ConnectError) as info:
        _choose(Backend.LIBNVME, opts, "target")
    assert info.value.reason is ConnectFailure.UNSUPPORTED and "DHHC" not in str(info.value)


def test_connect_returns_existing_live_controller(tmp_path: Path) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    add_controller(sysfs, ctrl=0, subsys=0, dev_root=dev)
    ctrl = connect("rdma", "10.77.0.1", 4420, NQN, hostnqn=HOSTNQN, sysfs_root=str(sysfs),
                   dev_root=str(dev))
    assert ctrl.name == "nvme0" and ctrl.namespaces == ("nvme0n1",)
    # nothing was asked of the kernel
    assert (sysfs / "class/nvme/nvme0/delete_controller").read_text() == "\n"


def test_await_live_applies_sysfs_options(tmp_path: Path) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    add_controller(sysfs, ctrl=1, subsys=0, dev_root=dev)
    ctrl = _await_live(OPTS, "nvme1", set(), {"fast_io_fail_tmo": 5}, time.monotonic() + 5, "t",
                       str(sysfs), str(dev))
    assert ctrl.name == "nvme1"
    assert (sysfs / "class/nvme/nvme1/fast_io_fail_tmo").read_text() == "5"


def test_await_live_times_out_and_deletes_what_it_created(tmp_path: Path) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    add_controller(sysfs, ctrl=1, subsys=0, state="connecting", dev_root=dev)
    with pytest.raises(ConnectError) as info:
        _await_live(OPTS, None, set(), {}, time.monotonic(), "t", str(sysfs), str(dev))
    assert info.value.reason is ConnectFailure.TIMEOUT and "connecting" in str(info.value)
    assert (sysfs / "class/nvme/nvme1/delete_controller").read_text() == "1"


def test_await_live_leaves_preexisting_controllers_alone(tmp_path: Path) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    add_controller(sysfs, ctrl=0, subsys=0, state="connecting", dev_root=dev)
    with pytest.raises(ConnectError, match="no controller appeared"):
        _await_live(OPTS, None, {"nvme0"}, {}, time.monotonic(), "t", str(sysfs), str(dev))
    assert (sysfs / "class/nvme/nvme0/delete_controller").read_text() == "\n"


def test_disconnect(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    add_controller(sysfs, ctrl=0, subsys=0)
    add_controller(sysfs, ctrl=1, subsys=1, nqn="nqn.other")
    with pytest.raises(ValueError, match="exactly one"):
        disconnect(sysfs_root=str(sysfs))
    assert disconnect(nqn="nqn.absent", sysfs_root=str(sysfs)) == 0
    # the fake tree has no kernel to remove the controller: the wait must time out, naming it
    with pytest.raises(HostTimeoutError, match="nvme0"):
        disconnect(nqn=NQN, timeout_s=0, sysfs_root=str(sysfs))
    assert (sysfs / "class/nvme/nvme0/delete_controller").read_text() == "1"
    assert (sysfs / "class/nvme/nvme1/delete_controller").read_text() == "\n"


def test_wait_for_state(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    add_controller(sysfs, ctrl=0, subsys=0, state="connecting")
    with pytest.raises(HostTimeoutError, match="last seen: connecting"):
        wait_for_state("nvme0", ControllerState.LIVE, timeout_s=0, sysfs_root=str(sysfs))
    assert wait_for_state("nvme0", ControllerState.CONNECTING, timeout_s=0,
                          sysfs_root=str(sysfs)).name == "nvme0"
    with pytest.raises(HostTimeoutError, match="gone"):
        wait_for_state("nvme5", ControllerState.LIVE, timeout_s=0, sysfs_root=str(sysfs))


def test_connect_error_never_carries_a_secret() -> None:
    from nvmeof.host import ConnectError, ConnectFailure
    secret = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:"
    err = ConnectError(f"rdma:1.2.3.4:4420 dhchap_secret={secret}", ConnectFailure.AUTH_FAILED,
                       f"nvme connect --dhchap-secret={secret} failed\nkernel: bad key '{secret}'")
    assert "ia6zGod" not in str(err) and "ia6zGod" not in err.detail and "ia6zGod" not in err.attempted
    assert "DHHC-1:<redacted>" in str(err)


def _loop_controller(sysfs: Path, dev: Path, ctrl: int = 0) -> None:
    add_controller(sysfs, ctrl=ctrl, subsys=ctrl, transport="loop", dev_root=dev)
    (sysfs / f"devices/virtual/nvme-fabrics/ctl/nvme{ctrl}/address").unlink()  # nvme-loop has no get_address


def test_loop_controllers_are_found_without_an_address(tmp_path: Path) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    _loop_controller(sysfs, dev)
    loop = ConnectOptions("loop", "", "4420", NQN, hostnqn=HOSTNQN, hostid=OPTS.hostid)
    # what a connect over loop waits for once nvme-cli has made the controller
    assert _await_live(loop, "nvme0", set(), {}, time.monotonic() + 2, "t", str(sysfs), str(dev)).name == "nvme0"
    # and the idempotent path: an existing live loop controller is returned, nothing asked of the kernel
    assert connect("loop", "", "4420", NQN, hostnqn=HOSTNQN, sysfs_root=str(sysfs), dev_root=str(dev)).name == "nvme0"
    assert (sysfs / "class/nvme/nvme0/delete_controller").read_text() == "\n"


def test_await_live_deletes_the_controller_the_tool_made_when_it_never_matches(tmp_path: Path) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    add_controller(sysfs, ctrl=1, subsys=0, address="traddr=10.77.0.9,trsvcid=4420", dev_root=dev)
    with pytest.raises(ConnectError, match="reported nvme1") as info:
        _await_live(OPTS, "nvme1", set(), {}, time.monotonic(), "t", str(sysfs), str(dev))
    assert info.value.reason is ConnectFailure.TIMEOUT
    assert (sysfs / "class/nvme/nvme1/delete_controller").read_text() == "1"
    # one that was there before the call is not the call's to delete
    add_controller(sysfs, ctrl=2, subsys=0, address="traddr=10.77.0.9,trsvcid=4420", dev_root=dev)
    with pytest.raises(ConnectError):
        _await_live(OPTS, "nvme2", {"nvme2"}, {}, time.monotonic(), "t", str(sysfs), str(dev))
    assert (sysfs / "class/nvme/nvme2/delete_controller").read_text() == "\n"
