"""The NVMe-oF host: discover, connect, disconnect, and wait on controller state.

Called by tierkv's NVMe-oF tier (to get its block device and let it go) and by the QEMU
rig's tests. The kernel does the work; this module asks it to, through one of two backends,
then watches sysfs (``nvmeof.sysfs``) until the result is visible:

- ``Backend.LIBNVME``: Debian's ``python3-nvme`` (libnvme 1.3 SWIG bindings), run in a
  short-lived child of ``/usr/bin/python3``. The bindings import only there, and their
  iterators can segfault the interpreter; a child keeps a crash away from the caller and
  works from any interpreter or venv. Only connect and discovery go through it.
- ``Backend.NVME_CLI``: ``nvme discover/connect -o json`` (``nvmeof.nvmecli``); the
  default where it is installed (libnvme 1.3's child crashes after connecting in the
  rig's Debian 6.1 guest).

Disconnect writes ``1`` to ``/sys/class/nvme/<ctrl>/delete_controller``, which is what both
tools do. Options a backend cannot pass (``fast_io_fail_tmo`` in libnvme 1.3's bindings and
nvme-cli < 2.4) are written to the controller's sysfs attribute of the same name right
after it appears. Functions block the calling thread; they are safe to call from several
threads (the kernel serialises controller creation) but make no ordering promise.
"""

from __future__ import annotations

import enum
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

from nvmeof import nvmecli
from nvmeof.diagnose import (ConnectFailure, classify, default_hostid, default_hostnqn, host_identity,
                             kernel_log_tail)
from nvmeof.errors import NvmeofError
from nvmeof.nvmecli import ConnectOptions
from nvmeof.sysfs import Controller, ControllerState, get_controller, list_controllers

__all__ = [
    "Backend", "ConnectError", "ConnectFailure", "DiscoveryRecord", "HostError",
    "HostTimeoutError", "SubsystemType", "connect", "default_hostid", "default_hostnqn",
    "disconnect", "discover", "list_controllers", "wait_for_state",
]

_POLL_S = 0.05
_CTRL_NAME = re.compile(r"nvme\d+")
_GONE = (ControllerState.DELETING, ControllerState.DELETING_NOIO, ControllerState.DEAD)


class HostError(NvmeofError):
    """A host-side operation failed (the kernel refused, a tool failed, a wait ran out)."""


class HostTimeoutError(HostError):
    """A wait for kernel state (a controller gone, a state reached) ran past its timeout."""


class ConnectError(HostError):
    """Connect or discovery failed. ``attempted`` names the target and backend tried,
    ``reason`` classifies the failure, ``detail`` holds the tool's stderr and the kernel's
    recent nvme log lines. Secrets never appear in the message."""

    def __init__(self, attempted: str, reason: ConnectFailure, detail: str = "") -> None:
        # A tool or kernel line that echoes a DH-HMAC-CHAP secret must not carry it into
        # messages and logs.
        attempted, detail = _redact(attempted), _redact(detail)
        self.attempted, self.reason, self.detail = attempted, reason, detail.strip()
        msg = "connect to %s failed: %s" % (attempted, reason.value)
        super().__init__(msg + (": " + " | ".join(self.detail.splitlines()) if self.detail else ""))


def _redact(text: str) -> str:
    return _SECRET.sub("DHHC-1:<redacted>", text)


_SECRET = re.compile(r"DHHC-1:[^\s'\",]*")


class Backend(enum.Enum):
    """How connect and discovery reach the kernel."""

    LIBNVME = "libnvme"
    NVME_CLI = "nvme-cli"


class SubsystemType(enum.Enum):
    """A discovery log entry's ``subtype``."""

    NVME = "nvme subsystem"
    DISCOVERY_REFERRAL = "discovery subsystem referral"
    CURRENT_DISCOVERY = "current discovery subsystem"
    UNKNOWN = "unknown"

    @classmethod
    def parse(cls, value: object) -> SubsystemType:
        """From nvme-cli's/libnvme's text, or the raw number (1 referral, 2 nvme, 3 current)."""
        text = str(value).strip().lower()
        if text in ("2", "nvme", "nvme subsystem"):
            return cls.NVME
        if text == "3" or "current" in text:
            return cls.CURRENT_DISCOVERY
        if text == "1" or "discovery" in text or "referral" in text:
            return cls.DISCOVERY_REFERRAL
        return cls.UNKNOWN


@dataclass(frozen=True)
class DiscoveryRecord:
    """One discovery log page entry: where a subsystem can be connected to."""

    transport: str
    traddr: str
    trsvcid: str
    subnqn: str
    subtype: SubsystemType
    adrfam: str | None = None
    portid: int | None = None
    treq: str | None = None

    @classmethod
    def from_json(cls, rec: object) -> DiscoveryRecord:
        """From one nvme-cli ``records`` entry or libnvme dict (fixed-width fields stripped)."""
        if not isinstance(rec, dict):
            raise ValueError(f"expected a discovery record object, got {rec!r}")

        def text(key: str) -> str | None:
            v = rec.get(key)
            return str(v).strip() if v is not None else None
        portid = text("portid")
        return cls(transport=text("trtype") or "", traddr=text("traddr") or "",
                   trsvcid=text("trsvcid") or "", subnqn=text("subnqn") or "",
                   subtype=SubsystemType.parse(rec.get("subtype", "")), adrfam=text("adrfam"),
                   portid=int(portid, 0) if portid and portid.lstrip("-").isdigit() else None,
                   treq=text("treq"))


def _choose(backend: Backend | None, opts: ConnectOptions | None, attempted: str) -> Backend:
    has_cli = shutil.which(nvmecli.NVME) is not None
    needs_cli = opts is not None and opts.dhchap_ctrl_secret is not None
    if backend is Backend.LIBNVME:
        if needs_cli:
            raise ConnectError(attempted, ConnectFailure.UNSUPPORTED, "libnvme 1.3's Python "
                               "bindings cannot set dhchap_ctrl_secret; use Backend.NVME_CLI")
        if not nvmecli.libnvme_available():
            raise ConnectError(attempted, ConnectFailure.NO_BACKEND,
                               f"{nvmecli.LIBNVME_PYTHON} cannot import libnvme (apt-get install python3-nvme)")
        return backend
    # Without a choice nvme-cli goes first: in the rig's 6.1 guest libnvme 1.3's child
    # connects the controller and then dies of a general protection fault in libnvme.so.
    if backend is Backend.NVME_CLI or (backend is None and (has_cli or needs_cli or not nvmecli.libnvme_available())):
        if not has_cli:
            raise ConnectError(attempted, ConnectFailure.NO_BACKEND,
                               "nvme-cli not on PATH (apt-get install nvme-cli)")
        return Backend.NVME_CLI
    return Backend.LIBNVME


def _libnvme(req: dict[str, object], timeout_s: float, attempted: str,
             started: float) -> Mapping[str, object]:
    try:
        res = nvmecli.run_libnvme(req, timeout_s)
    except subprocess.TimeoutExpired:
        raise ConnectError(attempted, ConnectFailure.TIMEOUT, "libnvme child ran past %.1f s"
                           % timeout_s) from None
    if res.ok:
        return res.reply
    why = res.reply.get("error") or "libnvme child exited with %d" % res.returncode
    text = "\n".join([str(why), res.stderr.strip()[-2000:], *kernel_log_tail(started)])
    raise ConnectError(attempted, classify(text), text)


def _cli(argv: list[str], timeout_s: float, attempted: str, started: float) -> nvmecli.CliResult:
    try:
        res = nvmecli.run(argv, timeout_s)
    except subprocess.TimeoutExpired:
        raise ConnectError(attempted, ConnectFailure.TIMEOUT, "nvme-cli ran past %.1f s"
                           % timeout_s) from None
    if res.returncode != 0:
        text = "\n".join([res.stderr.strip()[-2000:] or "nvme-cli exited with %d" % res.returncode,
                          *kernel_log_tail(started)])
        raise ConnectError(attempted, classify(text), text)
    return res


def discover(transport: str, traddr: str, trsvcid: str | int, *, hostnqn: str | None = None,
             backend: Backend | None = None, timeout_s: float = 10.0) -> list[DiscoveryRecord]:
    """Read the discovery log page of a target port (a transient discovery controller).

    Returns every record, NVMe subsystems and referrals alike. Raises ConnectError
    (with ``reason``) if the discovery controller cannot be reached or refuses this host.
    """
    hostnqn, hostid = host_identity(hostnqn, None)
    attempted = "%s:%s:%s (discovery, hostnqn=%s)" % (transport, traddr, trsvcid, hostnqn)
    chosen = _choose(backend, None, attempted)
    started = time.monotonic()
    attempted += " via " + chosen.value
    if chosen is Backend.LIBNVME:
        raw = _libnvme({"op": "discover", "transport": transport, "traddr": traddr,
                        "trsvcid": str(trsvcid), "hostnqn": hostnqn, "hostid": hostid},
                       timeout_s, attempted, started).get("records", [])
        records = raw if isinstance(raw, list) else []
    else:
        res = _cli(nvmecli.discover_args(transport, traddr, str(trsvcid), hostnqn=hostnqn,
                                         hostid=hostid), timeout_s, attempted, started)
        try:
            records = nvmecli.parse_discovery(res.stdout)
        except ValueError as exc:
            raise ConnectError(attempted, ConnectFailure.OTHER, str(exc)) from None
    return [DiscoveryRecord.from_json(r) for r in records]


def connect(transport: str, traddr: str, trsvcid: str | int, nqn: str, *,
            hostnqn: str | None = None, hostid: str | None = None,
            dhchap_secret: str | None = None, dhchap_ctrl_secret: str | None = None,
            ctrl_loss_tmo_s: int | None = None, reconnect_delay_s: int | None = None,
            fast_io_fail_tmo_s: int | None = None, keep_alive_tmo_s: int | None = None,
            timeout_s: float = 10.0, backend: Backend | None = None,
            sysfs_root: str = "/sys", dev_root: str = "/dev") -> Controller:
    """Connect to subsystem ``nqn`` at ``transport``/``traddr``/``trsvcid``; return it live.

    Returns once the controller's state is ``live`` and at least one of its namespaces has
    a block device node under ``dev_root`` (``Controller.namespaces``, e.g. ``("nvme1n1",)``).
    Idempotent: if a live controller with the same transport, address, NQN and hostnqn
    already exists (``Controller.reaches``; ``loop`` controllers have no address, so
    there the address is not compared), it is returned and nothing new is created. The hostnqn/hostid pair is
    ``host_identity(hostnqn, hostid)``. ``backend=None`` picks nvme-cli when it is on PATH
    (or the options need it), else libnvme. Times are whole seconds, passed to
    the kernel as they are (None: the kernel's default); ``timeout_s`` bounds the whole call.

    Raises ConnectError, whose ``reason`` says why: a host missing from the subsystem's
    allowed hosts gives ``HOST_REFUSED`` (the kernel returns EIO; the reason comes from its
    log, so it needs root to read ``/dev/kmsg``, else ``OTHER`` with the tool's text);
    ``TIMEOUT`` when the controller is not live with a namespace in time. On any raise,
    a controller this call created has been deleted again; none that existed before is
    touched.
    """
    hostnqn, hostid = host_identity(hostnqn, hostid)
    opts = ConnectOptions(transport, traddr, str(trsvcid), nqn, hostnqn, hostid, dhchap_secret,
                          dhchap_ctrl_secret, ctrl_loss_tmo_s, reconnect_delay_s,
                          fast_io_fail_tmo_s, keep_alive_tmo_s)
    attempted = "%s:%s:%s nqn=%s hostnqn=%s" % (transport, traddr, trsvcid, nqn, hostnqn)
    existing = _matching(opts, sysfs_root)
    live = [c for c in existing if c.state is ControllerState.LIVE and c.namespaces]
    if live:
        return live[0]
    chosen = _choose(backend, opts, attempted)
    attempted += " via " + chosen.value
    started = time.monotonic()
    deadline = started + timeout_s
    before = {c.name for c in list_controllers(sysfs_root)}
    post: dict[str, int] = {}
    if chosen is Backend.LIBNVME:
        cfg = {k: v for k, v in (("ctrl_loss_tmo", ctrl_loss_tmo_s),
                                 ("reconnect_delay", reconnect_delay_s),
                                 ("keep_alive_tmo", keep_alive_tmo_s)) if v is not None}
        out = _libnvme({"op": "connect", "transport": transport, "traddr": traddr,
                        "trsvcid": str(trsvcid), "nqn": nqn, "hostnqn": hostnqn, "hostid": hostid,
                        "dhchap_secret": dhchap_secret, "cfg": cfg}, timeout_s, attempted, started)
        name = out.get("device") if isinstance(out.get("device"), str) else None
        if fast_io_fail_tmo_s is not None:
            post["fast_io_fail_tmo"] = fast_io_fail_tmo_s
    else:
        supported = nvmecli.connect_options()
        fast_flag = nvmecli.FAST_IO_FAIL_FLAG in supported
        missing = [o for o in nvmecli.unsupported_options(opts, supported)
                   if o != nvmecli.FAST_IO_FAIL_FLAG] if supported else []
        if missing:
            raise ConnectError(attempted, ConnectFailure.UNSUPPORTED,
                               "the installed nvme-cli lacks " + ", ".join(missing))
        if fast_io_fail_tmo_s is not None and not fast_flag:
            post["fast_io_fail_tmo"] = fast_io_fail_tmo_s
        res = _cli(nvmecli.connect_args(opts, fast_io_fail_flag=fast_flag), timeout_s,
                   attempted, started)
        name = nvmecli.connected_device(res.stdout)
    return _await_live(opts, str(name) if name else None, before, post, deadline, attempted,
                       sysfs_root, dev_root)


def _matching(opts: ConnectOptions, sysfs_root: str) -> list[Controller]:
    return [c for c in list_controllers(sysfs_root)
            if c.reaches(opts.transport, opts.traddr, opts.trsvcid, opts.nqn, opts.hostnqn)
            and c.state not in _GONE]


def _await_live(opts: ConnectOptions, name: str | None, before: set[str], post: dict[str, int],
                deadline: float, attempted: str, sysfs_root: str, dev_root: str) -> Controller:
    seen: Controller | None = None
    while True:
        new = [c for c in _matching(opts, sysfs_root) if c.name not in before or c.name == name]
        if name is not None:
            new = [c for c in new if c.name == name] or new
        if new:
            seen = new[0]
            for attr, value in list(post.items()):
                try:
                    _write_attr(seen.name, attr, str(value), sysfs_root)
                except OSError as exc:
                    _delete(seen.name, sysfs_root)
                    raise ConnectError(attempted, ConnectFailure.UNSUPPORTED, "setting %s=%s in "
                                       "sysfs failed: %s" % (attr, value, exc)) from None
                del post[attr]
            if seen.state is ControllerState.LIVE and any(
                    os.path.exists(os.path.join(dev_root, n)) for n in seen.namespaces):
                return seen
        if time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)                          # sysfs has no change notification
    if seen is not None:
        _delete(seen.name, sysfs_root)
        state = "%s was %s with namespaces %s" % (seen.name, seen.state.value,
                                                  list(seen.namespaces) or "none")
    elif name is not None and _CTRL_NAME.fullmatch(name) and name not in before:
        # The tool made a controller that never matched what was asked for (its sysfs
        # view differs): it is still this call's, so it goes too.
        _delete(name, sysfs_root)
        state = "the tool reported %s, which never matched the request" % name
    else:
        state = "no controller appeared"
    raise ConnectError(attempted, ConnectFailure.TIMEOUT, state)


def _write_attr(name: str, attr: str, value: str, sysfs_root: str) -> None:
    with open(os.path.join(sysfs_root, "class", "nvme", name, attr), "w", encoding="ascii") as f:
        f.write(value)


def _delete(name: str, sysfs_root: str) -> bool:
    """Ask the kernel to delete controller ``name``; False if it was already gone."""
    try:
        _write_attr(name, "delete_controller", "1", sysfs_root)
        return True
    except FileNotFoundError:
        return False


def disconnect(*, nqn: str | None = None, name: str | None = None, timeout_s: float = 10.0,
               sysfs_root: str = "/sys") -> int:
    """Delete the controllers of subsystem ``nqn``, or controller ``name``; exactly one.

    Returns how many controllers this call asked the kernel to delete (0 if none matched)
    once all of them have left sysfs. Raises ValueError for neither/both arguments,
    HostError if a delete is refused (permission), HostTimeoutError if any is still
    present after ``timeout_s``.
    """
    if (nqn is None) == (name is None):
        raise ValueError("expected exactly one of nqn= or name=, got %r and %r" % (nqn, name))
    targets = [c.name for c in list_controllers(sysfs_root)
               if (nqn is not None and c.subsysnqn == nqn) or c.name == name]
    try:
        removed = [n for n in targets if _delete(n, sysfs_root)]
    except OSError as exc:
        raise HostError("deleting controller(s) %s failed: %s" % (", ".join(targets), exc)) from exc
    deadline = time.monotonic() + timeout_s
    while True:
        left = sorted(set(removed) & {c.name for c in list_controllers(sysfs_root)})
        if not left:
            return len(removed)
        if time.monotonic() >= deadline:
            raise HostTimeoutError("controller(s) %s still present %.1f s after delete_controller"
                                   % (", ".join(left), timeout_s))
        time.sleep(_POLL_S)


def wait_for_state(name: str, state: ControllerState, *, timeout_s: float,
                   sysfs_root: str = "/sys") -> Controller:
    """Block until controller ``name`` is in ``state``; return it as then read.

    Raises HostTimeoutError naming the last state seen (or that the controller vanished),
    ValueError at once if ``name`` is not a controller's name (``"nvme0"``).
    """
    deadline = time.monotonic() + timeout_s
    last: Controller | None = None
    while True:
        last = get_controller(name, sysfs_root)
        if last is not None and last.state is state:
            return last
        if time.monotonic() >= deadline:
            seen = "gone" if last is None else last.state.value
            raise HostTimeoutError("%s not %s after %.1f s (last seen: %s)"
                                   % (name, state.value, timeout_s, seen))
        time.sleep(_POLL_S)
