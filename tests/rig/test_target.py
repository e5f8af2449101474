"""The raw NVMe-oF stack inside the rig guest, driven through the project's own code.

``nvmeof.configfs`` builds the kernel target, ``nvmeof.host`` connects the kernel host
over soft-RoCE and TCP, and O_DIRECT I/O on the namespace's block device must come back
bit-exact and land in the target's backing file. Then the failure cases the NVMe-oF tier
relies on: an unknown host is refused, DH-HMAC-CHAP (where the kernel has it), and the
fault-injection primitives (namespace disabled, port unlinked and restored).
Skipped outside the guest (see ``conftest.py``).
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from nvmeof.spec import TargetSpec

from tests.rig.conftest import (RIG_ADDR, RIG_HOSTNQN, RIG_NQN, RIG_PORTS, RigConnect, release,
                                reset_backing_files)

pytestmark = pytest.mark.rig

CFS_ROOT = "/sys/kernel/config/nvmet"
BLOCK = 4096  # the rig namespaces' logical block size


def aligned(data: bytes) -> mmap.mmap:
    """A page-aligned copy of ``data`` (O_DIRECT needs aligned buffers)."""
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    return buf


def direct_write_read(dev: str, offset: int, data: bytes) -> bytes:
    """O_DIRECT write of ``data`` at ``offset``, fsync, O_DIRECT read back of the same range."""
    src, dst = aligned(data), mmap.mmap(-1, len(data))
    fd = os.open(dev, os.O_RDWR | os.O_DIRECT)
    try:
        assert os.pwrite(fd, src, offset) == len(data)
        os.fsync(fd)
        assert os.preadv(fd, [dst], offset) == len(data)
    finally:
        os.close(fd)
    return bytes(dst)


def direct_read(dev: str, offset: int, length: int) -> bytes:
    dst = mmap.mmap(-1, length)
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.preadv(fd, [dst], offset) == length
    finally:
        os.close(fd)
    return bytes(dst)


def until(cond: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``cond`` until true or ``timeout_s``: sysfs and block devices have no change
    notification to wait on."""
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def test_apply_from_nvmetcli_json_reads_back(rig_spec: TargetSpec, tmp_path: Path) -> None:
    from nvmeof.configfs import apply, read_tree
    from nvmeof.model import NvmetConfig
    from nvmeof.spec import generate

    generated = generate(rig_spec)
    generated.dump(tmp_path / "nvmet.json")
    cfg = NvmetConfig.load(tmp_path / "nvmet.json")
    assert cfg == generated
    release(cfg)
    reset_backing_files(rig_spec)
    apply(cfg)
    try:
        got = read_tree(CFS_ROOT)
        assert RIG_HOSTNQN in {h.nqn for h in got.hosts}
        sub, want = got.subsystem(RIG_NQN), cfg.subsystem(RIG_NQN)
        assert sub is not None and want is not None
        assert sub.allowed_hosts == (RIG_HOSTNQN,) and not sub.allow_any_host
        for key, value in want.attr.items():  # the kernel pads serial to 20 characters
            assert (sub.attr.get(key) or "").strip() == value, key
        assert [(n.nsid, n.device.path, n.enable, n.buffered_io) for n in sub.namespaces] == \
            [(n.nsid, n.device.path, 1, 1) for n in want.namespaces]
        ports = {p.portid: p for p in got.ports}
        for p in cfg.ports:
            assert p.portid in ports
            assert ports[p.portid].addr.items() == p.addr.items() or \
                {k: v for k, v in ports[p.portid].addr.items() if k != "treq"} == \
                {k: v for k, v in p.addr.items() if k != "treq"}
            assert ports[p.portid].subsystems == (RIG_NQN,)
    finally:
        release(cfg)


@pytest.mark.parametrize("transport", ["rdma", "tcp"])
def test_connect_and_odirect_round_trip(transport: str, rig_target: object, rig_connect: RigConnect,
                                        rig_spec: TargetSpec) -> None:
    from nvmeof.sysfs import ControllerState

    ctrl = rig_connect(transport)
    assert ctrl.state is ControllerState.LIVE
    assert (ctrl.transport, ctrl.subsysnqn, ctrl.address.traddr) == (transport, RIG_NQN, RIG_ADDR)
    assert ctrl.hostnqn == RIG_HOSTNQN and ctrl.namespaces
    dev = "/dev/" + ctrl.namespaces[0]
    offset, data = 256 * BLOCK, os.urandom(4 << 20)
    assert direct_write_read(dev, offset, data) == data
    assert direct_read(dev, 0, offset) == bytes(offset), "blocks before the write changed"
    backing = rig_spec.namespaces[0].path
    with open(backing, "rb") as f:  # the bytes went through nvmet into its file
        f.seek(offset)
        assert f.read(len(data)) == data


def test_unknown_host_is_refused(rig_target: object, rig_connect: RigConnect) -> None:
    from nvmeof.host import ConnectError, ConnectFailure

    with pytest.raises(ConnectError) as err:
        rig_connect("rdma", hostnqn="nqn.2026-12.io.tierkv:not-allowed", timeout_s=20.0)
    assert err.value.reason is ConnectFailure.HOST_REFUSED, err.value


def _auth_supported(nqn: str) -> bool:
    return os.path.exists(os.path.join(CFS_ROOT, "hosts", nqn, "dhchap_key"))


def test_dhchap_right_secret_connects_wrong_is_refused(rig_spec: TargetSpec, rig_connect: RigConnect) -> None:
    from nvmeof.auth import generate_secret
    from nvmeof.configfs import apply
    from nvmeof.host import ConnectError, ConnectFailure
    from nvmeof.spec import HostSpec, generate

    secret = generate_secret().encode()
    spec = replace(rig_spec, hosts=(HostSpec(RIG_HOSTNQN, dhchap_key=secret),))
    cfg = generate(spec)
    release(cfg)
    reset_backing_files(spec)
    # The hosts directory shows whether this kernel has nvmet auth before any key is written.
    os.makedirs(os.path.join(CFS_ROOT, "hosts", RIG_HOSTNQN), exist_ok=True)
    try:
        if not _auth_supported(RIG_HOSTNQN):
            pytest.skip("guest kernel %s has no nvmet DH-HMAC-CHAP (no dhchap_key under %s/hosts/<nqn>/; "
                        "CONFIG_NVME_TARGET_AUTH is off)" % (os.uname().release, CFS_ROOT))
        apply(cfg)
        ctrl = rig_connect("tcp", dhchap_secret=secret)
        assert ctrl.namespaces
        from nvmeof.host import disconnect
        disconnect(name=ctrl.name)
        with pytest.raises(ConnectError) as err:
            rig_connect("tcp", dhchap_secret=generate_secret().encode(), timeout_s=20.0)
        assert err.value.reason is ConnectFailure.AUTH_FAILED, err.value
    finally:
        release(cfg)


def test_disabled_namespace_fails_io_and_recovers(rig_target: object, rig_connect: RigConnect) -> None:
    from nvmeof.configfs import set_namespace_enabled
    from nvmeof.sysfs import find_namespace

    ctrl = rig_connect("rdma")
    dev = "/dev/" + ctrl.namespaces[0]
    data = os.urandom(64 * BLOCK)
    assert direct_write_read(dev, 0, data) == data
    set_namespace_enabled(RIG_NQN, 1, False)
    try:
        with pytest.raises(OSError):
            direct_read(dev, 0, len(data))
    finally:
        set_namespace_enabled(RIG_NQN, 1, True)

    def readable() -> bool:
        found = find_namespace(RIG_NQN, 1, "rdma")
        try:
            return found is not None and direct_read(found, 0, len(data)) == data
        except OSError:
            return False

    assert until(readable, 30.0), "namespace not readable again 30 s after re-enabling"


def test_port_unlink_leaves_live_and_relink_restores(rig_target: object, rig_connect: RigConnect) -> None:
    from nvmeof.configfs import link_port, unlink_port
    from nvmeof.host import wait_for_state
    from nvmeof.sysfs import ControllerState, controller_state

    reconnect_delay_s = 1
    ctrl = rig_connect("rdma", reconnect_delay_s=reconnect_delay_s, ctrl_loss_tmo_s=60)
    portid = RIG_PORTS["rdma"][1]
    unlink_port(portid, RIG_NQN)
    try:
        assert until(lambda: controller_state(ctrl.name) is not ControllerState.LIVE, 20.0), \
            "controller still live 20 s after its port was unlinked"
    finally:
        link_port(portid, RIG_NQN)
    start = time.monotonic()
    # A reconnect attempt every reconnect_delay_s; TCG makes each attempt itself slow.
    wait_for_state(ctrl.name, ControllerState.LIVE, timeout_s=reconnect_delay_s + 20.0)
    print("live again %.1f s after relinking (reconnect_delay %d s)" % (time.monotonic() - start,
                                                                        reconnect_delay_s))


def test_doctor_reports_the_rxe_device() -> None:
    out = subprocess.run([sys.executable, "-m", "tierkv", "doctor", "--json"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.stdout, out.stderr
    checks = {c["check"]: c for c in json.loads(out.stdout)["checks"]}
    assert checks["rdma.devices"]["status"] == "pass"
    assert "rxe0" in checks["rdma.devices"]["detail"]
