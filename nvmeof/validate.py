"""Meaning checks for :class:`nvmeof.model.NvmetConfig` (called by ``validate()``).

Holds the NQN syntax rules (NVMe base spec 4.5: ``nqn.yyyy-mm.<reverse domain>[:<name>]``
or ``nqn.2014-08.org.nvmexpress:uuid:<uuid>``, at most 223 bytes), the address rules
per transport, the id ranges the kernel and nvmetcli accept and the cross-references
between objects. Every check raises :class:`ConfigError` naming the object and what
was expected; secrets are never echoed.
"""

from __future__ import annotations

import ipaddress
import re
import uuid as uuidlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from nvmeof.auth import parse_dhgroup, parse_hash, parse_secret
from nvmeof.errors import ConfigError

if TYPE_CHECKING:
    from nvmeof.model import Address, Host, NqnRule, NvmetConfig, Port, Subsystem

NQN_MAX_BYTES = 223
DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
UUID_NQN_PREFIX = "nqn.2014-08.org.nvmexpress:uuid:"
MAX_NSID = 8192          # nvmetcli's Namespace.MAX_NSID (the kernel allows more)
MAX_PORTID = 0xFFFF      # the kernel parses port dirs with kstrtou16
MAX_ANA_GRPID = 128      # NVMET_MAX_ANAGRPS
MAX_CNTLID = 0xFFEF      # NVME_CNTLID_MAX
TRTYPES = ("rdma", "tcp", "loop", "fc")
TREQS = ("", "not specified", "required", "not required")
ANA_STATES = ("optimized", "non-optimized", "inaccessible", "persistent-loss", "change")
_SPEC_NQN = re.compile(r"nqn\.(\d{4})-(\d{2})\.([A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)+)(:.+)?", re.DOTALL)
_FC_ADDR = re.compile(r"nn-0x[0-9A-Fa-f]{16}:pn-0x[0-9A-Fa-f]{16}")
_VERSION = re.compile(r"\d+\.\d+(\.\d+)?")
# What the kernel's parsers take: nvmet's device_nguid store reads 16 hex pairs, each
# optionally followed by '-' or ':'; device_uuid goes through uuid_parse (8-4-4-4-12).
_NGUID = re.compile(r"(?:[0-9A-Fa-f]{2}[-:]?){16}")
_UUID = re.compile(r"[0-9A-Fa-f]{8}(?:-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}")
# kstrtobool (attr_allow_any_host) looks at the first characters only; these are the
# spellings it reads that a person would write.
_KERNEL_BOOLS = {"1": True, "y": True, "yes": True, "on": True, "0": False, "n": False, "no": False, "off": False}


def _fail(msg: str, *args: object) -> ConfigError:
    return ConfigError(msg % args)


def check_nqn(nqn: str, rule: NqnRule, what: str) -> None:
    """Raise :class:`ConfigError` unless ``nqn`` is acceptable under ``rule``."""
    from nvmeof.model import NqnRule

    if not nqn:
        raise _fail("%s: NQN is empty", what)
    if len(nqn.encode("utf-8")) > NQN_MAX_BYTES:
        raise _fail("%s: NQN is %d bytes, at most %d allowed", what, len(nqn.encode("utf-8")), NQN_MAX_BYTES)
    if "/" in nqn or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in nqn):
        raise _fail("%s: NQN %r contains '/', whitespace or control characters", what, nqn)
    if rule is NqnRule.PERMISSIVE and not nqn.startswith("nqn."):
        return
    if nqn.startswith(UUID_NQN_PREFIX):
        try:
            uuidlib.UUID(nqn[len(UUID_NQN_PREFIX):])
        except ValueError:
            raise _fail("%s: NQN %r: expected %s<uuid> with a valid UUID", what, nqn, UUID_NQN_PREFIX) from None
        if len(nqn) != len(UUID_NQN_PREFIX) + 36:
            raise _fail("%s: NQN %r: the UUID must be in 8-4-4-4-12 form", what, nqn)
        return
    m = _SPEC_NQN.fullmatch(nqn)
    if m is None or not 1 <= int(m.group(2)) <= 12:
        raise _fail("%s: NQN %r: expected 'nqn.yyyy-mm.<reverse domain>[:<name>]' (e.g. "
                    "'nqn.2026-12.io.example:target') or '%s<uuid>'", what, nqn, UUID_NQN_PREFIX)


def _unique(items: Iterable[object], what: str) -> None:
    seen: set[object] = set()
    for x in items:
        if x in seen:
            raise _fail("%s: %r appears more than once", what, x)
        seen.add(x)


def kernel_bool(value: str) -> bool | None:
    """An ``attr_allow_any_host``-style value as the kernel's kstrtobool reads it
    (``1``/``y``/``yes``/``on``, ``0``/``n``/``no``/``off``, any case); None otherwise."""
    return _KERNEL_BOOLS.get(value.strip().lower())


def _check_01(value: object, what: str) -> None:
    if value is not None and value not in (0, 1, "0", "1"):
        raise _fail("%s: expected 0 or 1, got %r", what, value)


def _check_host(h: Host, rule: NqnRule) -> None:
    what = "host %r" % h.nqn
    check_nqn(h.nqn, rule, what)
    if h.dhchap_key is not None:
        parse_secret(h.dhchap_key, what="%s dhchap_key" % what)
    if h.dhchap_ctrl_key is not None:
        if h.dhchap_key is None:
            raise _fail("%s: dhchap_ctrl_key (bidirectional auth) needs dhchap_key as well", what)
        parse_secret(h.dhchap_ctrl_key, what="%s dhchap_ctrl_key" % what)
    if h.dhchap_hash is not None:
        parse_hash(h.dhchap_hash, what="%s dhchap_hash" % what)
    if h.dhchap_dhgroup is not None:
        parse_dhgroup(h.dhchap_dhgroup, what="%s dhchap_dhgroup" % what)


def _check_int_attr(attrs: dict[str, str], key: str, lo: int, hi: int, what: str) -> int | None:
    if key not in attrs:
        return None
    try:
        v = int(attrs[key].strip())
    except ValueError:
        raise _fail("%s: attr %s: expected an integer, got %r", what, key, attrs[key]) from None
    if not lo <= v <= hi:
        raise _fail("%s: attr %s = %d, expected %d..%d", what, key, v, lo, hi)
    return v


def _check_subsystem(s: Subsystem, hosts: set[str], rule: NqnRule) -> None:
    what = "subsystem %r" % s.nqn
    check_nqn(s.nqn, rule, what)
    if s.nqn == DISCOVERY_NQN:
        raise _fail("%s: the discovery NQN cannot be a subsystem", what)
    attrs = dict(s.attr)
    if kernel_bool(attrs.get("allow_any_host", "0")) is None:
        raise _fail("%s: attr allow_any_host: expected 0 or 1 (or y/n, yes/no, on/off), got %r",
                    what, attrs["allow_any_host"])
    _check_01(attrs.get("pi_enable"), "%s attr pi_enable" % what)
    if s.allow_any_host and s.allowed_hosts:
        raise _fail("%s: allow_any_host=1 together with allowed_hosts %s; the kernel refuses both, "
                    "choose one", what, list(s.allowed_hosts))
    lo = _check_int_attr(attrs, "cntlid_min", 1, MAX_CNTLID, what)
    hi = _check_int_attr(attrs, "cntlid_max", 1, MAX_CNTLID, what)
    # The kernel refuses a cntlid_min >= cntlid_max; an unset one keeps its default.
    lo_v, hi_v = (1 if lo is None else lo), (MAX_CNTLID if hi is None else hi)
    if lo_v >= hi_v:
        raise _fail("%s: cntlid_min %d must be below cntlid_max %d (unset: the kernel's 1 and %d)",
                    what, lo_v, hi_v, MAX_CNTLID)
    serial = attrs.get("serial")
    if serial is not None and (not serial or len(serial) > 20 or not serial.isascii() or not serial.isprintable()):
        raise _fail("%s: attr serial %r: expected 1..20 printable ASCII characters", what, serial)
    model = attrs.get("model")
    if model is not None and (not model or len(model) > 40 or not model.isascii() or not model.isprintable()):
        raise _fail("%s: attr model %r: expected 1..40 printable ASCII characters", what, model)
    version = attrs.get("version")
    if version is not None and not _VERSION.fullmatch(version.strip()):
        raise _fail("%s: attr version %r: expected 'major.minor[.tertiary]' like '1.3'", what, version)
    _unique(s.allowed_hosts, "%s allowed_hosts" % what)
    for h in s.allowed_hosts:
        if h not in hosts:
            raise _fail("%s: allowed host %r is not in hosts", what, h)
    _unique((n.nsid for n in s.namespaces), "%s namespace nsid" % what)
    for n in s.namespaces:
        nw = "%s namespace %d" % (what, n.nsid)
        if not 1 <= n.nsid <= MAX_NSID:
            raise _fail("%s: nsid must be 1..%d", nw, MAX_NSID)
        _check_01(n.enable, "%s enable" % nw)
        _check_01(n.buffered_io, "%s buffered_io" % nw)
        if n.ana_grpid is not None and not 1 <= n.ana_grpid <= MAX_ANA_GRPID:
            raise _fail("%s: ana_grpid %d, expected 1..%d", nw, n.ana_grpid, MAX_ANA_GRPID)
        path = n.device.path
        if n.enable == 1 and not path:
            raise _fail("%s: enabled without a device path", nw)
        if path and not path.startswith("/"):
            raise _fail("%s: device path %r must be absolute", nw, path)
        if n.device.nguid is not None and not _NGUID.fullmatch(n.device.nguid.strip()):
            raise _fail("%s: device nguid %r: expected 32 hex digits, pairs optionally separated by "
                        "'-' or ':', like 'ef90689c-6c46-d44c-89c1-4067801309a8'", nw, n.device.nguid)
        if n.device.uuid is not None and not _UUID.fullmatch(n.device.uuid.strip()):
            raise _fail("%s: device uuid %r: expected 8-4-4-4-12 hex like "
                        "'ef90689c-6c46-d44c-89c1-4067801309a8'", nw, n.device.uuid)


def check_address(a: Address, what: str) -> None:
    """Raise unless the ``addr`` group fits its transport (rdma/tcp: ipv4/ipv6 address
    and a TCP port number; loop: nothing; fc: ``nn-0x..:pn-0x..``)."""
    if a.trtype not in TRTYPES:
        raise _fail("%s: addr trtype %r, expected one of %s", what, a.trtype, ", ".join(TRTYPES))
    if (a.treq or "") not in TREQS:
        raise _fail("%s: addr treq %r, expected one of %s", what, a.treq, ", ".join(repr(t) for t in TREQS[1:]))
    if a.trtype in ("rdma", "tcp"):
        if a.adrfam not in ("ipv4", "ipv6"):
            raise _fail("%s: %s needs addr adrfam ipv4 or ipv6, got %r", what, a.trtype, a.adrfam)
        try:
            ip = ipaddress.ip_address(a.traddr or "")
        except ValueError:
            raise _fail("%s: %s needs an IP address in traddr, got %r", what, a.trtype, a.traddr) from None
        if ip.version != (4 if a.adrfam == "ipv4" else 6):
            raise _fail("%s: traddr %r is not an %s address", what, a.traddr, a.adrfam)
        svc = a.trsvcid or ""
        if not (svc.isascii() and svc.isdigit() and 1 <= int(svc) <= 65535):
            raise _fail("%s: %s needs a TCP port 1..65535 in trsvcid, got %r", what, a.trtype, a.trsvcid)
    elif a.trtype == "loop":
        for k in ("adrfam", "traddr", "trsvcid"):
            if getattr(a, k):
                raise _fail("%s: loop ports take no address, but %s is %r", what, k, getattr(a, k))
    else:
        if a.adrfam != "fc":
            raise _fail("%s: fc needs addr adrfam 'fc', got %r", what, a.adrfam)
        if not _FC_ADDR.fullmatch(a.traddr or ""):
            raise _fail("%s: fc needs traddr 'nn-0x<16 hex>:pn-0x<16 hex>', got %r", what, a.traddr)
        if (a.trsvcid or "none") != "none":
            raise _fail("%s: fc takes trsvcid 'none', got %r", what, a.trsvcid)


def _check_port(p: Port, subsystems: set[str]) -> None:
    what = "port %d" % p.portid
    if not 0 <= p.portid <= MAX_PORTID:
        raise _fail("%s: portid must be 0..%d", what, MAX_PORTID)
    check_address(p.addr, what)
    if "inline_data_size" in p.param:
        _check_int_attr(dict(p.param), "inline_data_size", -1, 1 << 30, what)
    _check_01(p.param.get("pi_enable"), "%s param pi_enable" % what)
    _unique(p.subsystems, "%s subsystems" % what)
    for nqn in p.subsystems:
        if nqn not in subsystems:
            raise _fail("%s: links subsystem %r, which is not in subsystems", what, nqn)
    _unique((r.name for r in p.referrals), "%s referral name" % what)
    for r in p.referrals:
        if not r.name or "/" in r.name or r.name in (".", ".."):
            raise _fail("%s: referral name %r is not a usable directory name", what, r.name)
        check_address(r.addr, "%s referral %r" % (what, r.name))
        _check_01(r.enable, "%s referral %r enable" % (what, r.name))
    _unique((a.grpid for a in p.ana_groups), "%s ana group grpid" % what)
    for a in p.ana_groups:
        if not 1 <= a.grpid <= MAX_ANA_GRPID:
            raise _fail("%s: ana group %d, expected grpid 1..%d", what, a.grpid, MAX_ANA_GRPID)
        state = a.ana.get("state")
        if state is not None and state not in ANA_STATES:
            raise _fail("%s ana group %d: state %r, expected one of %s", what, a.grpid, state, ", ".join(ANA_STATES))


def check_config(cfg: NvmetConfig, rule: NqnRule) -> None:
    """All checks, in file order: hosts, subsystems, ports."""
    _unique((h.nqn for h in cfg.hosts), "hosts nqn")
    _unique((s.nqn for s in cfg.subsystems), "subsystems nqn")
    _unique((p.portid for p in cfg.ports), "ports portid")
    for h in cfg.hosts:
        _check_host(h, rule)
    hosts = {h.nqn for h in cfg.hosts}
    for s in cfg.subsystems:
        _check_subsystem(s, hosts, rule)
    subsystems = {s.nqn for s in cfg.subsystems}
    for p in cfg.ports:
        _check_port(p, subsystems)
    _unique(((p.addr.trtype, p.addr.adrfam, p.addr.traddr, p.addr.trsvcid) for p in cfg.ports
             if p.addr.trtype != "loop"), "ports listening address")
