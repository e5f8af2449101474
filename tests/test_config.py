"""Config loading: the shipped TOML files, sizes, and clear errors on bad input."""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tierkv.config import DramConfig, HbmConfig, NvmeConfig, config_from_dict, load_config
from tierkv.errors import ConfigError, LayoutError
from tierkv.layout import DType, KVLayout, LayoutKind
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

    from tierkv.config import DramConfig, HbmConfig, NvmeConfig, NvmeofConfig, PeersConfig, StoreConfig
    from tierkv.layout import KVLayout

    text = (Path(__file__).resolve().parents[1] / "configs" / "default.toml").read_text()
    tables = {"store": StoreConfig, "layout": KVLayout, "tiers.hbm": HbmConfig, "tiers.dram": DramConfig,
              "tiers.nvme": NvmeConfig, "tiers.nvmeof": NvmeofConfig, "peers": PeersConfig}
    nested = {"layout", "dram", "nvme", "hbm", "nvmeof", "peers"}
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
