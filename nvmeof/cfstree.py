"""The nvmet configfs tree as a filesystem: paths, object kinds, and the one place
that emulates configfs on a plain directory.

Real configfs differs from a directory: ``mkdir`` of an object creates its attribute
files and default groups (a subsystem's ``namespaces/`` and ``allowed_hosts/``, a
port's ``subsystems/``, ``referrals/`` and ``ana_groups/1``); attribute files cannot be
created or unlinked; ``rmdir`` of an object removes its attributes and default groups
but fails with ENOTEMPTY while those hold items or links. :class:`Tree` performs each
operation; on a plain directory (unit tests) it adds exactly those effects, modelled
on a 6.1 kernel, and nothing else differs. Used by ``nvmeof.configfs``.
"""

from __future__ import annotations

import errno
import os
import stat
from enum import Enum

from nvmeof.errors import ApplyError, ApplyFailure
from nvmeof.model import Address, AnaGroup, Device, Host, Namespace, NvmetConfig, Port, Referral, Subsystem

DEFAULT_ROOT = "/sys/kernel/config/nvmet"
_ZERO_UUID = "00000000-0000-0000-0000-000000000000"
_ADDR = {"addr_adrfam": "", "addr_treq": "not specified", "addr_traddr": "", "addr_trsvcid": "",
         "addr_trtype": ""}


class Kind(Enum):
    """A configfs object kind; the value is its parent group's name."""

    HOST = "hosts"
    SUBSYSTEM = "subsystems"
    NAMESPACE = "namespaces"
    PORT = "ports"
    REFERRAL = "referrals"
    ANA_GROUP = "ana_groups"


# Attribute files (with the kernel's defaults) and default groups mkdir creates.
ATTRS: dict[Kind, dict[str, str]] = {
    Kind.HOST: {"dhchap_key": "", "dhchap_ctrl_key": "", "dhchap_hash": "hmac(sha256)",
                "dhchap_dhgroup": "null"},
    Kind.SUBSYSTEM: {"attr_allow_any_host": "0", "attr_version": "1.3", "attr_serial": "",
                     "attr_cntlid_min": "1", "attr_cntlid_max": "65519", "attr_model": "Linux",
                     "attr_qid_max": "128", "attr_pi_enable": "0"},
    Kind.NAMESPACE: {"device_path": "", "device_nguid": _ZERO_UUID, "device_uuid": _ZERO_UUID,
                     "enable": "0", "buffered_io": "0", "ana_grpid": "1"},
    Kind.PORT: {**_ADDR, "param_inline_data_size": "-1", "param_pi_enable": "0"},
    Kind.REFERRAL: {**_ADDR, "portid": "0", "enable": "0"},
    Kind.ANA_GROUP: {"ana_state": "optimized"},
}
GROUPS: dict[Kind, tuple[str, ...]] = {Kind.SUBSYSTEM: ("namespaces", "allowed_hosts"),
                                       Kind.PORT: ("subsystems", "referrals", "ana_groups")}
DEFAULT_ANA_GROUP = "1"


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def is_configfs(path: str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether ``path`` lies on a configfs mount (the filesystem type of the longest
    mount point containing it, from ``mountinfo``). ``False`` if that cannot be read."""
    real = os.path.realpath(path)
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    best, fstype = "", ""
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mnt = _unescape(fields[4])
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, fstype = mnt, right.split()[0]
    return fstype == "configfs"


class Tree:
    """Filesystem operations on an nvmet configfs root (real or a plain-directory
    stand-in). Every method raises ``OSError`` like the kernel would; not thread-safe."""

    def __init__(self, root: str = DEFAULT_ROOT, *, emulate: bool | None = None) -> None:
        self.root = os.path.abspath(root)
        self.emulate = (not is_configfs(self.root)) if emulate is None else emulate

    def path(self, *parts: str | int) -> str:
        return os.path.join(self.root, *(str(p) for p in parts))

    def check_root(self) -> None:
        """``OSError`` (ENOENT or ENOTDIR, with a message naming the root) unless the
        root is a directory."""
        if os.path.isdir(self.root):
            return
        if os.path.exists(self.root):
            raise OSError(errno.ENOTDIR, "nvmet configfs root %s is not a directory" % self.root, self.root)
        raise OSError(errno.ENOENT, "nvmet configfs root %s does not exist (modprobe nvmet?)"
                      % self.root, self.root)

    def prepare(self) -> None:
        """Check the root exists; on a stand-in, create the three top-level groups."""
        self.check_root()
        if self.emulate:
            for group in ("hosts", "ports", "subsystems"):
                os.makedirs(self.path(group), exist_ok=True)

    def mkdir(self, path: str, kind: Kind) -> None:
        os.mkdir(path)
        if self.emulate:
            self._populate(path, kind)

    def _populate(self, path: str, kind: Kind) -> None:
        for name, value in ATTRS[kind].items():
            if name == "attr_serial":
                value = os.urandom(8).hex()
            with open(os.path.join(path, name), "w") as f:
                f.write(value + "\n")
        for group in GROUPS.get(kind, ()):
            os.mkdir(os.path.join(path, group))
        if kind is Kind.PORT:
            self.mkdir(os.path.join(path, "ana_groups", DEFAULT_ANA_GROUP), Kind.ANA_GROUP)

    def rmdir(self, path: str, kind: Kind) -> None:
        if self.emulate:
            self._depopulate(path, kind)
        os.rmdir(path)

    def _depopulate(self, path: str, kind: Kind) -> None:
        if not os.path.isdir(path) or os.path.islink(path):
            return  # let os.rmdir report it
        groups = [os.path.join(path, g) for g in GROUPS.get(kind, ()) if os.path.isdir(os.path.join(path, g))]
        for g in groups:
            left = [n for n in os.listdir(g) if not (g.endswith("ana_groups") and n == DEFAULT_ANA_GROUP)]
            if left:
                raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), g)
        for g in groups:
            if g.endswith("ana_groups") and os.path.isdir(os.path.join(g, DEFAULT_ANA_GROUP)):
                self.rmdir(os.path.join(g, DEFAULT_ANA_GROUP), Kind.ANA_GROUP)
            os.rmdir(g)
        for name in os.listdir(path):
            p = os.path.join(path, name)
            if os.path.isfile(p) and not os.path.islink(p):
                os.unlink(p)

    def write(self, path: str, value: str) -> None:
        """One ``write()`` of ``value`` to an existing attribute (never creates it)."""
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, value.encode("utf-8"))
        finally:
            os.close(fd)

    def read(self, path: str) -> str:
        """An attribute's value stripped of surrounding whitespace, as nvmetcli's
        ``get_attr`` reads it (the kernel pads ``attr_serial`` to 20 characters)."""
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()

    def writable(self, path: str) -> bool:
        return bool(os.stat(path).st_mode & stat.S_IWUSR)

    def symlink(self, target: str, link: str) -> None:
        os.symlink(target, link)

    def unlink(self, link: str) -> None:
        if not os.path.islink(link):
            raise OSError(errno.EPERM if os.path.exists(link) else errno.ENOENT,
                          "not a link: %s" % link, link)
        os.unlink(link)

    def list(self, *parts: str | int) -> list[str]:
        """Entry names of a group, sorted (numerically where all are numbers)."""
        try:
            names = os.listdir(self.path(*parts))
        except FileNotFoundError:
            return []
        return sorted(names, key=lambda n: (0, int(n), "") if n.isdigit() else (1, 0, n))


def _group(tree: Tree, path: str, prefix: str) -> dict[str, str]:
    """A JSON attribute group: the writable ``<prefix>_*`` files of an object."""
    out = {}
    for name in tree.list(path):
        p = os.path.join(path, name)
        if name.startswith(prefix + "_") and os.path.isfile(p) and tree.writable(p):
            out[name[len(prefix) + 1:]] = tree.read(p)
    return out


def _int(tree: Tree, path: str) -> int | None:
    try:
        return int(tree.read(path).strip())
    except (OSError, ValueError):
        return None


def _address(tree: Tree, path: str) -> Address:
    m = _group(tree, path, "addr")
    return Address(m.pop("trtype", ""), m.pop("adrfam", ""), m.pop("traddr", ""), m.pop("trsvcid", ""),
                   m.pop("treq", ""), m)


def read_tree(root: str = DEFAULT_ROOT) -> NvmetConfig:
    """What is configured under ``root`` now, in ``nvmetcli save``'s shape (plus
    ``buffered_io`` and, where a key is set, the host's ``dhchap_*``). Entries are
    sorted. Reads secrets: treat the result as sensitive. :class:`ApplyError` if
    ``root`` is missing or not a directory."""
    t = Tree(root)
    try:
        t.check_root()
    except OSError as e:
        raise ApplyError("cannot read", [ApplyFailure(t.root, None, e.strerror or str(e))]) from None
    hosts = []
    for nqn in t.list("hosts"):
        p = t.path("hosts", nqn)
        vals = {k: t.read(os.path.join(p, k)) for k in ATTRS[Kind.HOST] if os.path.isfile(os.path.join(p, k))}
        keyed = bool(vals.get("dhchap_key"))
        hosts.append(Host(nqn, vals.get("dhchap_key") or None, vals.get("dhchap_ctrl_key") or None,
                          vals.get("dhchap_hash") if keyed else None, vals.get("dhchap_dhgroup") if keyed else None))
    subs = []
    for nqn in t.list("subsystems"):
        p = t.path("subsystems", nqn)
        nss = []
        for nsid in t.list(p, "namespaces"):
            q = os.path.join(p, "namespaces", nsid)
            m = _group(t, q, "device")
            dev = Device(m.pop("path", ""), m.pop("nguid", None), m.pop("uuid", None), m)
            nss.append(Namespace(int(nsid), dev, _int(t, os.path.join(q, "enable")),
                                 _int(t, os.path.join(q, "buffered_io")), _int(t, os.path.join(q, "ana_grpid"))))
        subs.append(Subsystem(nqn, _group(t, p, "attr"), tuple(t.list(p, "allowed_hosts")), tuple(nss)))
    ports = []
    for portid in t.list("ports"):
        p = t.path("ports", portid)
        anas = tuple(AnaGroup(int(g), _group(t, os.path.join(p, "ana_groups", g), "ana"))
                     for g in t.list(p, "ana_groups"))
        refs = tuple(Referral(r, _address(t, os.path.join(p, "referrals", r)),
                              _int(t, os.path.join(p, "referrals", r, "enable"))) for r in t.list(p, "referrals"))
        ports.append(Port(int(portid), _address(t, p), _group(t, p, "param"), tuple(t.list(p, "subsystems")),
                          refs, anas))
    return NvmetConfig(tuple(hosts), tuple(subs), tuple(ports))
