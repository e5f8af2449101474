"""``tierkv bench codec-store``: both codecs through a real store in one run, every page checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.codec.conftest import requires_kv
from tierkv.bench.codec_store import run_codec_store_bench
from tierkv.cli.main import main


@requires_kv
def test_codec_store_bench_figures(tmp_path: Path) -> None:
    out = run_codec_store_bench(runs=1, where=str(tmp_path), copies=1, capacity_pages=8)
    for codec in ("none", "lossless"):
        fig = out[codec]
        assert isinstance(fig, dict) and fig["put_gbps"] > 0 and fig["get_gbps"] > 0
    none, lossless = out["none"], out["lossless"]
    assert isinstance(none, dict) and isinstance(lossless, dict)
    assert none["pages_before_first_eviction"] == 8 and none["raw_page_equivalents_used"] == 1.0
    # Real BF16 pages code to about 0.65: the same tier holds clearly more of them.
    assert lossless["pages_before_first_eviction"] >= 10
    assert isinstance(out["space_ratio"], float) and out["space_ratio"] < 0.8


@requires_kv
def test_cli_codec_store_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "codec-store", "--quick", "--json", "--dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"none", "lossless", "capacity_gain", "space_ratio", "put_ratio", "get_ratio"} <= set(out)
