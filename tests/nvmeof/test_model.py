"""nvmetcli JSON model: the shared examples round-trip, unknown keys survive, and every
validation rule raises a ConfigError that names the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nvmeof.auth import generate_secret
from nvmeof.errors import ConfigError
from nvmeof.model import NqnRule, NvmetConfig

EXAMPLES = Path("/work/shared/data/nvmetcli")
NAMES = ["rdma", "tcp", "loop", "fc"]
GOOD_NQN = "nqn.2026-12.io.tierkv:rig"
HOST_NQN = "nqn.2026-12.io.tierkv:host-rig"


def example(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((EXAMPLES / ("%s.json" % name)).read_text())
    return data


def base() -> dict[str, Any]:
    """A valid, spec-conformant config to break one field at a time."""
    return {
        "hosts": [{"nqn": HOST_NQN}],
        "subsystems": [{"nqn": GOOD_NQN, "attr": {"allow_any_host": "0", "serial": "abc"},
                        "allowed_hosts": [HOST_NQN],
                        "namespaces": [{"nsid": 1, "enable": 1, "device": {"path": "/dev/nvme0n1"}}]}],
        "ports": [{"portid": 1, "addr": {"trtype": "tcp", "adrfam": "ipv4", "traddr": "10.0.0.1",
                                         "trsvcid": "4420", "treq": "not specified"},
                   "subsystems": [GOOD_NQN], "referrals": [], "ana_groups": []}],
    }


@pytest.mark.parametrize("name", NAMES)
def test_shared_examples_load_validate_and_round_trip(name: str, tmp_path: Path) -> None:
    cfg = NvmetConfig.load(EXAMPLES / ("%s.json" % name))
    cfg.validate()
    assert cfg.to_dict() == example(name)
    out = tmp_path / "out.json"
    cfg.dump(out)
    assert json.loads(out.read_text()) == example(name)
    assert NvmetConfig.load(out) == cfg
    assert out.stat().st_mode & 0o777 == 0o600


def test_dump_failure_is_a_config_error_naming_the_path(tmp_path: Path) -> None:
    cfg = NvmetConfig.load(EXAMPLES / "tcp.json")
    with pytest.raises(ConfigError, match="cannot write .*/absent/out.json: No such file or directory"):
        cfg.dump(tmp_path / "absent" / "out.json")
    with pytest.raises(ConfigError, match="Is a directory"):
        cfg.dump(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_example_fields_are_typed() -> None:
    cfg = NvmetConfig.load(EXAMPLES / "tcp.json")
    port, sub = cfg.ports[0], cfg.subsystems[0]
    assert (port.portid, port.addr.trtype, port.addr.trsvcid, port.param["inline_data_size"]) == (1, "tcp", "4420", "16384")
    assert port.ana_groups[0].grpid == 1 and port.ana_groups[0].ana["state"] == "optimized"
    ns = sub.namespaces[0]
    assert (ns.nsid, ns.enable, ns.ana_grpid, ns.device.uuid) == (1, 1, 1, "d592cdf3-5d1c-44e0-8412-3fcf7d99df27")
    assert sub.allow_any_host and sub.attr["cntlid_max"] == "65519"


def test_unknown_keys_round_trip_at_every_level() -> None:
    d = base()
    d["future_top"] = {"x": [1, 2]}
    d["hosts"][0]["future_host"] = True
    d["subsystems"][0]["passthru"] = [{"device": {"path": "/dev/nvme1"}, "enable": 0}]
    d["subsystems"][0]["attr"]["ieee_oui"] = "0x000000"
    d["subsystems"][0]["namespaces"][0]["resv"] = {"enable": "0"}
    d["subsystems"][0]["namespaces"][0]["device"]["p2pmem"] = "0"
    d["ports"][0]["addr"]["tsas"] = "none"
    d["ports"][0]["param"] = {"max_queue_size": "128"}
    d["ports"][0]["referrals"] = [{"name": "r1", "addr": d["ports"][0]["addr"], "enable": 1, "portid": 7}]
    cfg = NvmetConfig.from_dict(d)
    cfg.validate(NqnRule.SPEC)
    assert cfg.to_dict() == d
    assert cfg.extra == {"future_top": {"x": [1, 2]}}


def test_absent_collections_stay_absent_and_code_built_objects_have_full_shape() -> None:
    assert NvmetConfig.from_dict({}).to_dict() == {}
    assert NvmetConfig().to_dict() == {"hosts": [], "ports": [], "subsystems": []}


def test_dhchap_host_fields_round_trip_and_hide_in_repr() -> None:
    key = generate_secret().encode()
    d = base()
    d["hosts"][0].update(dhchap_key=key, dhchap_ctrl_key=generate_secret().encode(),
                         dhchap_hash="hmac(sha384)", dhchap_dhgroup="ffdhe3072")
    cfg = NvmetConfig.from_dict(d)
    cfg.validate(NqnRule.SPEC)
    assert cfg.to_dict() == d
    assert key not in repr(cfg)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(hosts="x"), "expected a JSON list"),
    (lambda d: d["hosts"][0].pop("nqn"), "missing required key 'nqn'"),
    (lambda d: d["ports"][0].update(portid="1"), "portid: expected an integer"),
    (lambda d: d["ports"][0].update(portid=True), "portid: expected an integer"),
    (lambda d: d["subsystems"][0]["attr"].update(serial=5), "expected a string attribute value"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(enable="1"), "enable: expected an integer"),
    (lambda d: d["ports"][0].update(subsystems=[1]), "subsystems[0]: expected a string"),
])
def test_shape_errors_name_the_json_path(mutate: Any, message: str) -> None:
    d = base()
    mutate(d)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        NvmetConfig.from_dict(d)


def test_not_json_and_missing_file() -> None:
    with pytest.raises(ConfigError, match="not valid JSON"):
        NvmetConfig.loads("{", source="x.json")
    with pytest.raises(ConfigError, match="cannot read"):
        NvmetConfig.load("/nonexistent/x.json")


def _set_addr(**kw: str) -> Any:
    return lambda d: d["ports"][0]["addr"].update(kw)


BAD = [
    # NQN syntax
    (lambda d: d["subsystems"][0].update(nqn="nqn.2026-13.io.tierkv:x"), "expected 'nqn.yyyy-mm"),
    (lambda d: d["subsystems"][0].update(nqn="nqn.26-12.io.tierkv:x"), "expected 'nqn.yyyy-mm"),
    (lambda d: d["subsystems"][0].update(nqn="nqn.2026-12.tierkv:x"), "expected 'nqn.yyyy-mm"),
    (lambda d: d["subsystems"][0].update(nqn="nqn.2026-12.io.tierkv:" + "x" * 210), "at most 223"),
    (lambda d: d["subsystems"][0].update(nqn="nqn.2026-12.io.tierkv:a/b"), "contains '/'"),
    (lambda d: d["subsystems"][0].update(nqn="nqn.2026-12.io.tierkv:a b"), "whitespace"),
    (lambda d: d["hosts"][0].update(nqn="nqn.2014-08.org.nvmexpress:uuid:not-a-uuid"), "valid UUID"),
    (lambda d: d["subsystems"][0].update(nqn=""), "empty"),
    (lambda d: d["subsystems"][0].update(nqn="nqn.2014-08.org.nvmexpress.discovery"), "discovery NQN"),
    # addresses per transport
    (_set_addr(trtype="ib"), "trtype 'ib', expected one of"),
    (_set_addr(adrfam="fc"), "needs addr adrfam ipv4 or ipv6"),
    (_set_addr(traddr="host.example"), "needs an IP address"),
    (_set_addr(traddr="fe80::1"), "is not an ipv4 address"),
    (_set_addr(trsvcid="70000"), "TCP port 1..65535"),
    (_set_addr(trsvcid=""), "TCP port 1..65535"),
    (_set_addr(treq="maybe"), "treq 'maybe'"),
    (_set_addr(trtype="loop"), "loop ports take no address"),
    (_set_addr(trtype="fc", adrfam="fc", traddr="10.0.0.1", trsvcid="none"), "nn-0x"),
    (_set_addr(trtype="fc", adrfam="ipv4"), "fc needs addr adrfam 'fc'"),
    # ids, uniqueness and references
    (lambda d: d["ports"][0].update(portid=70000), "portid must be 0..65535"),
    (lambda d: d["ports"].append(dict(d["ports"][0])), "ports portid: 1 appears more than once"),
    (lambda d: d["hosts"].append({"nqn": HOST_NQN}), "hosts nqn"),
    (lambda d: d["subsystems"].append(dict(d["subsystems"][0])), "subsystems nqn"),
    (lambda d: d["subsystems"][0]["namespaces"].append({"nsid": 1}), "namespace nsid: 1 appears more than once"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(nsid=0), "nsid must be 1..8192"),
    (lambda d: d["ports"][0].update(subsystems=["nqn.2026-12.io.tierkv:other"]), "not in subsystems"),
    (lambda d: d["subsystems"][0].update(allowed_hosts=["nqn.2026-12.io.tierkv:stranger"]), "is not in hosts"),
    (lambda d: d["subsystems"][0]["attr"].update(allow_any_host="1"), "allow_any_host=1 together with allowed_hosts"),
    (lambda d: d["subsystems"][0]["attr"].update(allow_any_host="maybe"), "expected 0 or 1"),
    (lambda d: d["subsystems"][0]["attr"].update(cntlid_min="9", cntlid_max="3"), "cntlid_min 9 must be below"),
    (lambda d: d["subsystems"][0]["attr"].update(cntlid_min="5", cntlid_max="5"), "cntlid_min 5 must be below"),
    (lambda d: d["subsystems"][0]["attr"].update(cntlid_max="1"), "cntlid_min 1 must be below cntlid_max 1"),
    (lambda d: d["subsystems"][0]["attr"].update(cntlid_min="65519"), "cntlid_min 65519 must be below"),
    (lambda d: d["subsystems"][0]["attr"].update(serial="x" * 21), "1..20 printable"),
    (lambda d: d["subsystems"][0]["attr"].update(version="one"), "major.minor"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(enable=2), "expected 0 or 1"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(device={}), "enabled without a device path"),
    (lambda d: d["subsystems"][0]["namespaces"][0]["device"].update(path="rel/img"), "must be absolute"),
    (lambda d: d["subsystems"][0]["namespaces"][0]["device"].update(nguid="xyz"), "32 hex digits"),
    (lambda d: d["subsystems"][0]["namespaces"][0]["device"].update(nguid="ef90689c6c46d44c89c14067801309"),
     "32 hex digits"),
    (lambda d: d["subsystems"][0]["namespaces"][0]["device"].update(uuid="ef90689c6c46d44c89c14067801309a8"),
     "8-4-4-4-12"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(ana_grpid=0), "ana_grpid 0"),
    (lambda d: d["ports"][0].update(ana_groups=[{"grpid": 1, "ana": {"state": "bad"}}]), "state 'bad'"),
    (lambda d: d["ports"][0].update(ana_groups=[{"grpid": 200}]), "grpid 1..128"),
    (lambda d: d["ports"][0].update(param={"inline_data_size": "big"}), "inline_data_size: expected an integer"),
    (lambda d: d["ports"][0].update(referrals=[{"name": "a/b", "addr": d["ports"][0]["addr"]}]), "not a usable"),
    (lambda d: d["ports"].append({**d["ports"][0], "portid": 2}), "listening address"),
    # DH-HMAC-CHAP
    (lambda d: d["hosts"][0].update(dhchap_key="DHHC-1:00:abc:"), "not valid base64|decoded"),
    (lambda d: d["hosts"][0].update(dhchap_ctrl_key=generate_secret().encode()), "needs dhchap_key"),
    (lambda d: d["hosts"][0].update(dhchap_hash="sha256"), "expected one of hmac"),
    (lambda d: d["hosts"][0].update(dhchap_dhgroup="ffdhe1024"), "expected one of null"),
]


# What Linux 6.1's nvmet configfs takes (measured in the rig, tests/rig/test_kernel_agreement.py).
GOOD = [
    lambda d: d["subsystems"][0]["namespaces"][0]["device"].update(nguid="ef90689c6c46d44c89c14067801309a8"),
    lambda d: d["subsystems"][0]["namespaces"][0]["device"].update(nguid="EF:90:68:9C:6C:46:D4:4C:89:C1:40:67:80:13:09:A8"),
    lambda d: d["subsystems"][0]["namespaces"][0]["device"].update(uuid="D592CDF3-5D1C-44E0-8412-3FCF7D99DF27"),
    lambda d: (d["subsystems"][0]["attr"].update(allow_any_host="y"), d["subsystems"][0].update(allowed_hosts=[])),
    lambda d: d["subsystems"][0]["attr"].update(allow_any_host="n"),
    lambda d: d["subsystems"][0]["attr"].update(cntlid_min="5", cntlid_max="6"),
    lambda d: d["subsystems"][0]["attr"].update(cntlid_min="65518"),
]


@pytest.mark.parametrize("mutate", GOOD)
def test_what_the_kernel_takes_is_accepted(mutate: Any) -> None:
    d = base()
    mutate(d)
    NvmetConfig.from_dict(d).validate(NqnRule.SPEC)


def test_allow_any_host_reads_as_the_kernel_reads_it() -> None:
    d = base()
    d["subsystems"][0]["attr"]["allow_any_host"] = "y"
    assert NvmetConfig.from_dict(d).subsystems[0].allow_any_host
    with pytest.raises(ConfigError, match="allow_any_host=1 together with allowed_hosts"):
        NvmetConfig.from_dict(d).validate(NqnRule.SPEC)
    d["subsystems"][0]["attr"]["allow_any_host"] = "N"
    assert not NvmetConfig.from_dict(d).subsystems[0].allow_any_host


@pytest.mark.parametrize("mutate, message", BAD)
def test_every_validation_error_is_a_clear_config_error(mutate: Any, message: str) -> None:
    d = base()
    NvmetConfig.from_dict(d).validate(NqnRule.SPEC)
    mutate(d)
    with pytest.raises(ConfigError, match=message):
        NvmetConfig.from_dict(d).validate(NqnRule.SPEC)


def test_permissive_rule_accepts_bare_names_but_not_broken_nqn_prefixes() -> None:
    d = base()
    d["subsystems"][0]["nqn"] = d["ports"][0]["subsystems"][0] = "testnqn"
    NvmetConfig.from_dict(d).validate()
    with pytest.raises(ConfigError, match="expected 'nqn.yyyy-mm"):
        NvmetConfig.from_dict(d).validate(NqnRule.SPEC)
    d["subsystems"][0]["nqn"] = d["ports"][0]["subsystems"][0] = "nqn.bad"
    with pytest.raises(ConfigError):
        NvmetConfig.from_dict(d).validate()


def test_uuid_nqn_and_discovery_style_nqn_are_valid() -> None:
    d = base()
    d["hosts"][0]["nqn"] = d["subsystems"][0]["allowed_hosts"][0] = \
        "nqn.2014-08.org.nvmexpress:uuid:d592cdf3-5d1c-44e0-8412-3fcf7d99df27"
    d["subsystems"][0]["nqn"] = d["ports"][0]["subsystems"][0] = "nqn.2026-12.io.tierkv"
    NvmetConfig.from_dict(d).validate(NqnRule.SPEC)
