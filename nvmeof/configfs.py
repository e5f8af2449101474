"""Apply an :class:`NvmetConfig` to the kernel's nvmet configfs tree, tear it down,
read it back, and the small targeted operations the test rig uses for fault injection.

``apply`` runs ``nvmetcli restore`` when nvmetcli is available and can express the
config; otherwise it writes configfs itself in dependency order: hosts (DH-HMAC-CHAP
attributes), subsystems (``attr_allow_any_host`` first, other attrs, allowed_hosts
links, namespaces with device_path/nguid/uuid/buffered_io/ana_grpid written *before*
``enable``), then ports (``addr_*`` with trtype first, ``param_*``, ANA groups,
referrals, and the subsystem links last: a link enables the port, after which the
kernel refuses address changes). The configfs root is a parameter; a plain directory
works as a stand-in (see :mod:`nvmeof.cfstree`). Not thread-safe: one writer per tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from nvmeof.cfstree import DEFAULT_ANA_GROUP, DEFAULT_ROOT, Kind, Tree, read_tree
from nvmeof.errors import ApplyError, ApplyFailure, ConfigError
from nvmeof.model import Address, Host, Namespace, NvmetConfig, Port, Subsystem

__all__ = ["DEFAULT_ROOT", "ApplyMethod", "ApplyReport", "OnError", "apply", "clear", "link_port",
           "nvmetcli_gaps", "read_tree", "set_namespace_enabled", "unlink_port"]

_SECRET_FILES = ("dhchap_key", "dhchap_ctrl_key")


class OnError(Enum):
    """``ABORT``: stop at the first failure and roll back what this call created.
    ``COLLECT``: record the failure, skip what depends on it, carry on."""

    ABORT = "abort"
    COLLECT = "collect"


class ApplyMethod(Enum):
    NVMETCLI = "nvmetcli"
    CONFIGFS = "configfs"


@dataclass(frozen=True)
class ApplyReport:
    """What an apply or clear did. ``created``/``removed``: object directories and
    links, in order; ``written``: attribute files; ``notes``: decisions worth knowing
    (e.g. why nvmetcli was not used, objects kept by a clear)."""

    method: ApplyMethod
    root: str
    created: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    written: tuple[str, ...] = ()
    failures: tuple[ApplyFailure, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, object]:
        return {"method": self.method.value, "root": self.root, "ok": self.ok, "created": list(self.created),
                "removed": list(self.removed), "written": list(self.written), "notes": list(self.notes),
                "failures": [{"path": f.path, "value": f.value, "error": f.error} for f in self.failures]}


class _Abort(Exception):
    pass


@dataclass
class _Run:
    """One apply/clear: performs operations through a Tree, records them, and applies
    the error policy in one place."""

    tree: Tree
    abort: bool
    created: list[tuple[str, Kind | None]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    failures: list[ApplyFailure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def op(self, path: str, value: str | None, fn: Callable[[], None]) -> bool:
        try:
            fn()
            return True
        except OSError as e:
            shown = "<secret>" if os.path.basename(path) in _SECRET_FILES else value
            self.failures.append(ApplyFailure(path, shown, e.strerror or str(e)))
            if self.abort:
                raise _Abort() from e
            return False

    def obj(self, path: str, kind: Kind) -> bool:
        """Make an object directory (an existing one is reused, not recorded)."""
        if os.path.isdir(path) and not os.path.islink(path):
            return True
        ok = self.op(path, None, lambda: self.tree.mkdir(path, kind))
        if ok:
            self.created.append((path, kind))
        return ok

    def attr(self, path: str, value: str | int | None) -> bool:
        if value is None or value == "":
            return True  # empty means "kernel default"; nvmetcli's write of "" is a no-op too
        text = str(value)
        if os.path.basename(path) not in _SECRET_FILES and self._existed(os.path.dirname(path)) \
                and _current(path) == text.strip():
            return True  # re-applying to a live target: the kernel refuses rewrites of
            # addr_* on an enabled port (EACCES) and device_path on an enabled namespace (EBUSY)
        ok = self.op(path, text, lambda: self.tree.write(path, text))
        if ok:
            self.written.append(path)
        return ok

    def _existed(self, obj: str) -> bool:
        """Whether ``obj`` was there before this apply (not made by it)."""
        return all(p != obj for p, _ in self.created)

    def link(self, target: str, link: str) -> bool:
        if os.path.islink(link) and os.path.basename(os.readlink(link)) == os.path.basename(target):
            return True
        ok = self.op(link, target, lambda: self.tree.symlink(target, link))
        if ok:
            self.created.append((link, None))
        return ok

    def remove(self, path: str, kind: Kind | None) -> bool:
        if kind is None:
            ok = self.op(path, None, lambda: self.tree.unlink(path))
        else:
            if kind is Kind.NAMESPACE and os.path.exists(os.path.join(path, "enable")):
                self.attr(os.path.join(path, "enable"), "0")
            ok = self.op(path, None, lambda: self.tree.rmdir(path, kind))
        if ok:
            self.removed.append(path)
        return ok

    def rollback(self) -> None:
        self.abort = False
        for path, kind in reversed(self.created):
            before = len(self.failures)
            self.remove(path, kind)
            for f in self.failures[before:]:
                self.failures[self.failures.index(f)] = ApplyFailure(f.path, f.value, "rollback: " + f.error)

    def report(self, method: ApplyMethod) -> ApplyReport:
        return ApplyReport(method, self.tree.root, tuple(p for p, _ in self.created), tuple(self.removed),
                           tuple(self.written), tuple(self.failures), tuple(self.notes))


def _current(path: str) -> str | None:
    """An attribute's value as the kernel shows it (padding stripped), None if unreadable."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def nvmetcli_gaps(cfg: NvmetConfig) -> list[str]:
    """What in ``cfg`` ``nvmetcli restore`` would silently drop (it has no JSON for
    namespace ``buffered_io`` or host ``dhchap_*``)."""
    gaps = ["host %r %s" % (h.nqn, k) for h in cfg.hosts for k in
            ("dhchap_key", "dhchap_ctrl_key", "dhchap_hash", "dhchap_dhgroup") if getattr(h, k) is not None]
    gaps += ["subsystem %r namespace %d buffered_io" % (s.nqn, n.nsid) for s in cfg.subsystems
             for n in s.namespaces if n.buffered_io]
    return gaps


def apply(cfg: NvmetConfig, root: str = DEFAULT_ROOT, *, on_error: OnError | str = OnError.ABORT,
          nvmetcli: str | None = None, use_nvmetcli: bool = True) -> ApplyReport:
    """Create ``cfg``'s objects under ``root`` and return what was done.

    nvmetcli is used when ``nvmetcli`` names it (or ``use_nvmetcli`` and it is on
    PATH), ``root`` is the default and the config has nothing nvmetcli drops (see
    :func:`nvmetcli_gaps`); note that ``nvmetcli restore`` first clears the whole
    target. An explicit ``nvmetcli`` with another root or with gaps is a
    :class:`ConfigError`. Otherwise configfs is written directly; existing objects are
    reused. ``cfg`` is validated first (:class:`ConfigError`). With ``on_error``
    ABORT the first failure rolls back what this call created and raises
    :class:`ApplyError`; with COLLECT failures are in the returned report.
    """
    policy = OnError(on_error)
    cfg.validate()
    exe = nvmetcli
    if exe is not None and os.path.abspath(root) != DEFAULT_ROOT:
        raise ConfigError("nvmetcli only writes %s; got root %s (drop nvmetcli to write configfs directly)"
                          % (DEFAULT_ROOT, root))
    if exe is not None and nvmetcli_gaps(cfg):
        raise ConfigError("nvmetcli restore would drop %s; apply without nvmetcli" % ", ".join(nvmetcli_gaps(cfg)))
    notes: list[str] = []
    if exe is None and use_nvmetcli and os.path.abspath(root) == DEFAULT_ROOT:
        found = shutil.which("nvmetcli")
        if found and nvmetcli_gaps(cfg):
            notes.append("nvmetcli not used: it would drop %s" % ", ".join(nvmetcli_gaps(cfg)))
        else:
            exe = found
    if exe is not None:
        return _apply_nvmetcli(cfg, exe, policy)
    run = _Run(Tree(root), policy is OnError.ABORT, notes=notes)
    try:
        if run.op(run.tree.root, None, run.tree.prepare):
            for h in cfg.hosts:
                _apply_host(run, h)
            for s in cfg.subsystems:
                _apply_subsystem(run, s)
            for p in cfg.ports:
                _apply_port(run, p)
    except _Abort:
        run.rollback()
        raise ApplyError("apply to %s aborted, %d created objects rolled back"
                         % (run.tree.root, len(run.created)), run.failures) from None
    return run.report(ApplyMethod.CONFIGFS)


def _apply_host(run: _Run, h: Host) -> None:
    path = run.tree.path("hosts", h.nqn)
    if run.obj(path, Kind.HOST):
        for name in ("dhchap_key", "dhchap_ctrl_key", "dhchap_hash", "dhchap_dhgroup"):
            run.attr(os.path.join(path, name), getattr(h, name))


def _apply_subsystem(run: _Run, s: Subsystem) -> None:
    path = run.tree.path("subsystems", s.nqn)
    if not run.obj(path, Kind.SUBSYSTEM):
        return
    # allow_any_host first: the kernel refuses allowed_hosts links while it is 1.
    attrs = sorted(s.attr.items(), key=lambda kv: (kv[0] != "allow_any_host", kv[0]))
    for name, value in attrs:
        run.attr(os.path.join(path, "attr_" + name), value.strip())
    for host in s.allowed_hosts:
        run.link(run.tree.path("hosts", host), os.path.join(path, "allowed_hosts", host))
    for ns in s.namespaces:
        _apply_namespace(run, os.path.join(path, "namespaces", str(ns.nsid)), ns)


def _apply_namespace(run: _Run, path: str, ns: Namespace) -> None:
    if not run.obj(path, Kind.NAMESPACE):
        return
    d = ns.device
    ok = all([run.attr(os.path.join(path, "device_path"), d.path),
              run.attr(os.path.join(path, "device_nguid"), d.nguid),
              run.attr(os.path.join(path, "device_uuid"), d.uuid),
              *(run.attr(os.path.join(path, "device_" + k), v) for k, v in sorted(d.extra.items())),
              run.attr(os.path.join(path, "buffered_io"), ns.buffered_io),
              run.attr(os.path.join(path, "ana_grpid"), ns.ana_grpid)])
    if ok:  # enabling with a half-set device would open the wrong thing
        run.attr(os.path.join(path, "enable"), ns.enable)


def _apply_addr(run: _Run, path: str, addr: Address) -> bool:
    return all([run.attr(os.path.join(path, "addr_" + k), v) for k, v in addr.items()])


def _apply_port(run: _Run, p: Port) -> None:
    path = run.tree.path("ports", p.portid)
    if not run.obj(path, Kind.PORT):
        return
    ok = _apply_addr(run, path, p.addr)
    ok = all([run.attr(os.path.join(path, "param_" + k), v) for k, v in sorted(p.param.items())]) and ok
    for a in p.ana_groups:
        apath = os.path.join(path, "ana_groups", str(a.grpid))
        if run.obj(apath, Kind.ANA_GROUP):
            for k, v in sorted(a.ana.items()):
                run.attr(os.path.join(apath, "ana_" + k), v)
    for r in p.referrals:
        rpath = os.path.join(path, "referrals", r.name)
        if run.obj(rpath, Kind.REFERRAL) and _apply_addr(run, rpath, r.addr):
            run.attr(os.path.join(rpath, "enable"), r.enable)
    if not ok:
        return  # linking would enable a port with a wrong address
    for nqn in p.subsystems:
        run.link(run.tree.path("subsystems", nqn), os.path.join(path, "subsystems", nqn))


def _apply_nvmetcli(cfg: NvmetConfig, exe: str, policy: OnError) -> ApplyReport:
    with tempfile.TemporaryDirectory(prefix="nvmeof-") as tmp:
        file = os.path.join(tmp, "config.json")
        cfg.dump(file)
        try:
            proc = subprocess.run([exe, "restore", file], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ApplyError("nvmetcli restore did not run", [ApplyFailure(exe, None, str(e))]) from None
    failures = [ApplyFailure(DEFAULT_ROOT, None, line.strip()) for line in proc.stdout.splitlines()
                if line.strip().endswith("skipped")]
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        failures.append(ApplyFailure(exe, None, "exit status %d: %s" % (proc.returncode, tail)))
    created = [os.path.join(DEFAULT_ROOT, "hosts", h.nqn) for h in cfg.hosts]
    created += [os.path.join(DEFAULT_ROOT, "subsystems", s.nqn) for s in cfg.subsystems]
    created += [os.path.join(DEFAULT_ROOT, "ports", str(p.portid)) for p in cfg.ports]
    report = ApplyReport(ApplyMethod.NVMETCLI, DEFAULT_ROOT, tuple(created), failures=tuple(failures),
                         notes=("nvmetcli restore replaced the whole target configuration",))
    if failures and policy is OnError.ABORT:
        clear(DEFAULT_ROOT, cfg)
        raise ApplyError("nvmetcli restore failed, its objects were cleared", failures)
    return report



def clear(root: str = DEFAULT_ROOT, cfg: NvmetConfig | None = None) -> ApplyReport:
    """Tear down in reverse dependency order and report; never raises for a failed
    step (see ``report.failures``), only :class:`ApplyError` if ``root`` is missing or
    not a directory.

    Without ``cfg`` everything under ``root`` goes: port links, referrals, ANA groups,
    ports, namespaces (disabled first), allowed_hosts links, subsystems, hosts. With
    ``cfg`` only its objects go (missing ones are skipped); a port, subsystem or host
    that still holds or serves something outside ``cfg`` is kept and noted.
    """
    run = _Run(Tree(root), abort=False)
    try:
        run.tree.check_root()
    except OSError as e:
        raise ApplyError("cannot clear", [ApplyFailure(run.tree.root, None, e.strerror or str(e))]) from None
    t = run.tree
    ports = [str(p.portid) for p in cfg.ports] if cfg else t.list("ports")
    nqns = [s.nqn for s in cfg.subsystems] if cfg else t.list("subsystems")
    hosts = [h.nqn for h in cfg.hosts] if cfg else t.list("hosts")
    wanted = {str(p.portid): p for p in cfg.ports} if cfg else {}
    for portid in t.list("ports"):  # links to our subsystems go from every port
        for nqn in t.list("ports", portid, "subsystems"):
            if nqn in nqns or (portid in wanted and nqn in wanted[portid].subsystems) or cfg is None:
                run.remove(t.path("ports", portid, "subsystems", nqn), None)
    for portid in ports:
        if not os.path.isdir(t.path("ports", portid)):
            continue
        mine = wanted.get(portid)
        for name in t.list("ports", portid, "referrals"):
            if mine is None or name in {r.name for r in mine.referrals}:
                run.remove(t.path("ports", portid, "referrals", name), Kind.REFERRAL)
        for grp in t.list("ports", portid, "ana_groups"):
            if grp != DEFAULT_ANA_GROUP and (mine is None or int(grp) in {a.grpid for a in mine.ana_groups}):
                run.remove(t.path("ports", portid, "ana_groups", grp), Kind.ANA_GROUP)
        _remove_if_empty(run, t.path("ports", portid), Kind.PORT)
    for nqn in nqns:
        if not os.path.isdir(t.path("subsystems", nqn)):
            continue
        sub = cfg.subsystem(nqn) if cfg else None
        for nsid in t.list("subsystems", nqn, "namespaces"):
            if sub is None or int(nsid) in {n.nsid for n in sub.namespaces}:
                run.remove(t.path("subsystems", nqn, "namespaces", nsid), Kind.NAMESPACE)
        for host in t.list("subsystems", nqn, "allowed_hosts"):
            if sub is None or host in sub.allowed_hosts:
                run.remove(t.path("subsystems", nqn, "allowed_hosts", host), None)
        _remove_if_empty(run, t.path("subsystems", nqn), Kind.SUBSYSTEM)
    for host in hosts:
        users = [s for s in t.list("subsystems") if os.path.lexists(t.path("subsystems", s, "allowed_hosts", host))]
        if users:
            run.notes.append("kept host %s: still allowed by subsystem(s) %s" % (host, ", ".join(users)))
        elif os.path.isdir(t.path("hosts", host)):
            run.remove(t.path("hosts", host), Kind.HOST)
    return run.report(ApplyMethod.CONFIGFS)


def _remove_if_empty(run: _Run, path: str, kind: Kind) -> None:
    from nvmeof.cfstree import GROUPS

    left = [os.path.join(g, n) for g in GROUPS[kind] for n in run.tree.list(os.path.join(path, g))
            if not (g == "ana_groups" and n == DEFAULT_ANA_GROUP)]
    if left:
        run.notes.append("kept %s: still holds %s" % (path, ", ".join(left)))
    else:
        run.remove(path, kind)


def _single(what: str, path: str, value: str | None, fn: Callable[[], None]) -> None:
    try:
        fn()
    except OSError as e:
        raise ApplyError(what, [ApplyFailure(path, value, e.strerror or str(e))]) from None


def set_namespace_enabled(nqn: str, nsid: int, enabled: bool, root: str = DEFAULT_ROOT) -> None:
    """Write 1 or 0 to ``subsystems/<nqn>/namespaces/<nsid>/enable`` (the kernel then
    opens or closes the backing device; hosts see the namespace vanish or return).
    :class:`ApplyError` with the errno text on failure."""
    t = Tree(root)
    path = t.path("subsystems", nqn, "namespaces", nsid, "enable")
    value = "1" if enabled else "0"
    _single("cannot %s namespace %d of %s" % ("enable" if enabled else "disable", nsid, nqn), path, value,
            lambda: t.write(path, value))


def link_port(portid: int, nqn: str, root: str = DEFAULT_ROOT) -> None:
    """Expose subsystem ``nqn`` on port ``portid`` (symlink; the first link enables
    the port and makes it listen). :class:`ApplyError` on failure."""
    t = Tree(root)
    link, target = t.path("ports", portid, "subsystems", nqn), t.path("subsystems", nqn)
    _single("cannot link port %d to %s" % (portid, nqn), link, target, lambda: t.symlink(target, link))


def unlink_port(portid: int, nqn: str, root: str = DEFAULT_ROOT) -> None:
    """Stop exposing ``nqn`` on port ``portid``; connected hosts lose their paths
    through it (the last unlink disables the port). :class:`ApplyError` on failure."""
    t = Tree(root)
    link = t.path("ports", portid, "subsystems", nqn)
    _single("cannot unlink port %d from %s" % (portid, nqn), link, None, lambda: t.unlink(link))
