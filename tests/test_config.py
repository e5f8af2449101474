"""Config loading: the shipped TOML files, sizes, and clear errors on bad input."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tierkv.config import (DramConfig, HbmConfig, NvmeConfig, NvmeofConfig, PeersConfig, StoreConfig, config_from_dict,
                           load_config)
from tierkv.errors import ConfigError, LayoutError
from tierkv.layout import DType, KVLayout, LayoutKind, PageOrder
from tierkv.units import parse_size

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.layout.page_bytes > 0 and (cfg.dram or cfg.nvme or cfg.nvmeof)


def test_default_config_values() -> None:
    cfg = load_config(ROOT / "configs" / "default.toml")
    assert cfg.layout.page_bytes == 30 * 2 * 16 * 3 * 64 * 2
    assert cfg.dram is not None and cfg.dram.capacity_bytes == 1 << 30
    assert cfg.nvme is not None and cfg.nvme.capacity_bytes == 8 << 30


BASE: dict[str, dict[str, Any]] = {"store": {"path": "/tmp/x", "model_id": "m"},
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8},
        "tiers": {"dram": {"capacity_bytes": "1MiB"}}}


def with_(section: str, **kw: object) -> dict[str, dict[str, object]]:
    data: dict[str, dict[str, object]] = {k: dict(v) for k, v in BASE.items()}
    if section == "tiers.dram":
        data["tiers"] = {"dram": {**BASE["tiers"]["dram"], **kw}}
    else:
        data[section].update(kw)
    return data  # type: ignore[return-value]


@pytest.mark.parametrize("data,match", [
    (with_("tiers.dram", capacity_bytes="-1GiB"), "cannot parse"),
    (with_("tiers.dram", capacity_bytes="12 parsecs"), "cannot parse"),
    (with_("tiers.dram", size="1GiB"), "unknown key"),
    (with_("layout", dtype="int4"), "unknown KV dtype"),
    (with_("layout", num_layers=0), "positive integer"),
    (with_("layout", kind="latent", num_kv_heads=2), "num_kv_heads must be 1"),
    (with_("store", policy="mru"), "unknown policy"),
    (with_("store", model_id=""), "model_id"),
    ({**BASE, "tiers": {"tape": {}}}, "unknown tier"),
    ({**BASE, "tiers": {}}, "at least one tier"),
    ({**BASE, "tiers": {"nvmeof": {"capacity_bytes": "1GiB"}}}, "either device"),
    ({**BASE, "tiers": {"nvmeof": {"subnqn": "nqn.2026-12.io.x:y", "transport": "ib"}}}, "transport must be"),
    ({**BASE, "tiers": {"nvmeof": {"subnqn": "nqn.2026-12.io.x:y", "transport": "rdma"}}}, "traddr is required"),
    ({**BASE, "tiers": {"nvmeof": {"device": "/dev/nvme1n1", "io_timeout_s": 0}}}, "io_timeout_s"),
    ({**BASE, "tiers": {"nvmeof": {"device": "/dev/nvme1n1", "ctrl_loss_tmo_s": -5}}}, "ctrl_loss_tmo_s"),
    ({**BASE, "tiers": {"nvmeof": {"device": "/dev/nvme1n1", "nsid": 0}}}, "nsid"),
])
def test_bad_configs_name_the_problem(data: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_dict(data)


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[store\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


@pytest.mark.parametrize("text,value", [(4096, 4096), ("64GiB", 64 << 30), ("512 MB", 512_000_000),
                                        ("1.5KiB", 1536), ("2tb", 2 * 10**12)])
def test_parse_size(text: object, value: int) -> None:
    assert parse_size(text) == value  # type: ignore[arg-type]


def test_layout_sizes() -> None:
    llama = KVLayout(32, 8, 128, DType.BF16, 16)
    assert llama.token_bytes == 131_072
    mla = KVLayout(61, 1, 576, "bf16", 64, LayoutKind.LATENT)
    assert mla.token_bytes == 70_272 and mla.page_shape == (61, 64, 576)
    assert KVLayout(1, 1, 1, "fp8_e4m3", 1).page_bytes == 2
    with pytest.raises(LayoutError, match="limit"):
        KVLayout(1000, 1000, 1000, "fp32", 1000)


def test_page_order_is_declared_checked_and_a_layout_of_its_own() -> None:
    std = KVLayout(30, 3, 64, "bf16", 128)
    native = KVLayout(30, 3, 64, "bf16", 128, page_order="vllm_cpu")
    assert native.page_order is PageOrder.VLLM_CPU and std.page_order is PageOrder.STANDARD
    assert native.page_shape == (30, 3, 128, 128) and native.page_bytes == std.page_bytes
    # The standard order leaves the fingerprint as it was before the field (stores and
    # keys made then stay valid); another order is another layout.
    assert std.fingerprint() == (b'{"dtype":"bf16","head_dim":64,"kind":"kv","num_kv_heads":3,"num_layers":30,'
                                 b'"tokens_per_page":128}')
    assert native.fingerprint() != std.fingerprint() and b'"page_order":"vllm_cpu"' in native.fingerprint()
    with pytest.raises(LayoutError, match="page_order must be one of 'standard', 'vllm_cpu', 'vllm_cpu_amx', got 'lbhnc'"):
        KVLayout(30, 3, 64, "bf16", 128, page_order="lbhnc")
    with pytest.raises(LayoutError, match="needs kind 'kv'"):
        KVLayout(30, 1, 64, "bf16", 128, LayoutKind.LATENT, "vllm_cpu")
    amx = KVLayout(30, 3, 64, "bf16", 128, page_order="vllm_cpu_amx")   # the AMX kernel's blocks: a third layout
    assert amx.page_shape == native.page_shape and len({amx.fingerprint(), native.fingerprint(), std.fingerprint()}) == 3
    for bad in ({"dtype": "fp16"}, {"tokens_per_page": 16}, {"head_dim": 80}):   # vLLM: vec16 at head dim 80
        with pytest.raises(LayoutError, match="'vllm_cpu_amx'.*bf16 pages whose tokens_per_page and head_dim are "
                                              "multiples of 32"):
            KVLayout(**{"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "bf16", "tokens_per_page": 128,
                        "page_order": "vllm_cpu_amx", **bad})   # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="page_order 'vllm_cpu_amx' .* needs kind 'kv'"):
        KVLayout(30, 1, 64, "bf16", 128, LayoutKind.LATENT, "vllm_cpu_amx")
    data = {"store": {"path": "/tmp/x", "model_id": "m"},
            "layout": {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "bf16", "tokens_per_page": 128,
                       "page_order": "vllm_cpu"},
            "tiers": {"dram": {"capacity_bytes": "1GiB"}}}
    assert config_from_dict(data, "x.toml").layout == native


def test_coded_tiers_refuse_pages_their_records_cannot_describe(tmp_path: Path) -> None:
    from tierkv.config import NvmeConfig, StoreConfig

    huge = KVLayout(num_layers=128, num_kv_heads=8, head_dim=128, dtype=DType.BF16, tokens_per_page=1024)
    assert huge.page_bytes > 0xFFFF * 4096
    StoreConfig(path=str(tmp_path), model_id="m", layout=huge, nvme=NvmeConfig(1 << 40))  # raw: fine
    with pytest.raises(ConfigError, match="codec = \"none\""):
        StoreConfig(path=str(tmp_path), model_id="m", layout=huge, nvme=NvmeConfig(1 << 40, codec="lossless"))


@pytest.mark.parametrize("table", ["store2", "tier", "peer"])
def test_unknown_top_level_tables_are_refused(table: str) -> None:
    data = {"store": {"path": "/tmp/x", "model_id": "m"},
            "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 64, "dtype": "bf16", "tokens_per_page": 16},
            "tiers": {"dram": {"capacity": "1MiB"}}, table: {"nvme": {"capacity": "1GiB"}}}
    with pytest.raises(ConfigError, match=f"unknown top-level key.*{table}"):
        config_from_dict(data, "x.toml")


def test_default_toml_names_every_key() -> None:
    """README: configs/default.toml documents every key (set, or commented out)."""
    import dataclasses
    import re

    from tierkv.config import (ClusterConfig, DramConfig, HbmConfig, NvmeConfig, NvmeofConfig, PeersConfig,
                               ServeConfig, StoreConfig)
    from tierkv.layout import KVLayout

    text = (Path(__file__).resolve().parents[1] / "configs" / "default.toml").read_text()
    tables = {"store": StoreConfig, "layout": KVLayout, "tiers.hbm": HbmConfig, "tiers.dram": DramConfig,
              "tiers.nvme": NvmeConfig, "tiers.nvmeof": NvmeofConfig, "peers": PeersConfig, "serve": ServeConfig,
              "cluster": ClusterConfig}
    nested = {"layout", "dram", "nvme", "hbm", "nvmeof", "peers", "serve", "cluster"}
    missing = []
    for table, cls in tables.items():
        head = re.search(rf"^#? ?\[{re.escape(table)}\]", text, re.M)
        assert head is not None, f"[{table}] is not in default.toml"
        body = text[head.end():]
        nxt = re.search(r"^#? ?\[", body, re.M)
        body = body[:nxt.start()] if nxt else body
        for f in dataclasses.fields(cls):
            if f.init and f.name not in nested and not re.search(rf"^#? ?{f.name} =", body, re.M):
                missing.append(f"[{table}] {f.name}")
    assert not missing, f"default.toml does not name: {', '.join(missing)}"


@pytest.mark.parametrize("cls", [HbmConfig, DramConfig, NvmeConfig, KVLayout])
def test_the_typed_init_stub_matches_the_generated_init(cls: type) -> None:
    """The ``if TYPE_CHECKING: def __init__`` stub that lets mypy accept "64GiB" and "bf16"
    must name the same parameters, in the same order, with the same defaults, as the
    dataclass's generated ``__init__`` that runs."""
    source = textwrap.dedent(inspect.getsource(cls))
    stub = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    names = [a.arg for a in stub.args.args[1:]]
    defaults = [ast.unparse(d) for d in stub.args.defaults]
    runtime = list(inspect.signature(cls).parameters.values())
    assert names == [p.name for p in runtime]
    want = [p.default for p in runtime if p.default is not inspect.Parameter.empty]
    assert [eval(d, vars(sys.modules[cls.__module__])) for d in defaults] == want  # noqa: S307



# -- every field has its declared type and a sane size (issue 28, items 7 and 8) -----------

# The smallest valid table of each config dataclass, by where it goes in a config.
_TABLES: dict[str, tuple[type, dict[str, object]]] = {
    "store": (StoreConfig, {"path": "/tmp/x", "model_id": "m"}),
    "layout": (KVLayout, {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8}),
    "tiers.hbm": (HbmConfig, {"capacity_bytes": "1MiB", "device": "cpu"}),
    "tiers.dram": (DramConfig, {"capacity_bytes": "1MiB"}),
    "tiers.nvme": (NvmeConfig, {"capacity_bytes": "1MiB"}),
    "tiers.nvmeof": (NvmeofConfig, {"device": "/dev/nvme1n1"}),
    "peers": (PeersConfig, {}),
}


def _config_with(table: str, **values: object) -> dict[str, object]:
    """A config dict of the minimal store, layout and DRAM tier, plus ``[table]`` with ``values``."""
    data: dict[str, Any] = {"store": dict(_TABLES["store"][1]), "layout": dict(_TABLES["layout"][1]),
                            "tiers": {"dram": dict(_TABLES["tiers.dram"][1])}}
    parent, _, name = table.rpartition(".")
    holder = data["tiers"] if parent else data
    holder[name] = {**holder.get(name, {}), **_TABLES[table][1], **values}
    return data


def _fields(kind: str) -> list[tuple[str, str]]:
    """(table, key) of every field annotated ``kind``."""
    return [(table, f.name) for table, (cls, _) in _TABLES.items() for f in dataclasses.fields(cls)
            if str(f.type) == kind]


@pytest.mark.parametrize("table", _TABLES)
def test_the_minimal_tables_are_valid(table: str) -> None:
    config_from_dict(_config_with(table))


BOOL_FIELDS = _fields("bool")


def test_the_bool_fields_are_all_here() -> None:
    assert sorted(f"{t}.{k}" for t, k in BOOL_FIELDS) == [
        "peers.helper", "store.persist_on_close", "store.promote_on_hit", "tiers.dram.prefault", "tiers.nvme.format",
        "tiers.nvme.o_direct", "tiers.nvmeof.disconnect_on_close", "tiers.nvmeof.format", "tiers.nvmeof.o_direct"]


@pytest.mark.parametrize("table,key", BOOL_FIELDS)
@pytest.mark.parametrize("value", ["false", "true", "yes", "no", "", 0, 1, 0.0, None])
def test_booleans_must_be_booleans(table: str, key: str, value: object) -> None:
    """``persist_on_close = "false"`` is a non-empty string, so truthy: it was accepted and pages persisted."""
    # A helper must serve: the endpoint it is asked on.
    needs = {"serve": "127.0.0.1:0", "secret_file": "/x"} if (table, key) == ("peers", "helper") else {}
    with pytest.raises(ConfigError, match=rf"{key} must be true or false, got {re.escape(repr(value))}"):
        config_from_dict(_config_with(table, **{key: value}, **needs))
    for ok in (True, False):
        cfg = config_from_dict(_config_with(table, **{key: ok}, **needs))
        assert getattr(cfg if table == "store" else getattr(cfg, table.split(".")[-1]), key) is ok


@pytest.mark.parametrize("table,key", _fields("int"))
@pytest.mark.parametrize("value", [True, False, 1.0, "4", 1 << 70])
def test_integers_must_be_integers_of_sane_size(table: str, key: str, value: object) -> None:
    if key == "capacity_bytes" and value == "4":
        return  # a size string: 4 bytes
    with pytest.raises((ConfigError, LayoutError), match=key):
        config_from_dict(_config_with(table, **{key: value}))


@pytest.mark.parametrize("table,key", _fields("float"))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True, "5", 1e300])
def test_numbers_must_be_finite_numbers(table: str, key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"{key} must be a finite number"):
        config_from_dict(_config_with(table, **{key: value}))


@pytest.mark.parametrize("table,key", [tk for tk in _fields("str") + _fields("str | None") if tk[1] != "trsvcid"])
def test_strings_must_be_strings(table: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        config_from_dict(_config_with(table, **{key: 42}))


def _toml(tmp_path: Path, table: str, line: str) -> Path:
    """A config file of the minimal tables, with ``line`` ("key = value") set in ``[table]``."""
    tables = {t: {k: json.dumps(v) for k, v in _TABLES[t][1].items()} for t in ("store", "layout", "tiers.dram")}
    key, _, value = line.partition(" = ")
    tables.setdefault(table, {k: json.dumps(v) for k, v in _TABLES[table][1].items()})[key] = value
    p = tmp_path / "c.toml"
    p.write_text("".join(f"[{t}]\n" + "".join(f"{k} = {v}\n" for k, v in kv.items()) for t, kv in tables.items()))
    return p


@pytest.mark.parametrize("table,line,match", [
    ("tiers.dram", "capacity_bytes = 9223372036854775807",
     r"dram.capacity_bytes: 9223372036854775807 bytes, more than the largest size tierkv takes, 1152921504606846976"),
    ("tiers.nvme", "capacity_bytes = 9223372036854775807", r"nvme.capacity_bytes: 9223372036854775807 bytes"),
    ("tiers.dram", f'capacity_bytes = "{"9" * 400}"', r"dram.capacity_bytes: .* too long a number \(400 digits\)"),
    ("tiers.nvme", f'capacity_bytes = "{"9" * 400}GiB"', r"too long a number \(400 digits\)"),
    ("tiers.dram", 'capacity_bytes = "99999999999999999999999"', r"is 99999999999999999999999 bytes, more than"),
    ("store", "path = 42", r"store.path must be a string, got 42"),
    ("store", r'path = "/tmp/a\u0000b"', r"store.path must be a non-empty path without NUL bytes"),
    ("tiers.nvme", "path = 42", r"nvme.path must be a string or absent, got 42"),
    ("tiers.nvme", 'path = ""', r"nvme.path must be a non-empty path"),
    ("store", 'persist_on_close = "false"', r"store.persist_on_close must be true or false, got 'false'"),
    ("store", 'promote_on_hit = "false"', r"store.promote_on_hit must be true or false, got 'false'"),
    ("tiers.nvme", 'o_direct = "yes"', r"nvme.o_direct must be true or false, got 'yes'"),
    ("tiers.nvme", "bandwidth_gbps = nan", r"nvme.bandwidth_gbps must be a finite number"),
    ("tiers.nvme", "bandwidth_gbps = inf", r"nvme.bandwidth_gbps must be a finite number"),
    ("peers", "timeout_s = inf", r"peers.timeout_s must be a finite number of seconds"),
    ("tiers.nvmeof", "io_timeout_s = inf", r"nvmeof.io_timeout_s must be a finite number of seconds"),
    ("tiers.nvmeof", "ctrl_loss_tmo_s = 9223372036854775807", r"nvmeof.ctrl_loss_tmo_s must be an integer in"),
])
def test_toml_values_of_the_wrong_type_or_size_are_config_errors(tmp_path: Path, table: str, line: str,
                                                                 match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(_toml(tmp_path, table, line))


@pytest.mark.parametrize("text,value", [(str(1 << 60), 1 << 60), ("1048576TiB", 1 << 60), ("0", 0),
                                        (" 0064 GiB ", 64 << 30), ("0.5KiB", 512)])
def test_sizes_up_to_one_exbibyte_parse_exactly(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("value,match", [
    pytest.param("9" * 400, "too long a number", id="400-digits"),
    pytest.param(10 ** 5000, "a 16610-bit byte count", id="5000-digit-int"), ((1 << 60) + 1, "more than"),
    ("1048577TiB", "more than"), ("1.0000000001KiB", "not a whole number"), ("\u0661\u0662", "cannot parse"),
    ("9007199254740993", None),  # past float's 2**53: exact, not rounded
])
def test_parse_size_refuses_huge_and_inexact_sizes(value: int | str, match: str | None) -> None:
    if match is None:
        assert parse_size(value) == int(value)
        return
    with pytest.raises(ConfigError, match=match):
        parse_size(value, "--dram")


def test_a_path_like_store_path_is_kept_as_text(tmp_path: Path) -> None:
    layout = KVLayout(1, 1, 8)
    cfg = StoreConfig(path=tmp_path, model_id="m", layout=layout, dram=DramConfig("1MiB"))  # type: ignore[arg-type]
    assert cfg.path == str(tmp_path)
