"""Tests of the ``tierkv`` command line (replay, bench, error handling)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

from tierkv.cli.main import main
from tierkv.config import load_config
from tierkv.errors import ConfigError

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"



@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point tempfile at an empty directory so that leftovers are visible."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    assert main(argv) == 0
    out = capsys.readouterr().out
    doc = json.loads(out)  # exactly one JSON object: any extra text fails here
    assert isinstance(doc, dict)
    return doc


def test_replay_json_default_workdir_is_removed(capsys: pytest.CaptureFixture[str], private_tmp: Path) -> None:
    doc = _run_json(capsys, ["replay", "--synthetic-requests", "200", "--page-bytes", "4KiB", "--json"])
    assert doc["requests"] == 200 and doc["workload"] == {"source": "synthetic", "seed": 0, "requests": 200}
    assert 0 <= doc["prefix_hit_rate"] <= doc["unbounded_hit_rate"] <= 1  # type: ignore[operator]
    assert "ideal_hit_rate" not in doc  # one name, as in tierkv plan's JSON and the table's "unbounded cache"
    assert doc["bytes_moved"]["dram->nvme"] > 0  # type: ignore[index]
    assert doc["pages_verified"] == doc["blocks_hit"]
    assert list(private_tmp.iterdir()) == []


def test_replay_mix_reaches_the_workload(capsys: pytest.CaptureFixture[str], private_tmp: Path) -> None:
    doc = _run_json(capsys, ["replay", "--synthetic-requests", "40", "--page-bytes", "4KiB", "--no-verify",
                             "--mix", "conversation_share=1,rag_share=0,agent_share=0", "--json"])
    assert doc["workload"] == {"source": "synthetic", "seed": 0, "requests": 40,
                               "mix": {"conversation_share": 1.0, "rag_share": 0.0, "agent_share": 0.0}}


def _serving_config(tmp_path: Path, extra: str = "") -> Path:
    """A serving config whose store and NVMe data live elsewhere (a device, in real life)."""
    cfg = tmp_path / "serving.toml"
    cfg.write_text(f"""
[store]
path = "{tmp_path / 'serving-store'}"
model_id = "m"
[layout]
num_layers = 2
num_kv_heads = 2
head_dim = 64
dtype = "bf16"
tokens_per_page = 16
[tiers.dram]
capacity_bytes = "1MiB"
[tiers.nvme]
capacity_bytes = "4MiB"
path = "{tmp_path / 'device.img'}"
{extra}""")
    return cfg


def test_replay_config_never_writes_to_the_configs_paths(capsys: pytest.CaptureFixture[str], private_tmp: Path,
                                                         tmp_path: Path) -> None:
    cfg = _serving_config(tmp_path)
    _run_json(capsys, ["replay", "--config", str(cfg), "--synthetic-requests", "30", "--json"])
    work = tmp_path / "work"
    _run_json(capsys, ["replay", "--config", str(cfg), "--synthetic-requests", "30", "--workdir", str(work), "--json"])
    assert not (tmp_path / "device.img").exists() and not (tmp_path / "serving-store").exists()
    assert (work / "nvme.data").is_file()
    assert list(private_tmp.iterdir()) == []


def test_replay_config_needs_no_layout_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = _serving_config(tmp_path)
    text = cfg.read_text()
    cfg.write_text(text[:text.index("[layout]")] + text[text.index("[tiers.dram]"):])
    doc = _run_json(capsys, ["replay", "--config", str(cfg), "--synthetic-requests", "20", "--page-bytes", "4KiB",
                             "--json"])
    assert doc["requests"] == 20
    assert doc["config"]["page_bytes"] == 4096                  # type: ignore[index]
    assert doc["config"]["dram_pages"] == 256                   # type: ignore[index]  # the config's 1 MiB
    with pytest.raises(ConfigError, match=r"\[layout\]"):       # a store still needs the table
        load_config(cfg)


def test_replay_refuses_a_seed_with_a_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n')
    assert main(["replay", "--trace", str(trace), "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert "--seed" in err and len(err.strip().splitlines()) == 1


def test_replay_refuses_fabric_and_peer_configs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = _serving_config(tmp_path, "[peers]\nserve = \"127.0.0.1:7000\"\nsecret_file = \"/peers.secret\"\n")
    assert main(["replay", "--config", str(cfg), "--synthetic-requests", "10", "--json"]) == 2
    err = capsys.readouterr().err
    assert "[peers]" in err and "secret" not in err


def test_replay_on_a_kept_store_says_it_starts_warm(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["replay", "--synthetic-requests", "30", "--page-bytes", "4KiB", "--workdir", str(tmp_path / "w"), "--json"]
    assert "warm_start" not in _run_json(capsys, argv)["workload"]  # type: ignore[operator]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["workload"]["warm_start"] is True and "starts warm" in out.err


def test_replay_keep_and_workdir(capsys: pytest.CaptureFixture[str], private_tmp: Path, tmp_path: Path) -> None:
    _run_json(capsys, ["replay", "--synthetic-requests", "30", "--page-bytes", "4KiB", "--keep", "--json"])
    kept = list(private_tmp.iterdir())
    assert len(kept) == 1 and any(kept[0].iterdir())
    work = tmp_path / "work"
    doc = _run_json(capsys, ["replay", "--synthetic-requests", "30", "--page-bytes", "4KiB", "--dram", "1MiB",
                             "--nvme", "0", "--workdir", str(work), "--no-verify", "--json"])
    assert work.is_dir() and any(work.iterdir())
    assert doc["pages_verified"] == 0 and doc["config"]["nvme"] is None  # type: ignore[index]
    assert doc["config"]["dram"]["capacity_bytes"] == 1 << 20  # type: ignore[index]


@pytest.mark.skipif(not TRACE.is_file(), reason="Mooncake trace not present")
def test_replay_trace_table(capsys: pytest.CaptureFixture[str], private_tmp: Path) -> None:
    assert main(["replay", "--trace", str(TRACE), "--limit", "100", "--page-bytes", "4KiB",
                 "--dram", "2MiB", "--nvme", "8MiB"]) == 0
    out = capsys.readouterr().out
    for word in ("dram", "nvme", "caller->dram", "GB/s", "prefix hit rate", "100 requests"):
        assert word in out


def test_replay_with_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = tmp_path / "store"
    toml = tmp_path / "store.toml"
    toml.write_text(f'[store]\npath = "{store}"\nmodel_id = "m"\n\n'
                    "[layout]\nnum_layers = 2\nnum_kv_heads = 2\nhead_dim = 64\ntokens_per_page = 16\n\n"
                    '[tiers.dram]\ncapacity_bytes = "2MiB"\n\n[tiers.nvme]\ncapacity_bytes = "16MiB"\n')
    doc = _run_json(capsys, ["replay", "--config", str(toml), "--synthetic-requests", "40", "--page-bytes", "4KiB",
                             "--dram", "1MiB", "--json"])
    cfg = doc["config"]
    assert cfg["page_bytes"] == 4096  # type: ignore[index]
    assert cfg["dram"]["capacity_bytes"] == 1 << 20 and cfg["nvme"]["capacity_bytes"] == 16 << 20  # type: ignore[index]
    assert cfg["path"] != str(store) and not store.exists()  # type: ignore[index]  # never the config's store


def test_python_dash_m_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "tierkv", "replay", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "--synthetic-requests" in proc.stdout


def _bad_trace(tmp_path: Path) -> Path:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1,\n')
    return p


@pytest.mark.parametrize("argv, fragment", [
    (["replay", "--trace", "/nonexistent/trace.jsonl"], "does not exist"),
    (["replay", "--dram", "12 parsecs"], "--dram: cannot parse"),
    (["replay", "--page-bytes", "1000"], "multiple of 2048"),
    (["replay", "--limit", "-1"], "--limit must be >= 0"),
    (["replay", "--dram", "0", "--nvme", "0", "--synthetic-requests", "1"], "without a tier"),
    (["replay", "--config", "/nonexistent/x.toml", "--synthetic-requests", "1"], "does not exist"),
    (["replay", "--trace", "x", "--synthetic-requests", "3"], "not allowed with argument"),
    (["replay", "--seed", "abc"], "invalid int value"),
    (["replay", "--seed", "-3", "--limit", "5"], "--seed must be >= 0"),
    (["replay", "--limit", "0"], "the workload has no requests"),
    (["replay", "--frobnicate"], "unrecognized arguments"),
    ([], "required"),
])
def test_bad_input_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], private_tmp: Path,
                                         argv: list[str], fragment: str) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierkv") and fragment in lines[0]
    assert "Traceback" not in captured.err
    assert list(private_tmp.iterdir()) == []


def test_bad_trace_line_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["replay", "--trace", str(_bad_trace(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2: not valid JSON" in err and len(err.strip().splitlines()) == 1


def test_bench_exits_1_when_its_copies_came_back_wrong(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    stub = types.ModuleType("tierkv.bench.net")
    stub.net_report = lambda quick=False: {"results": [], "mismatches": 3}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tierkv.bench.net", stub)
    assert main(["bench", "net", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["mismatches"] == 3
    stub.net_report = lambda quick=False: {"results": [], "mismatches": 0}  # type: ignore[attr-defined]
    assert main(["bench", "net", "--json"]) == 0


def test_bench_prints_table_or_json(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def run(args: object) -> dict[str, object]:
        seen.update(vars(args))
        return {"dram_put_vs_memcpy": 12.5, "runs": 2, "shapes": []}

    stub = types.ModuleType("tierkv.bench.headline")
    stub.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tierkv.bench.headline", stub)
    assert main(["bench", "--quick", "--runs", "2", "--dir", "/tmp/x", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"dram_put_vs_memcpy": 12.5, "runs": 2, "shapes": []}
    assert seen["quick"] is True and seen["runs"] == 2 and seen["dir"] == "/tmp/x"
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "headline ratios" in out and "DRAM tier put" in out and "12.5" in out
    assert main(["bench", "--runs", "0"]) == 2
