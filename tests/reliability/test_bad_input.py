"""Bad input, generated: the API, TOML configs and trace files either work or raise a
clear TierKVError; never another exception, a hang or wrong data."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.conftest import LAYOUT, PB, make_config
from tierkv.store.api import Store
from tierkv.config import config_from_dict
from tierkv.errors import TierKVError
from tierkv.workload import parse_mix, read_mooncake
from tierkv.workload.synthetic import MIX_LIMITS

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = Store.open(make_config(tmp_path_factory.mktemp("bad") / "s", 4, 16))
    yield s
    s.close()


token_arrays = st.one_of(
    hnp.arrays(st.sampled_from([np.int64, np.int32, np.uint32, np.uint8, np.float32, np.bool_]),
               hnp.array_shapes(min_dims=0, max_dims=2, max_side=70)),
    st.lists(st.integers(-5, 1 << 34), max_size=70),
)
page_batches = st.one_of(
    hnp.arrays(st.sampled_from([np.uint8, np.float16, np.int8]),
               st.tuples(st.integers(0, 5), st.sampled_from([PB, PB - 1, 8]))),
    st.builds(lambda n, dt: torch.zeros(n, *LAYOUT.page_shape, dtype=dt),
              st.integers(0, 5), st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
    st.lists(st.one_of(  # separate pages, as put takes them
        hnp.arrays(st.sampled_from([np.uint8, np.float16]),
                   st.sampled_from([(PB,), (1, PB), (2, PB), (PB - 1,), (0,)])),
        st.builds(lambda dt: torch.zeros(*LAYOUT.page_shape, dtype=dt), st.sampled_from([torch.bfloat16, torch.uint8])),
        st.builds(lambda n: torch.zeros(n, dtype=torch.uint8), st.sampled_from([PB, PB + 1])),
        st.just(None)), max_size=6),
)


@SETTINGS
@given(tokens=token_arrays, pages=page_batches, tenant=st.one_of(st.text(max_size=8), st.binary(max_size=8)))
def test_api_results_or_tierkv_errors(store: Store, tokens: object, pages: object, tenant: str | bytes) -> None:
    for call in (lambda: store.lookup(tokens, tenant=tenant),  # type: ignore[arg-type]
                 lambda: store.put(tokens, pages, tenant=tenant),  # type: ignore[arg-type]
                 lambda: store.get(tokens, pages, tenant=tenant),  # type: ignore[arg-type]
                 lambda: store.pin(tokens, tenant=tenant), lambda: store.unpin(tokens, tenant=tenant)):  # type: ignore[arg-type]
        try:
            call()
        except TierKVError:
            pass


def prefix_pages(tokens: list[int]) -> np.ndarray:
    """Page i's bytes are a function of tokens[:16 * (i + 1)], as a page's key is."""
    n = len(tokens) // 16
    return np.stack([np.random.default_rng(tokens[:16 * (i + 1)]).integers(0, 256, PB, dtype=np.uint8)
                     for i in range(n)])


@SETTINGS
@given(tokens=st.lists(st.integers(0, 3), min_size=16, max_size=64))
def test_what_comes_back_is_what_went_in(store: Store, tokens: list[int]) -> None:
    pages = prefix_pages(tokens)  # a tiny vocabulary: examples share prefixes and pages
    store.put(tokens, pages, tenant="prop")
    out = np.zeros_like(pages)
    got = store.get(tokens, out, tenant="prop").pages
    assert np.array_equal(out[:got], pages[:got])


scalars = st.one_of(st.integers(-10, 1 << 40), st.text(max_size=12), st.booleans(), st.floats(allow_nan=True),
                    st.none())
tables = st.dictionaries(st.sampled_from(["path", "model_id", "policy", "capacity_bytes", "num_layers",
                                          "num_kv_heads", "head_dim", "dtype", "tokens_per_page", "kind",
                                          "io_threads", "o_direct", "verify_index", "junk"]), scalars, max_size=6)


@settings(max_examples=200, deadline=None)
@given(data=st.dictionaries(st.sampled_from(["store", "layout", "tiers", "extra"]),
                            st.one_of(tables, st.dictionaries(st.sampled_from(["dram", "nvme", "tape"]), tables),
                                      scalars), max_size=4))
def test_configs_parse_or_raise_config_errors(data: dict[str, object]) -> None:
    try:
        config_from_dict(data)
    except TierKVError:
        pass


trace_lines = st.one_of(
    st.text(max_size=60),
    st.builds(json.dumps, st.dictionaries(st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids"]),
                                          st.one_of(scalars, st.lists(st.integers(-3, 50), max_size=5)))),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(trace_lines, max_size=6))
def test_trace_files_parse_or_raise_input_errors(tmp_path: Path, lines: list[str]) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines))
    try:
        list(read_mooncake(path))
    except TierKVError:
        pass


# -- values of the wrong type or size (issue 28, items 6 to 9) ----------------------------

odd_values = st.one_of(scalars, st.sampled_from(["false", "true", "yes", "0", "1GiB", "9" * 400]),
                       st.sampled_from([math.nan, math.inf, -math.inf, 1e400, (1 << 63) - 1, 1 << 70, 10 ** 30]))
_BOOL_KEYS = ["promote_on_hit", "persist_on_close", "o_direct", "disconnect_on_close"]
_NUMBER_KEYS = ["capacity_bytes", "io_threads", "bandwidth_gbps", "nsid", "io_timeout_s", "monitor_interval_s",
                "connect_timeout_s", "ctrl_loss_tmo_s", "reconnect_delay_s", "fast_io_fail_tmo_s", "timeout_s"]
typed_tables = st.dictionaries(st.sampled_from(_BOOL_KEYS + _NUMBER_KEYS + ["path", "device"]), odd_values, max_size=4)


def _assert_fields_hold_their_types(cfg: object) -> None:
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            _assert_fields_hold_their_types(value)
        elif f.type == "bool":
            assert isinstance(value, bool), (f.name, value)
        elif f.type == "int":
            assert isinstance(value, int) and not isinstance(value, bool) and abs(value) <= 1 << 60, (f.name, value)
        elif f.type == "float":
            assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), \
                (f.name, value)
        elif f.type in ("str", "str | None"):
            assert value is None or (isinstance(value, str) and "\0" not in value), (f.name, value)


@settings(max_examples=300, deadline=None)
@given(store=typed_tables, tier=st.sampled_from(["dram", "nvme", "nvmeof"]), table=typed_tables,
       peers=st.one_of(st.none(), typed_tables))
def test_configs_that_parse_hold_the_declared_types(store: dict[str, object], tier: str, table: dict[str, object],
                                                     peers: dict[str, object] | None) -> None:
    """``persist_on_close = "false"`` parsed and persisted pages: a config either holds a bool
    where a bool is declared (a finite number for a number, a sane int for an int) or is refused."""
    base_tier: dict[str, object] = {"device": "/dev/nvme1n1"} if tier == "nvmeof" else {"capacity_bytes": "1MiB"}
    data: dict[str, object] = {
        "store": {"path": "/tmp/x", "model_id": "m", **{k: v for k, v in store.items() if k in _BOOL_KEYS + ["path"]}},
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8},
        "tiers": {tier: {**base_tier, **{k: v for k, v in table.items() if k not in ("promote_on_hit",
                                                                                      "persist_on_close")}}}}
    if peers is not None:
        data["peers"] = {k: v for k, v in peers.items() if k == "timeout_s"}
    try:
        cfg = config_from_dict(data)
    except TierKVError:
        return
    _assert_fields_hold_their_types(cfg)


mix_fields = sorted(MIX_LIMITS)
mix_values = st.one_of(st.integers(-5, 1 << 40).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
                       st.sampled_from(["nan", "inf", "-inf", "1e400", "9" * 400, "1-1000000000", "5-2", "1-4", "0.5",
                                        "true", ""]),
                       st.tuples(st.integers(-3, 1 << 33), st.integers(-3, 1 << 33)).map(lambda p: f"{p[0]}-{p[1]}"))


@settings(max_examples=300, deadline=None)
@given(items=st.lists(st.tuples(st.sampled_from(mix_fields), mix_values), max_size=4))
def test_mixes_parse_within_their_limits_or_raise_input_errors(items: list[tuple[str, str]]) -> None:
    spec = ",".join(f"{name}={value}" for name, value in items)
    try:
        mix = parse_mix(spec)
    except TierKVError:
        return
    for name, (lo, hi) in MIX_LIMITS.items():
        value = getattr(mix, name)
        for v in value if isinstance(value, tuple) else (value,):
            assert not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi, (name, value)
