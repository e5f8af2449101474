"""Read-only views of the kernel's NVMe host state, from sysfs.

Called by ``nvmeof.host`` (to wait for a controller to come live and find its block
device), by the NVMe-oF tier (to watch its controller's state) and by ``tierkv doctor``.
Nothing here writes; nothing here needs root. Roots are parameters so that tests can build
a fake tree the way the kernel lays it out (Linux 6.1, nvme-rdma/nvme-tcp):

- ``/sys/class/nvme/nvmeX`` -> ``/sys/devices/virtual/nvme-fabrics/ctl/nvmeX``: one
  controller, with the attribute files ``transport``, ``address``
  (``traddr=10.77.0.1,trsvcid=4420[,host_traddr=...][,src_addr=...]``), ``subsysnqn``,
  ``hostnqn``, ``hostid``, ``state``, ``cntlid``, ``model``, ``serial``. With native
  multipath (Debian's default) it holds the hidden path device ``nvme<S>c<X>n<H>``;
  without multipath it holds the block device ``nvme<X>n<H>`` itself.
- ``/sys/class/nvme-subsystem/nvme-subsysS`` -> ``/sys/devices/virtual/nvme-subsystem/...``:
  ``subsysnqn``, a symlink per controller (``nvmeX``) and, with multipath, the block device
  ``nvme<S>n<H>`` that users open. ``H`` is the namespace *head instance*, not the NSID:
  the NSID is read from the ``nsid`` file of the block device's directory.

Every function reads the tree afresh: the kernel changes it under us, so a read of a file
that vanished meanwhile counts as "absent", never as an error.
"""

from __future__ import annotations

import enum
import ipaddress
import os
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Controller", "ControllerState", "FabricAddress", "controller_state", "find_namespace",
    "get_controller", "list_controllers", "parse_address",
]

_BLOCK = re.compile(r"^nvme(\d+)n(\d+)$")            # nvme0n1: a block device
_PATH = re.compile(r"^nvme(\d+)c(\d+)n(\d+)$")       # nvme0c1n1: a hidden multipath path
_CTRL = re.compile(r"^nvme\d+$")


class ControllerState(enum.Enum):
    """A controller's ``state`` file, as the kernel's ``nvme_sysfs_show_state`` writes it."""

    NEW = "new"
    LIVE = "live"
    RESETTING = "resetting"
    CONNECTING = "connecting"
    DELETING = "deleting"
    DELETING_NOIO = "deleting (noio)"
    DEAD = "dead"
    UNKNOWN = "unknown state"

    @classmethod
    def parse(cls, text: str) -> ControllerState:
        """The state for the file's text; ``UNKNOWN`` for anything this module does not know."""
        try:
            return cls(text.strip())
        except ValueError:
            return cls.UNKNOWN


@dataclass(frozen=True)
class FabricAddress:
    """A controller's ``address`` file: ``key=value`` pairs separated by commas.

    ``extra`` keeps keys this module does not name (newer kernels add some), in file order.
    """

    traddr: str | None = None
    trsvcid: str | None = None
    host_traddr: str | None = None
    host_iface: str | None = None
    src_addr: str | None = None
    extra: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Controller:
    """One NVMe controller as sysfs shows it at the moment it was read.

    ``namespaces`` are the names of the block devices a user opens (``nvme1n1``, under
    ``/dev``), sorted; with native multipath these are the subsystem's head devices reached
    through this controller. ``subsystem`` is ``nvme-subsysS`` or None when not linked.
    Fields the kernel does not expose for a transport (``hostnqn`` on PCIe) are None.
    """

    name: str
    transport: str
    address: FabricAddress
    subsysnqn: str | None
    hostnqn: str | None
    hostid: str | None
    state: ControllerState
    cntlid: int | None
    model: str | None
    serial: str | None
    subsystem: str | None
    namespaces: tuple[str, ...] = field(default=())

    def reaches(self, transport: str, traddr: str | None, trsvcid: str | None, subsysnqn: str,
                hostnqn: str | None = None) -> bool:
        """Whether this controller is the one a connect with these arguments makes.

        Subsystem NQN and transport must be equal; so must the target address
        (``traddr`` compared as an IP address where both sides parse as one, ``trsvcid``
        as text), except over ``loop``, whose controllers have no ``address`` file.
        ``hostnqn`` counts where both sides know it. The state is not looked at.
        """
        if self.subsysnqn != subsysnqn or self.transport != transport:
            return False
        if hostnqn is not None and self.hostnqn is not None and self.hostnqn != hostnqn:
            return False
        if transport == "loop":
            return True
        return _same_addr(self.address.traddr, traddr) and (self.address.trsvcid or "") == (trsvcid or "")


def _same_addr(have: str | None, want: str | None) -> bool:
    if have == want:
        return True
    try:
        return ipaddress.ip_address(have or "") == ipaddress.ip_address(want or "")
    except ValueError:
        return False


def parse_address(text: str) -> FabricAddress:
    """Parse an ``address`` file (``traddr=10.77.0.1,trsvcid=4420,src_addr=10.77.0.2``).

    Empty text gives an empty address; a part without ``=`` is kept in ``extra`` with an
    empty value rather than rejected, since the file's format is the kernel's, not ours.
    """
    known: dict[str, str] = {}
    extra: list[tuple[str, str]] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        key, _, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if key in ("traddr", "trsvcid", "host_traddr", "host_iface", "src_addr"):
            known[key] = value
        else:
            extra.append((key, value))
    return FabricAddress(**known, extra=tuple(extra))


def _read(path: Path) -> str | None:
    """A sysfs attribute's text without the trailing newline; None if absent or unreadable."""
    try:
        return path.read_text(errors="replace").rstrip("\n")
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text.strip(), 0) if text is not None else None
    except ValueError:
        return None


def _sort_key(name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", name))


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path), key=lambda n: (_sort_key(n), n))
    except OSError:
        return []


def _subsystems(sysfs_root: str) -> list[Path]:
    base = Path(sysfs_root) / "class" / "nvme-subsystem"
    return [base / n for n in _listdir(base) if n.startswith("nvme-subsys")]


def _subsystem_of(name: str, sysfs_root: str) -> Path | None:
    """The subsystem directory holding a symlink to controller ``name``."""
    for sub in _subsystems(sysfs_root):
        if (sub / name).is_symlink() or (sub / name).is_dir():
            return sub
    return None


def _namespaces(ctrl_dir: Path, subsys_dir: Path | None) -> tuple[str, ...]:
    names: set[str] = set()
    for child in _listdir(ctrl_dir):
        if _BLOCK.match(child):                      # no multipath: the disk hangs off the ctrl
            names.add(child)
            continue
        m = _PATH.match(child)
        if m and subsys_dir is not None:             # multipath: map the path to its head disk
            head = f"nvme{m.group(1)}n{m.group(3)}"
            if (subsys_dir / head).is_dir():
                names.add(head)
    return tuple(sorted(names, key=_sort_key))


def _controller(ctrl_dir: Path, sysfs_root: str) -> Controller | None:
    state = _read(ctrl_dir / "state")
    if state is None:                                # gone (deleted) while we listed
        return None
    subsys_dir = _subsystem_of(ctrl_dir.name, sysfs_root)
    model, serial = _read(ctrl_dir / "model"), _read(ctrl_dir / "serial")
    return Controller(
        name=ctrl_dir.name,
        transport=(_read(ctrl_dir / "transport") or "").strip(),
        address=parse_address(_read(ctrl_dir / "address") or ""),
        subsysnqn=_stripped(_read(ctrl_dir / "subsysnqn")),
        hostnqn=_stripped(_read(ctrl_dir / "hostnqn")),
        hostid=_stripped(_read(ctrl_dir / "hostid")),
        state=ControllerState.parse(state),
        cntlid=_read_int(ctrl_dir / "cntlid"),
        model=_stripped(model),
        serial=_stripped(serial),
        subsystem=subsys_dir.name if subsys_dir is not None else None,
        namespaces=_namespaces(ctrl_dir, subsys_dir),
    )


def _stripped(text: str | None) -> str | None:
    return text.strip() if text is not None and text.strip() else None


def list_controllers(sysfs_root: str = "/sys") -> list[Controller]:
    """Every controller under ``<sysfs_root>/class/nvme``, sorted by instance number.

    PCIe controllers are included (``transport == "pcie"``); filter on ``transport`` for
    fabrics only. An absent tree (no nvme module) gives an empty list.
    """
    base = Path(sysfs_root) / "class" / "nvme"
    out = []
    for name in _listdir(base):
        if _CTRL.match(name):
            ctrl = _controller(base / name, sysfs_root)
            if ctrl is not None:
                out.append(ctrl)
    return out


def get_controller(name: str, sysfs_root: str = "/sys") -> Controller | None:
    """Controller ``name`` (``"nvme0"``), or None if it does not exist (any more)."""
    if not _CTRL.match(name):
        raise ValueError(f"expected a controller name like 'nvme0', got {name!r}")
    return _controller(Path(sysfs_root) / "class" / "nvme" / name, sysfs_root)


def controller_state(name: str, sysfs_root: str = "/sys") -> ControllerState | None:
    """Controller ``name``'s state, or None if it does not exist (deleted, or never was)."""
    if not _CTRL.match(name):
        raise ValueError(f"expected a controller name like 'nvme0', got {name!r}")
    text = _read(Path(sysfs_root) / "class" / "nvme" / name / "state")
    return ControllerState.parse(text) if text is not None else None


def find_namespace(nqn: str, nsid: int = 1, transport: str | None = None, *,
                   controllers: Collection[str] | None = None,
                   sysfs_root: str = "/sys", dev_root: str = "/dev") -> str | None:
    """The block device path (``"/dev/nvme0n1"``) of namespace ``nsid`` of subsystem ``nqn``.

    Looks at the subsystem's multipath head devices first, then at block devices hanging
    directly off a controller (``nvme_core.multipath=N``). A device counts only if its
    ``nsid`` file says ``nsid`` (names carry the head instance, not the NSID) and its node
    exists under ``dev_root``. With ``transport``, only subsystems/controllers reached over
    that transport count. With ``controllers`` (names like ``"nvme0"``), only devices
    reached through those controllers count: another target exporting the same NQN is
    then never taken for this one. The controller's state is not checked: ask
    ``controller_state``. Returns None when nothing matches (not connected, namespace not
    scanned yet, udev slow).
    """
    ctrls = [c for c in list_controllers(sysfs_root)
             if c.subsysnqn == nqn and (transport is None or c.transport == transport)
             and (controllers is None or c.name in controllers)]
    subsys_names = {c.subsystem for c in ctrls if c.subsystem is not None}
    reached = {n for c in ctrls for n in c.namespaces}
    candidates: list[Path] = []
    for sub in _subsystems(sysfs_root):
        if sub.name in subsys_names:
            candidates += [sub / n for n in _listdir(sub)
                           if _BLOCK.match(n) and (controllers is None or n in reached)]
    base = Path(sysfs_root) / "class" / "nvme"
    for c in ctrls:
        candidates += [base / c.name / n for n in _listdir(base / c.name) if _BLOCK.match(n)]
    for disk in candidates:
        if _read_int(disk / "nsid") == nsid and os.path.exists(os.path.join(dev_root, disk.name)):
            return os.path.join(dev_root, disk.name)
    return None
