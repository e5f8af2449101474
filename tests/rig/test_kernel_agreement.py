"""Where ``nvmeof`` has to agree with the kernel: what nvmet's configfs takes, what it
shows back, and what a loop controller looks like in sysfs.

Each check writes the same values to a real nvmet configfs and through
``NvmetConfig.validate`` and asserts the two verdicts agree; the host-side tests
(tests/nvmeof) pin the same cases without a kernel. A scratch subsystem is used, not
the rig target, so these tests need no RDMA and cannot disturb it. The loop tests skip
where the kernel has no nvme-loop module (Debian 12's 6.1 kernel, the rig's, has none).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from tests.rig.conftest import RIG_HOSTNQN

if TYPE_CHECKING:
    from nvmeof.model import NvmetConfig

NQN = "nqn.2026-12.io.tierkv:agree"
ROOT = "/sys/kernel/config/nvmet"
IMG = "/run/tierkv-rig/agree.img"
LOOP_PORT = 9


def _config(enable: int = 0, loop_port: bool = False) -> NvmetConfig:
    from nvmeof.model import NvmetConfig

    ports = [{"portid": LOOP_PORT, "addr": {"trtype": "loop", "adrfam": "", "traddr": "", "trsvcid": "",
                                            "treq": "not specified"}, "subsystems": [NQN]}] if loop_port else []
    return NvmetConfig.from_dict({
        "hosts": [], "ports": ports,
        "subsystems": [{"nqn": NQN, "attr": {"allow_any_host": "1", "serial": "agree01"}, "allowed_hosts": [],
                        "namespaces": [{"nsid": 1, "device": {"path": IMG}, "buffered_io": 1,
                                        "enable": enable}]}]})


@pytest.fixture
def scratch() -> Iterator[Callable[..., NvmetConfig]]:
    from nvmeof.configfs import apply, clear
    from nvmeof.host import disconnect

    made: list[NvmetConfig] = []

    def _make(enable: int = 0, loop_port: bool = False) -> NvmetConfig:
        with open(IMG, "wb") as f:
            f.truncate(16 << 20)
        cfg = _config(enable, loop_port)
        clear(cfg=cfg)
        report = apply(cfg, use_nvmetcli=False)
        assert report.ok, report.to_dict()
        made.append(cfg)
        return cfg

    yield _make
    for cfg in made:
        disconnect(nqn=NQN)
        clear(cfg=cfg)
    if os.path.exists(IMG):
        os.unlink(IMG)


def _kernel_takes(writes: list[tuple[str, str]]) -> bool:
    """Whether the kernel accepts every write, in order (files relative to the subsystem)."""
    for rel, value in writes:
        try:
            fd = os.open(os.path.join(ROOT, "subsystems", NQN, rel), os.O_WRONLY)
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)
        except OSError:
            return False
    return True


def _we_take(attr: dict[str, str], device: dict[str, str]) -> bool:
    from nvmeof.errors import ConfigError
    from nvmeof.model import NvmetConfig

    d: Any = _config().to_dict()
    d["subsystems"][0]["attr"].update(attr)
    d["subsystems"][0]["namespaces"][0]["device"].update(device)
    try:
        NvmetConfig.from_dict(d).validate()
    except ConfigError:
        return False
    return True


CNTLIDS = [("5", "5"), ("6", "5"), ("5", "6"), ("1", "1"), (None, "1"), ("65518", None), ("65519", None)]
NAMESPACE_IDS = [("device_nguid", "nguid", "ef90689c6c46d44c89c14067801309a8"),
                 ("device_nguid", "nguid", "ef:90:68:9c:6c:46:d4:4c:89:c1:40:67:80:13:09:a8"),
                 ("device_nguid", "nguid", "ef90689c-6c46"),
                 ("device_uuid", "uuid", "D592CDF3-5D1C-44E0-8412-3FCF7D99DF27"),
                 ("device_uuid", "uuid", "d592cdf35d1c44e084123fcf7d99df27")]
BOOLS = ["y", "n", "yes", "on", "off", "maybe"]


def test_validation_agrees_with_the_kernel(scratch: Callable[..., NvmetConfig]) -> None:
    scratch()
    for lo, hi in CNTLIDS:
        assert _kernel_takes([("attr_cntlid_min", "1"), ("attr_cntlid_max", "65519")])  # the defaults
        writes = [(f"attr_cntlid_{k}", v) for k, v in (("min", lo), ("max", hi)) if v is not None]
        attr = {f"cntlid_{k}": v for k, v in (("min", lo), ("max", hi)) if v is not None}
        assert _we_take(attr, {}) == _kernel_takes(writes), f"cntlid min={lo} max={hi}"
    for name, key, value in NAMESPACE_IDS:
        assert _we_take({}, {key: value}) == _kernel_takes([(f"namespaces/1/{name}", value)]), f"{key} {value}"
    for value in BOOLS:
        assert _we_take({"allow_any_host": value}, {}) == _kernel_takes([("attr_allow_any_host", value)]), value


def test_save_strips_the_padded_serial_and_round_trips(scratch: Callable[..., NvmetConfig]) -> None:
    from nvmeof.configfs import apply, clear, read_tree

    cfg = scratch(enable=1)
    with open(os.path.join(ROOT, "subsystems", NQN, "attr_serial")) as f:
        assert f.read() == "agree01" + " " * 13 + "\n"  # the kernel pads it
    saved = read_tree().subsystem(NQN)
    assert saved is not None and saved.attr["serial"] == "agree01"
    clear(cfg=cfg)
    assert apply(_config(enable=1), use_nvmetcli=False).ok
    again = read_tree().subsystem(NQN)
    assert again is not None and again.attr == saved.attr


def test_loop_connect_finds_its_controller_and_cleans_up(scratch: Callable[..., NvmetConfig]) -> None:
    from nvmeof.host import connect, disconnect
    from nvmeof.sysfs import list_controllers

    if subprocess.run(["modprobe", "nvme-loop"], capture_output=True).returncode != 0:
        pytest.skip("no nvme-loop module in this guest")
    scratch(enable=1, loop_port=True)
    # what the NVMe-oF tier passes for transport = "loop" (no traddr, the default trsvcid)
    ctrl = connect("loop", "", "4420", NQN, hostnqn=RIG_HOSTNQN, ctrl_loss_tmo_s=600, reconnect_delay_s=1,
                   fast_io_fail_tmo_s=2, timeout_s=30)
    try:
        assert ctrl.transport == "loop" and ctrl.namespaces
        again = connect("loop", "", "4420", NQN, hostnqn=RIG_HOSTNQN, timeout_s=30)
        assert again.name == ctrl.name  # found, not made twice
        assert [c.name for c in list_controllers() if c.subsysnqn == NQN] == [ctrl.name]
    finally:
        disconnect(nqn=NQN)
    assert not [c for c in list_controllers() if c.subsysnqn == NQN]


def test_the_tier_link_over_loop_attaches_and_disconnects(scratch: Callable[..., NvmetConfig]) -> None:
    if subprocess.run(["modprobe", "nvme-loop"], capture_output=True).returncode != 0:
        pytest.skip("no nvme-loop module in this guest")
    from nvmeof.sysfs import list_controllers
    from tierkv.config import NvmeofConfig
    from tierkv.tiers.fabric import FabricLink

    scratch(enable=1, loop_port=True)
    link = FabricLink(NvmeofConfig(transport="loop", subnqn=NQN, hostnqn=RIG_HOSTNQN, disconnect_on_close=True,
                                   connect_timeout_s=30))
    device = link.attach()
    assert device.startswith("/dev/nvme") and link.status().live
    link.close()
    assert not [c for c in list_controllers() if c.subsysnqn == NQN]
