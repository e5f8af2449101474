"""A typed model of nvmetcli's save/restore JSON (``/etc/nvmet/config.json``).

The JSON mirrors the nvmet configfs tree: ``hosts``, ``subsystems`` (``attr``,
``allowed_hosts``, ``namespaces``) and ``ports`` (``addr``, ``param``, ``subsystems``,
``referrals``, ``ana_groups``). Attribute groups are string maps keyed by the configfs
file name after its group prefix (``attr_serial`` is ``attr["serial"]``). Two things
nvmetcli has no JSON for are kept flat, named after their configfs files: a
namespace's ``buffered_io`` (an int, like ``ana_grpid``) and a host's ``dhchap_key``,
``dhchap_ctrl_key``, ``dhchap_hash`` and ``dhchap_dhgroup``.

Contract: :meth:`NvmetConfig.from_dict` only checks shapes and types (raising
:class:`ConfigError` with a JSON path); :meth:`NvmetConfig.validate` checks meaning.
``to_dict(from_dict(d)) == d`` for every ``d`` from_dict accepts: unknown keys are
kept per object (``extra``) and written back, and optional collections that were
absent stay absent. Objects built in code serialize in ``nvmetcli save``'s full shape.
Used by ``nvmeof.spec``, ``nvmeof.configfs`` and the CLI.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeAlias

from nvmeof.errors import ConfigError

JsonValue: TypeAlias = "None | bool | int | float | str | list[JsonValue] | dict[str, JsonValue]"
JsonObject: TypeAlias = "dict[str, JsonValue]"


class NqnRule(Enum):
    """How strictly :meth:`NvmetConfig.validate` checks NQNs.

    ``SPEC``: every NQN must follow the NVMe base spec. ``PERMISSIVE``: also accept
    bare local names the kernel takes (nvmetcli's own examples use ``testnqn``), but
    anything starting with ``nqn.`` must still be well-formed. Generated configs use SPEC.
    """

    SPEC = "spec"
    PERMISSIVE = "permissive"


class _Obj:
    """Reads one JSON object, remembering which keys were consumed."""

    def __init__(self, value: object, where: str) -> None:
        if not isinstance(value, dict):
            raise ConfigError("%s: expected a JSON object, got %s" % (where, _tname(value)))
        self.d: dict[str, object] = value
        self.where = where
        self.seen: set[str] = set()

    def _get(self, key: str, required: bool) -> object:
        self.seen.add(key)
        if key not in self.d and required:
            raise ConfigError("%s: missing required key %r" % (self.where, key))
        return self.d.get(key)

    def int_(self, key: str, required: bool = False) -> int | None:
        v = self._get(key, required)
        if v is None and key not in self.d:
            return None
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError("%s.%s: expected an integer, got %s" % (self.where, key, _tname(v)))
        return v

    def str_(self, key: str, required: bool = False) -> str | None:
        v = self._get(key, required)
        if v is None and key not in self.d:
            return None
        if not isinstance(v, str):
            raise ConfigError("%s.%s: expected a string, got %s" % (self.where, key, _tname(v)))
        return v

    def strmap(self, key: str) -> dict[str, str]:
        v = self._get(key, False)
        if key not in self.d:
            return {}
        o = _Obj(v, "%s.%s" % (self.where, key))
        for k, x in o.d.items():
            if not isinstance(x, str):
                raise ConfigError("%s.%s.%s: expected a string attribute value, got %s"
                                  % (self.where, key, k, _tname(x)))
        return dict(o.d)  # type: ignore[arg-type]

    def list_(self, key: str) -> list[object]:
        v = self._get(key, False)
        if key not in self.d:
            return []
        if not isinstance(v, list):
            raise ConfigError("%s.%s: expected a JSON list, got %s" % (self.where, key, _tname(v)))
        return v

    def strlist(self, key: str) -> tuple[str, ...]:
        items = self.list_(key)
        for i, x in enumerate(items):
            if not isinstance(x, str):
                raise ConfigError("%s.%s[%d]: expected a string, got %s" % (self.where, key, i, _tname(x)))
        return tuple(items)  # type: ignore[arg-type]

    def absent(self, *keys: str) -> frozenset[str]:
        return frozenset(k for k in keys if k not in self.d)

    def extra(self) -> dict[str, JsonValue]:
        return {k: v for k, v in self.d.items() if k not in self.seen}  # type: ignore[misc]


def _tname(v: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def _emit(out: JsonObject, key: str, value: JsonValue, absent: frozenset[str]) -> None:
    """Writes an optional collection unless it is empty and was absent in the source."""
    if value or key not in absent:
        out[key] = value


def _copy(extra: Mapping[str, JsonValue]) -> JsonObject:
    out: JsonObject = json.loads(json.dumps(extra))
    return out


def _put(out: JsonObject, key: str, value: JsonValue) -> None:
    if value is not None:
        out[key] = value


@dataclass(frozen=True)
class Host:
    """``hosts/<nqn>``: a host NQN and its DH-HMAC-CHAP settings (secrets hidden from repr)."""

    nqn: str
    dhchap_key: str | None = field(default=None, repr=False)
    dhchap_ctrl_key: str | None = field(default=None, repr=False)
    dhchap_hash: str | None = None
    dhchap_dhgroup: str | None = None
    extra: Mapping[str, JsonValue] = field(default_factory=dict)

    @staticmethod
    def from_dict(value: object, where: str) -> Host:
        o = _Obj(value, where)
        return Host(o.str_("nqn", True) or "", o.str_("dhchap_key"), o.str_("dhchap_ctrl_key"),
                    o.str_("dhchap_hash"), o.str_("dhchap_dhgroup"), o.extra())

    def to_dict(self) -> JsonObject:
        out = _copy(self.extra)
        out["nqn"] = self.nqn
        for k in ("dhchap_key", "dhchap_ctrl_key", "dhchap_hash", "dhchap_dhgroup"):
            _put(out, k, getattr(self, k))
        return out


@dataclass(frozen=True)
class Device:
    """A namespace's ``device`` group: ``device_path``, ``device_nguid``, ``device_uuid``
    (``None``: not in the JSON); other ``device_*`` attributes in ``extra``."""

    path: str | None = None
    nguid: str | None = None
    uuid: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict)

    @staticmethod
    def from_dict(o: _Obj) -> Device:
        m = o.strmap("device")
        return Device(m.pop("path", None), m.pop("nguid", None), m.pop("uuid", None), m)

    def to_dict(self) -> JsonObject:
        out = _copy(self.extra)
        for k in ("path", "nguid", "uuid"):
            _put(out, k, getattr(self, k))
        return out


@dataclass(frozen=True)
class Namespace:
    """``subsystems/<nqn>/namespaces/<nsid>``. ``enable``, ``buffered_io`` and
    ``ana_grpid`` are ints as nvmetcli writes them (``None``: not in the JSON)."""

    nsid: int
    device: Device = field(default_factory=Device)
    enable: int | None = None
    buffered_io: int | None = None
    ana_grpid: int | None = None
    extra: Mapping[str, JsonValue] = field(default_factory=dict)
    absent: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @staticmethod
    def from_dict(value: object, where: str) -> Namespace:
        o = _Obj(value, where)
        nsid = o.int_("nsid", True)
        assert nsid is not None
        return Namespace(nsid, Device.from_dict(o), o.int_("enable"), o.int_("buffered_io"),
                         o.int_("ana_grpid"), o.extra(), o.absent("device"))

    def to_dict(self) -> JsonObject:
        out = _copy(self.extra)
        out["nsid"] = self.nsid
        _emit(out, "device", self.device.to_dict(), self.absent)
        for k in ("enable", "buffered_io", "ana_grpid"):
            _put(out, k, getattr(self, k))
        return out


@dataclass(frozen=True)
class Subsystem:
    """``subsystems/<nqn>``: ``attr`` (attr_* files), allowed hosts and namespaces."""

    nqn: str
    attr: Mapping[str, str] = field(default_factory=dict)
    allowed_hosts: tuple[str, ...] = ()
    namespaces: tuple[Namespace, ...] = ()
    extra: Mapping[str, JsonValue] = field(default_factory=dict)
    absent: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @property
    def allow_any_host(self) -> bool:
        """Whether ``attr_allow_any_host`` is true as the kernel reads it (``"1"``, ``"y"``...; default 0)."""
        from nvmeof.validate import kernel_bool
        return kernel_bool(self.attr.get("allow_any_host", "0")) is True

    @staticmethod
    def from_dict(value: object, where: str) -> Subsystem:
        o = _Obj(value, where)
        nqn = o.str_("nqn", True) or ""
        nss = tuple(Namespace.from_dict(n, "%s.namespaces[%d]" % (where, i))
                    for i, n in enumerate(o.list_("namespaces")))
        return Subsystem(nqn, o.strmap("attr"), o.strlist("allowed_hosts"), nss, o.extra(),
                         o.absent("attr", "allowed_hosts", "namespaces"))

    def to_dict(self) -> JsonObject:
        out = _copy(self.extra)
        out["nqn"] = self.nqn
        _emit(out, "attr", dict(self.attr), self.absent)
        _emit(out, "allowed_hosts", list(self.allowed_hosts), self.absent)
        _emit(out, "namespaces", [n.to_dict() for n in self.namespaces], self.absent)
        return out


@dataclass(frozen=True)
class Address:
    """An ``addr`` group (``addr_trtype`` ... files) of a port or referral. ``None``:
    not in the JSON; other ``addr_*`` attributes (e.g. ``tsas``) in ``extra``."""

    trtype: str | None = None
    adrfam: str | None = None
    traddr: str | None = None
    trsvcid: str | None = None
    treq: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict)

    FIELDS = ("trtype", "adrfam", "traddr", "trsvcid", "treq")

    @staticmethod
    def from_dict(o: _Obj) -> Address:
        m = o.strmap("addr")
        return Address(m.pop("trtype", None), m.pop("adrfam", None), m.pop("traddr", None),
                       m.pop("trsvcid", None), m.pop("treq", None), m)

    def items(self) -> list[tuple[str, str]]:
        """The set attributes, in the order apply writes them (trtype first)."""
        known = [(k, getattr(self, k)) for k in self.FIELDS if getattr(self, k) is not None]
        return known + sorted(self.extra.items())

    def to_dict(self) -> JsonObject:
        return dict(self.items())


@dataclass(frozen=True)
class Referral:
    """``ports/<id>/referrals/<name>``: a discovery referral to another port."""

    name: str
    addr: Address = field(default_factory=Address)
    enable: int | None = None
    extra: Mapping[str, JsonValue] = field(default_factory=dict)
    absent: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @staticmethod
    def from_dict(value: object, where: str) -> Referral:
        o = _Obj(value, where)
        return Referral(o.str_("name", True) or "", Address.from_dict(o), o.int_("enable"), o.extra(),
                        o.absent("addr"))

    def to_dict(self) -> JsonObject:
        out = _copy(self.extra)
        out["name"] = self.name
        _emit(out, "addr", self.addr.to_dict(), self.absent)
        _put(out, "enable", self.enable)
        return out


@dataclass(frozen=True)
class AnaGroup:
    """``ports/<id>/ana_groups/<grpid>``; ``ana["state"]`` is its ANA state. Group 1
    always exists on a real port."""

    grpid: int
    ana: Mapping[str, str] = field(default_factory=dict)
    extra: Mapping[str, JsonValue] = field(default_factory=dict)
    absent: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @staticmethod
    def from_dict(value: object, where: str) -> AnaGroup:
        o = _Obj(value, where)
        grpid = o.int_("grpid", True)
        assert grpid is not None
        return AnaGroup(grpid, o.strmap("ana"), o.extra(), o.absent("ana"))

    def to_dict(self) -> JsonObject:
        out = _copy(self.extra)
        out["grpid"] = self.grpid
        _emit(out, "ana", dict(self.ana), self.absent)
        return out


@dataclass(frozen=True)
class Port:
    """``ports/<portid>``: address, ``param`` (param_* files), linked subsystem NQNs,
    referrals and ANA groups."""

    portid: int
    addr: Address = field(default_factory=Address)
    param: Mapping[str, str] = field(default_factory=dict)
    subsystems: tuple[str, ...] = ()
    referrals: tuple[Referral, ...] = ()
    ana_groups: tuple[AnaGroup, ...] = ()
    extra: Mapping[str, JsonValue] = field(default_factory=dict)
    absent: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @staticmethod
    def from_dict(value: object, where: str) -> Port:
        o = _Obj(value, where)
        portid = o.int_("portid", True)
        assert portid is not None
        refs = tuple(Referral.from_dict(r, "%s.referrals[%d]" % (where, i))
                     for i, r in enumerate(o.list_("referrals")))
        anas = tuple(AnaGroup.from_dict(a, "%s.ana_groups[%d]" % (where, i))
                     for i, a in enumerate(o.list_("ana_groups")))
        return Port(portid, Address.from_dict(o), o.strmap("param"), o.strlist("subsystems"), refs, anas,
                    o.extra(), o.absent("addr", "param", "subsystems", "referrals", "ana_groups"))

    def to_dict(self) -> JsonObject:
        out = _copy(self.extra)
        out["portid"] = self.portid
        _emit(out, "addr", self.addr.to_dict(), self.absent)
        _emit(out, "param", dict(self.param), self.absent)
        _emit(out, "subsystems", list(self.subsystems), self.absent)
        _emit(out, "referrals", [r.to_dict() for r in self.referrals], self.absent)
        _emit(out, "ana_groups", [a.to_dict() for a in self.ana_groups], self.absent)
        return out


@dataclass(frozen=True)
class NvmetConfig:
    """A whole nvmet target configuration, as in an nvmetcli save file."""

    hosts: tuple[Host, ...] = ()
    subsystems: tuple[Subsystem, ...] = ()
    ports: tuple[Port, ...] = ()
    extra: Mapping[str, JsonValue] = field(default_factory=dict)
    absent: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @staticmethod
    def from_dict(value: object) -> NvmetConfig:
        """Build from parsed JSON; :class:`ConfigError` (with a JSON path) on a wrong
        shape or type. Does not check meaning: call :meth:`validate`."""
        o = _Obj(value, "config")
        hosts = tuple(Host.from_dict(h, "hosts[%d]" % i) for i, h in enumerate(o.list_("hosts")))
        subs = tuple(Subsystem.from_dict(s, "subsystems[%d]" % i) for i, s in enumerate(o.list_("subsystems")))
        ports = tuple(Port.from_dict(p, "ports[%d]" % i) for i, p in enumerate(o.list_("ports")))
        return NvmetConfig(hosts, subs, ports, o.extra(), o.absent("hosts", "subsystems", "ports"))

    def to_dict(self) -> JsonObject:
        """The nvmetcli JSON value (fresh containers, safe to mutate)."""
        out = _copy(self.extra)
        _emit(out, "hosts", [h.to_dict() for h in self.hosts], self.absent)
        _emit(out, "ports", [p.to_dict() for p in self.ports], self.absent)
        _emit(out, "subsystems", [s.to_dict() for s in self.subsystems], self.absent)
        return out

    def to_json(self) -> str:
        """Text as ``nvmetcli save`` writes it: sorted keys, two-space indent, newline."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2) + "\n"

    @staticmethod
    def loads(text: str | bytes, *, source: str = "<string>") -> NvmetConfig:
        """Parse JSON text; malformed JSON is a :class:`ConfigError` naming ``source``."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ConfigError("%s: not valid JSON: %s" % (source, e)) from None
        return NvmetConfig.from_dict(value)

    @staticmethod
    def load(path: str | os.PathLike[str]) -> NvmetConfig:
        """Read an nvmetcli JSON file (shape-checked, not validated)."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ConfigError("cannot read nvmet config %s: %s" % (path, e.strerror)) from None
        return NvmetConfig.loads(data, source=str(path))

    def dump(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_json` to ``path`` durably (temp file, fsync, rename), mode
        0600 because host entries may hold DH-HMAC-CHAP secrets. A missing folder, a
        directory at ``path`` or a failed write is a :class:`ConfigError` naming
        ``path``; nothing is left behind."""
        try:
            self._dump(os.fspath(path))
        except OSError as e:
            raise ConfigError("cannot write %s: %s" % (os.fspath(path), e.strerror or e)) from None

    def _dump(self, target: str) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".nvmet-", dir=os.path.dirname(os.path.abspath(target)))
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def validate(self, nqn_rule: NqnRule = NqnRule.PERMISSIVE) -> None:
        """Check meaning: NQN syntax, addresses per transport, id ranges, uniqueness,
        references (port to subsystem, allowed host to host), allow_any_host against
        the allow-list, DH-HMAC-CHAP settings. Raises :class:`ConfigError` on the first
        problem, naming the object; returns ``None`` when the config is valid."""
        from nvmeof.validate import check_config

        check_config(self, nqn_rule)

    def host(self, nqn: str) -> Host | None:
        return next((h for h in self.hosts if h.nqn == nqn), None)

    def subsystem(self, nqn: str) -> Subsystem | None:
        return next((s for s in self.subsystems if s.nqn == nqn), None)
