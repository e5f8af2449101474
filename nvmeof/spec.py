"""Short TOML target specs (``configs/nvmeof/*.toml``) and their expansion into a full
:class:`NvmetConfig`.

A spec names one subsystem, its namespaces (a block device or a file), its ports
(rdma, tcp, loop) and the hosts allowed to connect. Generated configs deny unknown
hosts: ``attr_allow_any_host`` is 0 and every ``[[host]]`` is on the allow-list;
``allow_any_host = true`` must be written out, admits no ``[[host]]`` list, and warns
(:class:`InsecureTargetWarning`). Keys follow the layout documented in
``docs/nvmeof.md``; an unknown key is a :class:`ConfigError`. Used by the CLI
(``generate``) and the test rig.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import tomllib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

from nvmeof.auth import KeyTransform, generate_secret
from nvmeof.errors import ConfigError
from nvmeof.model import Address, Device, Host, Namespace, NqnRule, NvmetConfig, Port, Subsystem

log = logging.getLogger(__name__)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


class InsecureTargetWarning(UserWarning):
    """A generated target admits any host that can reach its ports."""


class Transport(Enum):
    RDMA = "rdma"
    TCP = "tcp"
    LOOP = "loop"


@dataclass(frozen=True)
class SubsystemSpec:
    nqn: str
    serial: str | None = None
    model: str | None = None
    allow_any_host: bool = False


@dataclass(frozen=True)
class NamespaceSpec:
    """``path`` is a block device (``is_file`` False) or a regular file. ``size_bytes``
    is for whoever creates the file (the rig); generation does not touch it."""

    nsid: int
    path: str
    is_file: bool
    buffered_io: bool = False
    size_bytes: int | None = None
    uuid: str | None = None
    nguid: str | None = None


@dataclass(frozen=True)
class PortSpec:
    portid: int
    transport: Transport
    address: str | None = None
    trsvcid: int | None = None
    inline_data_size: int | None = None


@dataclass(frozen=True)
class HostSpec:
    """An allowed host; secrets hidden from repr."""

    nqn: str
    dhchap_key: str | None = None
    dhchap_ctrl_key: str | None = None
    dhchap_hash: str | None = None
    dhchap_dhgroup: str | None = None
    generate_keys: bool = False

    def __repr__(self) -> str:
        return "HostSpec(nqn=%r, keys=%s)" % (self.nqn, "generate" if self.generate_keys else
                                              "given" if self.dhchap_key else "none")


@dataclass(frozen=True)
class TargetSpec:
    subsystem: SubsystemSpec
    namespaces: tuple[NamespaceSpec, ...]
    ports: tuple[PortSpec, ...]
    hosts: tuple[HostSpec, ...] = ()


def parse_size(value: object, what: str) -> int:
    """``4096``, ``"64GiB"``, ``"1.5 GB"`` to bytes; :class:`ConfigError` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value if isinstance(value, str) else "")
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError("%s: expected a size like 4096 or '64GiB', got %r" % (what, value))
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class _Table:
    """One TOML table: typed getters, and a check that every key was known."""

    def __init__(self, value: object, where: str) -> None:
        if not isinstance(value, dict):
            raise ConfigError("%s: expected a table, got %s" % (where, type(value).__name__))
        self.d: Mapping[str, object] = value
        self.where = where
        self.used: set[str] = set()

    def _get(self, key: str, kinds: tuple[type, ...], required: bool) -> object:
        self.used.add(key)
        if key not in self.d:
            if required:
                raise ConfigError("%s: missing required key %r" % (self.where, key))
            return None
        v = self.d[key]
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            raise ConfigError("%s.%s: expected %s, got %r"
                              % (self.where, key, " or ".join(k.__name__ for k in kinds), v))
        return v

    def str_(self, key: str, required: bool = False) -> str | None:
        v = self._get(key, (str,), required)
        return v if isinstance(v, str) else None

    def int_(self, key: str) -> int | None:
        v = self._get(key, (int,), False)
        return v if isinstance(v, int) else None

    def bool_(self, key: str) -> bool:
        return self._get(key, (bool,), False) is True

    def raw(self, key: str, kinds: tuple[type, ...], required: bool = False) -> object:
        return self._get(key, kinds, required)

    def done(self) -> None:
        unknown = sorted(set(self.d) - self.used)
        if unknown:
            raise ConfigError("%s: unknown key(s) %s; known: %s" % (self.where, unknown, sorted(self.used)))


def _namespace(t: _Table, index: int) -> NamespaceSpec:
    file, device = t.str_("file"), t.str_("device")
    if (file is None) == (device is None):
        raise ConfigError("%s: give exactly one of 'file' or 'device'" % t.where)
    buffered = t.bool_("buffered_io")
    if buffered and device is not None:
        raise ConfigError("%s: buffered_io applies to file backing only" % t.where)
    size = t.raw("size", (int, str))
    nsid = t.int_("nsid")
    ns = NamespaceSpec(index + 1 if nsid is None else nsid, str(file or device), file is not None, buffered,
                       None if size is None else parse_size(size, t.where + ".size"), t.str_("uuid"), t.str_("nguid"))
    t.done()
    return ns


def _port(t: _Table, index: int) -> PortSpec:
    name = t.str_("transport", required=True)
    try:
        transport = Transport(name)
    except ValueError:
        raise ConfigError("%s.transport: expected one of %s, got %r"
                          % (t.where, ", ".join(x.value for x in Transport), name)) from None
    address, trsvcid = t.str_("address"), t.int_("trsvcid")
    if transport is Transport.LOOP and (address is not None or trsvcid is not None):
        raise ConfigError("%s: loop ports take no address or trsvcid" % t.where)
    if transport is not Transport.LOOP and address is None:
        raise ConfigError("%s: %s ports need 'address'" % (t.where, transport.value))
    portid = t.int_("portid")
    p = PortSpec(index + 1 if portid is None else portid, transport, address,
                 None if transport is Transport.LOOP else (4420 if trsvcid is None else trsvcid),
                 t.int_("inline_data_size"))
    t.done()
    return p


def _host(t: _Table) -> HostSpec:
    h = HostSpec(t.str_("nqn", required=True) or "", t.str_("dhchap_key"), t.str_("dhchap_ctrl_key"),
                 t.str_("dhchap_hash"), t.str_("dhchap_dhgroup"), t.bool_("generate_keys"))
    if h.generate_keys and (h.dhchap_key or h.dhchap_ctrl_key):
        raise ConfigError("%s: generate_keys = true conflicts with explicit dhchap keys" % t.where)
    t.done()
    return h


def _tables(top: _Table, key: str) -> list[_Table]:
    items = top.raw(key, (list,))
    return [_Table(v, "%s[%d]" % (key, i)) for i, v in enumerate(items if isinstance(items, list) else [])]


def spec_from_dict(data: Mapping[str, object], source: str = "spec") -> TargetSpec:
    """Build a :class:`TargetSpec` from parsed TOML; :class:`ConfigError` on a missing,
    mistyped or unknown key."""
    top = _Table(dict(data), source)
    st = _Table(top.raw("subsystem", (dict,), required=True), "subsystem")
    sub = SubsystemSpec(st.str_("nqn", required=True) or "", st.str_("serial"), st.str_("model"),
                        st.bool_("allow_any_host"))
    st.done()
    spec = TargetSpec(sub, tuple(_namespace(t, i) for i, t in enumerate(_tables(top, "namespace"))),
                      tuple(_port(t, i) for i, t in enumerate(_tables(top, "port"))),
                      tuple(_host(t) for t in _tables(top, "host")))
    top.done()
    if not spec.namespaces or not spec.ports:
        raise ConfigError("%s: needs at least one [[namespace]] and one [[port]]" % source)
    if sub.allow_any_host and spec.hosts:
        raise ConfigError("%s: allow_any_host = true admits every host; remove the [[host]] list or "
                          "set allow_any_host = false" % source)
    if not sub.allow_any_host and not spec.hosts:
        raise ConfigError("%s: no [[host]] is allowed and allow_any_host is false, so no host could "
                          "connect; add [[host]] entries (or, knowingly, allow_any_host = true)" % source)
    return spec


def load_spec(path: str | os.PathLike[str]) -> TargetSpec:
    """Read a TOML target spec. :class:`ConfigError` names the file and key on failure."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError("cannot read spec %s: %s" % (path, e.strerror)) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("%s: not valid TOML: %s" % (path, e)) from None
    return spec_from_dict(data, str(path))


def generate(spec: TargetSpec, *, random_bytes: Callable[[int], bytes] = os.urandom) -> NvmetConfig:
    """Expand ``spec`` into a validated config (NQNs checked against the spec's
    syntax). Keys for ``generate_keys`` hosts come from ``random_bytes`` (a host key
    and a controller key, 32 bytes each, transform 00). Warns with
    :class:`InsecureTargetWarning` when the subsystem allows any host."""
    hosts = []
    for h in spec.hosts:
        key, ctrl = h.dhchap_key, h.dhchap_ctrl_key
        if h.generate_keys:
            key = generate_secret(KeyTransform.NONE, random_bytes=random_bytes).encode()
            ctrl = generate_secret(KeyTransform.NONE, random_bytes=random_bytes).encode()
        hosts.append(Host(h.nqn, key, ctrl, h.dhchap_hash, h.dhchap_dhgroup))
    s = spec.subsystem
    if s.allow_any_host:
        msg = "subsystem %s allows ANY host that reaches its ports (allow_any_host = true)" % s.nqn
        log.warning("%s", msg)
        warnings.warn(msg, InsecureTargetWarning, stacklevel=2)
    attr = {"allow_any_host": "1" if s.allow_any_host else "0"}
    attr.update({k: v for k, v in (("serial", s.serial), ("model", s.model)) if v is not None})
    namespaces = tuple(Namespace(n.nsid, Device(n.path, n.nguid, n.uuid), enable=1,
                                 buffered_io=1 if n.buffered_io else (0 if n.is_file else None))
                       for n in spec.namespaces)
    sub = Subsystem(s.nqn, attr, tuple(h.nqn for h in spec.hosts), namespaces)
    ports = tuple(_make_port(p, s.nqn) for p in spec.ports)
    cfg = NvmetConfig(tuple(hosts), (sub,), ports)
    cfg.validate(NqnRule.SPEC)
    return cfg


def _make_port(p: PortSpec, nqn: str) -> Port:
    if p.transport is Transport.LOOP:
        addr = Address("loop", "", "", "", "not specified")
    else:
        try:
            ip = ipaddress.ip_address(p.address or "")
        except ValueError:
            raise ConfigError("port %d: address %r is not an IP address" % (p.portid, p.address)) from None
        addr = Address(p.transport.value, "ipv%d" % ip.version, str(ip), str(p.trsvcid), "not specified")
    param = {} if p.inline_data_size is None else {"inline_data_size": str(p.inline_data_size)}
    return Port(p.portid, addr, param, (nqn,))
