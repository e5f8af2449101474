"""TOML specs: the shipped configs generate valid, deny-by-default targets; every spec
error is a ConfigError; allowing any host must be spelled out and warns."""

from __future__ import annotations

from pathlib import Path

import pytest

from nvmeof.auth import parse_secret
from nvmeof.errors import ConfigError
from nvmeof.model import NqnRule
from nvmeof.spec import InsecureTargetWarning, Transport, generate, load_spec, parse_size, spec_from_dict

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "nvmeof"
SUB = "nqn.2026-12.io.tierkv:t"
HOST = "nqn.2026-12.io.tierkv:h"


def minimal(**over: object) -> dict[str, object]:
    d: dict[str, object] = {"subsystem": {"nqn": SUB}, "namespace": [{"device": "/dev/nvme0n1"}],
                            "port": [{"transport": "tcp", "address": "10.0.0.1"}], "host": [{"nqn": HOST}]}
    d.update(over)
    return d


def test_rig_spec_generates_the_rig_target() -> None:
    spec = load_spec(CONFIGS / "rig-rdma.toml")
    assert spec.namespaces[0].size_bytes == 1 << 30
    cfg = generate(spec)
    cfg.validate(NqnRule.SPEC)
    (sub,) = cfg.subsystems
    assert sub.nqn == "nqn.2026-12.io.tierkv:rig" and sub.attr["allow_any_host"] == "0" and sub.attr["serial"]
    assert sub.allowed_hosts == ("nqn.2026-12.io.tierkv:host-rig",)
    ns = sub.namespaces[0]
    assert (ns.device.path, ns.buffered_io, ns.enable) == ("/run/tierkv-rig/ns1.img", 1, 1)
    addrs = [(p.portid, p.addr.trtype, p.addr.adrfam, p.addr.traddr, p.addr.trsvcid, p.subsystems) for p in cfg.ports]
    assert addrs == [(1, "rdma", "ipv4", "10.77.0.1", "4420", (sub.nqn,)), (2, "tcp", "ipv4", "10.77.0.1", "4421", (sub.nqn,))]
    assert [h.nqn for h in cfg.hosts] == ["nqn.2026-12.io.tierkv:host-rig"]


def test_example_spec_generates_keys_for_hosts_that_ask() -> None:
    cfg = generate(load_spec(CONFIGS / "example.toml"))
    keyed, plain = cfg.hosts
    assert keyed.dhchap_key and keyed.dhchap_ctrl_key and keyed.dhchap_key != keyed.dhchap_ctrl_key
    parse_secret(keyed.dhchap_key)
    assert plain.dhchap_key is None
    assert cfg.subsystems[0].namespaces[0].buffered_io is None  # block device: kernel default


def test_defaults_deny_unknown_hosts() -> None:
    cfg = generate(spec_from_dict(minimal()))
    sub = cfg.subsystems[0]
    assert sub.attr["allow_any_host"] == "0" and sub.allowed_hosts == (HOST,)
    assert (cfg.ports[0].portid, cfg.ports[0].addr.trsvcid, sub.namespaces[0].nsid) == (1, "4420", 1)


def test_allow_any_host_must_be_explicit_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="no host could connect"):
        spec_from_dict(minimal(host=[]))
    with pytest.raises(ConfigError, match="remove the \\[\\[host\\]\\] list"):
        spec_from_dict(minimal(subsystem={"nqn": SUB, "allow_any_host": True}))
    spec = spec_from_dict(minimal(subsystem={"nqn": SUB, "allow_any_host": True}, host=[]))
    with pytest.warns(InsecureTargetWarning, match="ANY host"):
        cfg = generate(spec)
    assert cfg.subsystems[0].allow_any_host and "ANY host" in caplog.text


def test_generated_keys_use_the_entropy_source_and_ipv6_and_loop() -> None:
    spec = spec_from_dict(minimal(host=[{"nqn": HOST, "generate_keys": True, "dhchap_dhgroup": "ffdhe2048"}],
                                  port=[{"transport": "rdma", "address": "fd00::1", "trsvcid": 4430},
                                        {"transport": "loop", "portid": 9}]))
    cfg = generate(spec, random_bytes=lambda n: b"\x07" * n)
    assert parse_secret(cfg.hosts[0].dhchap_key or "").key == b"\x07" * 32
    assert cfg.hosts[0].dhchap_dhgroup == "ffdhe2048"
    assert (cfg.ports[0].addr.adrfam, cfg.ports[0].addr.trsvcid) == ("ipv6", "4430")
    assert (cfg.ports[1].portid, cfg.ports[1].addr.trtype) == (9, "loop")
    assert spec.ports[1].transport is Transport.LOOP


@pytest.mark.parametrize("over, message", [
    ({"subsystem": {}}, "missing required key 'nqn'"),
    ({"subsystem": {"nqn": SUB, "colour": "red"}}, "unknown key"),
    ({"extra": 1}, "unknown key"),
    ({"namespace": [{"device": "/dev/a", "file": "/b"}]}, "exactly one of 'file' or 'device'"),
    ({"namespace": [{"device": "/dev/a", "buffered_io": True}]}, "file backing only"),
    ({"namespace": [{"file": "/f", "size": "lots"}]}, "expected a size"),
    ({"namespace": [{"file": "/f", "nsid": "1"}]}, "expected int"),
    ({"namespace": []}, "at least one"),
    ({"port": [{"transport": "ib", "address": "10.0.0.1"}]}, "expected one of rdma, tcp, loop"),
    ({"port": [{"transport": "tcp"}]}, "need 'address'"),
    ({"port": [{"transport": "loop", "address": "10.0.0.1"}]}, "loop ports take no address"),
    ({"port": [{"transport": "tcp", "address": "nvme.example"}]}, "not an IP address"),
    ({"port": [{"transport": "tcp", "address": "10.0.0.1", "trsvcid": 0}]}, "TCP port"),
    ({"host": [{"nqn": "bad-host"}]}, "expected 'nqn.yyyy-mm"),
    ({"host": [{"nqn": HOST, "generate_keys": True, "dhchap_key": "DHHC-1:00:x:"}]}, "conflicts"),
    ({"host": [{"nqn": HOST, "dhchap_key": "DHHC-1:00:x:"}]}, "dhchap_key"),
    ({"host": [{"nqn": HOST, "generate_keys": "yes"}]}, "expected bool"),
])
def test_spec_errors(over: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        generate(spec_from_dict(minimal(**over)))


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[subsystem\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_spec(bad)
    with pytest.raises(ConfigError, match="cannot read spec"):
        load_spec(tmp_path / "none.toml")


def test_parse_size() -> None:
    assert parse_size("64GiB", "s") == 64 << 30 and parse_size(4096, "s") == 4096 and parse_size("1.5 kB", "s") == 1500
    with pytest.raises(ConfigError):
        parse_size(-1, "s")
