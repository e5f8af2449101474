"""Bad input, generated: the API, TOML configs and trace files either work or raise a
clear TierKVError; never another exception, a hang or wrong data."""

from __future__ import annotations

import json
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
from tierkv.workload import read_mooncake

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
