"""How the NVMe-oF tier gets and watches its namespace: a link over the ``nvmeof`` host code.

:class:`FabricLink` connects to a subsystem at open (unless a controller to that
subsystem at that address, for that host NQN, is already there), finds the namespace's
block device through that controller in sysfs, reports whether the controller is live,
and reconnects once the kernel has given up on it (after ``ctrl_loss_tmo``).
:func:`open_nvmeof_tier` builds the tier from ``[tiers.nvmeof]``.
Called by :mod:`tierkv.store.opening`; the tier polls the link from its monitor thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from tierkv.config import NvmeofConfig
from tierkv.errors import ConfigError, TierIOError
from tierkv.tiers.aligned import round_up
from tierkv.tiers.nvmeof import LinkStatus, NamespaceLink, NvmeofTier, StaticLink

log = logging.getLogger(__name__)
# Controller states in which the kernel itself is still trying: wait, do not connect again.
_KERNEL_RETRYING = ("connecting", "resetting", "new")


class FabricLink:
    """A namespace ``nsid`` of subsystem ``subnqn`` reached over ``transport``.

    ``connect`` False never connects (read-only openers use what is there).
    ``disconnect_on_close`` disconnects the controllers this link connected.
    ``sysfs_root``/``dev_root`` are parameters for tests.
    """

    def __init__(self, cfg: NvmeofConfig, *, connect: bool = True,
                 sysfs_root: str = "/sys", dev_root: str = "/dev") -> None:
        assert cfg.subnqn is not None and cfg.transport is not None
        self.cfg = cfg
        self._connect_allowed = connect
        self._sysfs = sysfs_root
        self._dev = dev_root
        self._mine: list[str] = []
        self._lock = threading.Lock()
        self._closed = False
        self._secret = _read_secret(cfg.dhchap_secret_file, "dhchap_secret_file")
        self._ctrl_secret = _read_secret(cfg.dhchap_ctrl_secret_file, "dhchap_ctrl_secret_file")
        from nvmeof.diagnose import host_identity
        self._hostnqn = host_identity(cfg.hostnqn, cfg.hostid)[0]  # the one a connect uses

    def _controllers(self) -> list[tuple[str, str]]:
        """(name, state) of the controllers a connect with this config makes: same subsystem,
        transport, target address and host NQN (another target exporting the same NQN,
        or another host identity, is not this link's)."""
        from nvmeof.sysfs import list_controllers
        c = self.cfg
        return [(x.name, x.state.value) for x in list_controllers(self._sysfs)
                if x.reaches(c.transport or "", c.traddr, c.trsvcid, c.subnqn or "", self._hostnqn)]

    def _device(self, ctrls: list[tuple[str, str]] | None = None) -> str | None:
        from nvmeof.sysfs import find_namespace
        names = {name for name, _ in (self._controllers() if ctrls is None else ctrls)}
        if not names:
            return None
        return find_namespace(self.cfg.subnqn or "", self.cfg.nsid, self.cfg.transport, controllers=names,
                              sysfs_root=self._sysfs, dev_root=self._dev)

    def status(self) -> LinkStatus:
        ctrls = self._controllers()
        if not ctrls:
            at = "" if self.cfg.transport == "loop" else f" at {self.cfg.traddr}:{self.cfg.trsvcid}"
            return LinkStatus(None, False, f"no {self.cfg.transport} controller for {self.cfg.subnqn}{at}")
        live = [name for name, state in ctrls if state == "live"]
        if not live:
            states = ", ".join(f"{n} {s}" for n, s in ctrls)
            return LinkStatus(None, False, f"no live controller for {self.cfg.subnqn} ({states})")
        device = self._device(ctrls)
        if device is None:
            return LinkStatus(None, False, f"controller {live[0]} is live but namespace {self.cfg.nsid} is gone")
        return LinkStatus(device, True, f"{live[0]} live, {device}")

    def attach(self) -> str:
        st = self.status()
        if st.live and st.device is not None:
            return st.device
        if not self._connect_allowed:
            raise TierIOError(f"nvmeof tier: {st.detail}, and this open may not connect (read-only)")
        self._connect()
        device = self._device()
        if device is None:
            raise TierIOError(f"nvmeof tier: connected to {self.cfg.subnqn} but namespace {self.cfg.nsid} "
                              "has no block device")
        return device

    def reattach(self) -> str | None:
        st = self.status()
        if st.live:
            return st.device
        if any(state in _KERNEL_RETRYING for _, state in self._controllers()) or not self._connect_allowed:
            return None
        try:
            self._connect()
        except TierIOError as exc:
            log.info("nvmeof reconnect to %s failed: %s", self.cfg.subnqn, exc)
            return None
        return self._device()

    def _connect(self) -> None:
        from nvmeof.errors import NvmeofError
        from nvmeof.host import connect
        c = self.cfg
        try:
            ctrl = connect(c.transport or "", c.traddr or "", c.trsvcid, c.subnqn or "", hostnqn=c.hostnqn,
                           hostid=c.hostid, dhchap_secret=self._secret, dhchap_ctrl_secret=self._ctrl_secret,
                           ctrl_loss_tmo_s=c.ctrl_loss_tmo_s, reconnect_delay_s=c.reconnect_delay_s,
                           fast_io_fail_tmo_s=c.fast_io_fail_tmo_s, timeout_s=c.connect_timeout_s,
                           sysfs_root=self._sysfs, dev_root=self._dev)
        except NvmeofError as exc:
            raise TierIOError(f"nvmeof tier: cannot connect to {c.subnqn} at {c.transport}://{c.traddr}:"
                              f"{c.trsvcid}: {exc}") from exc
        with self._lock:
            self._mine.append(ctrl.name)
            late = self._closed  # the tier closed while this (re)connect ran
        if late:
            self._disconnect_mine()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._disconnect_mine()

    def _disconnect_mine(self) -> None:
        if not self.cfg.disconnect_on_close:
            return
        from nvmeof.errors import NvmeofError
        from nvmeof.host import disconnect
        with self._lock:
            mine, self._mine = self._mine, []
        for name in mine:
            try:
                disconnect(name=name, sysfs_root=self._sysfs)
            except NvmeofError as exc:
                log.warning("nvmeof tier: disconnecting %s failed: %s", name, exc)


def _read_secret(path: str | None, what: str) -> str | None:
    if path is None:
        return None
    try:
        text = Path(os.path.expanduser(path)).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"nvmeof.{what}: cannot read {path}: {exc.strerror}") from None
    if not text.startswith("DHHC-1:"):
        raise ConfigError(f"nvmeof.{what}: {path} does not hold a DHHC-1:... secret")
    return text


def make_link(cfg: NvmeofConfig, *, connect: bool) -> NamespaceLink:
    """A fabric link where the config names a subsystem, a static one for a bare device."""
    if cfg.subnqn is not None:
        return FabricLink(cfg, connect=connect)
    assert cfg.device is not None
    return StaticLink(os.path.expanduser(cfg.device))


def open_nvmeof_tier(cfg: NvmeofConfig, page_bytes: int, *, header_bytes: int, connect: bool,
                     link: NamespaceLink | None = None,
                     labelled_bytes: Callable[[bytes], int | None] | None = None) -> NvmeofTier:
    """Attach the namespace, size the tier (``capacity_bytes`` or the whole device), open it.

    With ``capacity_bytes`` 0 and ``labelled_bytes`` (which reads, from the device's
    first ``header_bytes``, how many data bytes the store that labelled it uses, or
    None), a namespace that grew since keeps the size it was labelled with, so the store
    still opens with its geometry. On any failure the link is closed (with
    ``disconnect_on_close``, a controller it connected is disconnected).
    """
    link = link or make_link(cfg, connect=connect)
    slot_bytes = round_up(page_bytes)
    try:
        device = link.attach()
        have = _device_bytes(device)
        want = cfg.capacity_bytes or _whole(device, have, header_bytes, labelled_bytes)
        if header_bytes + want > have:
            raise ConfigError(f"nvmeof capacity of {want} bytes (+{header_bytes} label) exceeds {device}'s {have}")
        slots = want // slot_bytes
        if slots == 0:
            raise ConfigError(f"nvmeof capacity of {want} bytes holds no slot of {slot_bytes} bytes")
    except BaseException:
        link.close()
        raise
    return NvmeofTier(link, slots, page_bytes, io_timeout_s=cfg.io_timeout_s,
                      monitor_interval_s=cfg.monitor_interval_s, o_direct=cfg.o_direct,
                      io_threads=cfg.io_threads, header_bytes=header_bytes)


def _whole(device: str, have: int, header_bytes: int, labelled_bytes: Callable[[bytes], int | None] | None) -> int:
    """The data bytes of a tier sized by its namespace: the labelled size where the
    namespace still holds it (it may have grown since), else all of it past the label."""
    room = have - header_bytes
    if labelled_bytes is None or header_bytes == 0 or room <= 0:
        return room
    try:
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
        try:
            header = os.pread(fd, header_bytes, 0)
        finally:
            os.close(fd)
    except OSError as exc:
        raise TierIOError(f"nvmeof tier: cannot read the label of {device}: {exc.strerror}") from None
    labelled = labelled_bytes(header)
    if labelled is not None and 0 < labelled < room:
        log.info("nvmeof tier: %s has %d bytes past its label; the store labelled it with %d and keeps "
                 "that size (set capacity_bytes to use more)", device, room, labelled)
        return labelled
    return room


def _device_bytes(path: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise TierIOError(f"nvmeof tier: cannot open {path}: {exc.strerror}") from None
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)
