"""Fixtures shared by the rig tests: a real nvmet target and real NVMe-oF connections.

The rig tests run inside the QEMU guest that ``tierkv rig test`` boots (see
``docs/rig.md``); ``tools/rig/guest.sh`` has already loaded the modules, mounted
configfs, put soft-RoCE (``rxe0``) on ``dummy0`` at :data:`RIG_ADDR` and mounted a tmpfs
at ``/run/tierkv-rig`` for backing files, then sets ``TIERKV_RIG_GUEST=1``. Everything
under ``tests/rig`` is marked ``rig`` and skipped unless that variable is set, so a host
run collects these tests and skips them.

The guest runs pytest with ``--confcutdir=tests/rig``: ``tests/conftest.py`` (which
imports ``tierkv.store.api`` and so torch, about 100 s under TCG) is not loaded here. A rig test
that needs the store imports it itself and pays for it once.

Fixtures:
  ``rig_spec``     (session) the :class:`nvmeof.spec.TargetSpec` of ``configs/nvmeof/rig-rdma.toml``
  ``rig_target``   the spec generated and applied to configfs, yielded as the
                   :class:`nvmeof.model.NvmetConfig`; its backing files start as zeros; at
                   teardown its controllers are disconnected and its objects cleared
  ``rig_connect``  a factory ``rig_connect(transport="rdma", hostnqn=RIG_HOSTNQN, **kw)
                   -> nvmeof.sysfs.Controller`` (kw go to :func:`nvmeof.host.connect`); every
                   controller it made is disconnected at teardown. ``TIERKV_RIG_BACKEND``
                   (``libnvme`` or ``nvme-cli``; forwarded by ``tierkv rig test``) picks the
                   connect backend when kw names none; unset: the library's own choice
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import pytest

if TYPE_CHECKING:
    from nvmeof.model import NvmetConfig
    from nvmeof.spec import TargetSpec
    from nvmeof.sysfs import Controller

RIG_NQN = "nqn.2026-12.io.tierkv:rig"
RIG_HOSTNQN = "nqn.2026-12.io.tierkv:host-rig"
RIG_ADDR = "10.77.0.1"
RIG_PORTS: dict[str, tuple[int, int]] = {"rdma": (4420, 1), "tcp": (4421, 2)}  # transport -> (trsvcid, portid)
RIG_SPEC_PATH = Path(__file__).resolve().parents[2] / "configs" / "nvmeof" / "rig-rdma.toml"
IN_GUEST = os.environ.get("TIERKV_RIG_GUEST") == "1"
_HERE = Path(__file__).resolve().parent
_SKIP = pytest.mark.skip(reason="rig test: runs only inside the QEMU rig guest (`tierkv rig test`)")


@pytest.hookimpl(tryfirst=True)  # before -m selection looks at the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.rig)
            if not IN_GUEST:
                item.add_marker(_SKIP)


class RigConnect(Protocol):
    """The ``rig_connect`` factory's call signature."""

    def __call__(self, transport: str = "rdma", hostnqn: str | None = RIG_HOSTNQN,
                 **kw: object) -> Controller: ...


@pytest.fixture(scope="session")
def rig_spec() -> TargetSpec:
    from nvmeof.spec import load_spec

    return load_spec(RIG_SPEC_PATH)


def reset_backing_files(spec: TargetSpec) -> None:
    """Recreate every file-backed namespace of ``spec`` as zeros of its ``size`` (sparse)."""
    for ns in spec.namespaces:
        if ns.is_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ns.path)
            os.makedirs(os.path.dirname(ns.path), exist_ok=True)
            with open(ns.path, "wb") as f:
                f.truncate(ns.size_bytes or 256 << 20)


def release(cfg: NvmetConfig) -> None:
    """Disconnect this host from ``cfg``'s subsystems, then clear ``cfg`` from configfs.

    Disconnecting first matters: a host whose port vanished keeps reconnecting until its
    ctrl_loss_tmo (10 minutes by default)."""
    from nvmeof.configfs import clear
    from nvmeof.host import disconnect

    for sub in cfg.subsystems:
        disconnect(nqn=sub.nqn)
    report = clear(cfg=cfg)
    assert report.ok, "clearing the rig target left %s" % (report.to_dict(),)


@pytest.fixture
def rig_target(rig_spec: TargetSpec) -> Iterator[NvmetConfig]:
    from nvmeof.configfs import apply
    from nvmeof.spec import generate

    cfg = generate(rig_spec)
    release(cfg)  # what a test that died mid-way may have left
    reset_backing_files(rig_spec)
    apply(cfg)
    try:
        yield cfg
    finally:
        release(cfg)


@pytest.fixture
def rig_connect() -> Iterator[RigConnect]:
    from nvmeof.host import HostError, connect, disconnect

    made: list[str] = []

    def _connect(transport: str = "rdma", hostnqn: str | None = RIG_HOSTNQN, **kw: object) -> Controller:
        args: dict[str, object] = {"traddr": RIG_ADDR, "trsvcid": RIG_PORTS[transport][0], "nqn": RIG_NQN}
        backend = os.environ.get("TIERKV_RIG_BACKEND")
        if backend and "backend" not in kw:
            from nvmeof.host import Backend

            args["backend"] = Backend(backend)
        args.update(kw)
        ctrl = connect(transport, hostnqn=hostnqn, **args)  # type: ignore[arg-type]
        made.append(ctrl.name)
        return ctrl

    yield _connect
    for name in reversed(made):
        with contextlib.suppress(HostError):
            disconnect(name=name)
