"""Fuzzing the nvmetcli JSON loader: for random mutations of the shared examples and
random JSON structures, loading plus validation either gives a model that round-trips
exactly, or raises nvmeof.errors.ConfigError; never another exception. 150 examples
per test, 3000 with --soak."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvmeof.errors import ConfigError
from nvmeof.model import NqnRule, NvmetConfig

EXAMPLES = [json.loads(p.read_text()) for p in sorted(Path("/work/shared/data/nvmetcli").glob("*.json"))]
KEYS = ["hosts", "ports", "subsystems", "nqn", "portid", "addr", "trtype", "adrfam", "traddr", "trsvcid", "treq",
        "param", "referrals", "ana_groups", "grpid", "ana", "state", "attr", "allow_any_host", "allowed_hosts",
        "namespaces", "nsid", "enable", "device", "path", "nguid", "uuid", "ana_grpid", "buffered_io",
        "dhchap_key", "dhchap_hash", "dhchap_dhgroup", "name", "serial", "x-unknown"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                    st.sampled_from(["", "1", "0", "tcp", "rdma", "loop", "fc", "ipv4", "ipv6", "10.0.0.1", "4420",
                                     "hostnqn", "testnqn", "nqn.2026-12.io.tierkv:x", "DHHC-1:00:abc:", "optimized"]),
                    st.text(max_size=30))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), inner,
                                                 max_size=5)), max_leaves=25)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def mutated_examples(draw: st.DrawFn) -> Any:
    doc = copy.deepcopy(draw(st.sampled_from(EXAMPLES)))
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        if not path:
            continue
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        op = draw(st.sampled_from(["replace", "delete", "add"]))
        if op == "replace":
            parent[path[-1]] = draw(json_values)
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.sampled_from(KEYS))] = draw(json_values)
        else:
            parent.append(draw(json_values))
    return doc


def check(doc: Any) -> None:
    text = json.dumps(doc)
    try:
        cfg = NvmetConfig.loads(text)
        cfg.validate(NqnRule.PERMISSIVE)
    except ConfigError:
        return
    assert cfg.to_dict() == json.loads(text)
    assert NvmetConfig.loads(cfg.to_json()) == cfg


def _settings(soak: bool) -> settings:
    return settings(max_examples=3000 if soak else 150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def test_mutated_examples_load_or_raise_config_error(soak: bool) -> None:
    @_settings(soak)
    @given(mutated_examples())
    def run(doc: Any) -> None:
        check(doc)

    run()


def test_random_structures_load_or_raise_config_error(soak: bool) -> None:
    @_settings(soak)
    @given(st.one_of(json_values, st.dictionaries(st.sampled_from(["hosts", "ports", "subsystems"]), json_values)))
    def run(doc: Any) -> None:
        check(doc)

    run()


@pytest.mark.parametrize("text", ["", "[", "nan", "{\"hosts\": [1]}", "\"x\"", "{\"ports\": [{\"portid\": 1e400}]}"])
def test_non_json_and_odd_json_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError):
        NvmetConfig.loads(text).validate()
