"""``tierkv plan`` end to end: JSON, tables, the Mooncake trace, plots and bad input (exit 2, one line)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tierkv.cli.main import main
from tierkv.plan.hardware import PROFILE_DIR

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
SMALL = ["--model", "llama-3.1-8b", "--synthetic", "300"]


def _plan(argv: list[str]) -> int:
    return main(["plan", *argv])


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    assert _plan(argv) == 0
    doc = json.loads(capsys.readouterr().out)  # exactly one JSON object: extra text fails here
    assert isinstance(doc, dict)
    return doc


def test_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, [*SMALL, "--json", "--target-hit-rate", "0.3"])
    assert doc["kv_bytes_per_token"] == 131_072 and doc["page_bytes"] == 131_072 * 16
    tiers = doc["tiers"]
    assert isinstance(tiers, list) and [t["tier"] for t in tiers] == ["hbm", "dram", "nvme", "nvmeof"]
    for t in tiers:
        for key in ("capacity_tokens", "hit_rate", "load_s_per_1k_tokens", "required_bandwidth_bytes_s",
                    "recompute_crossover_tokens", "capacity_pages", "bandwidth_ok"):
            assert key in t, key
    dram = tiers[1]
    assert dram["capacity_tokens"] == 2 * 2 * 10**12 // 131_072  # two nodes of 2 TB
    assert dram["load_s_per_1k_tokens"] == pytest.approx(20e-6 + 1000 * 131_072 / 50e9)  # latency + bytes / bw
    assert sum(t["hit_rate"] for t in tiers) == pytest.approx(doc["hit_rate"])
    assert doc["policy"]["hit_rate"] == pytest.approx(doc["hit_rate"])  # type: ignore[index]
    assert [s["scenario"] for s in doc["network"]] == ["prefill-only", "dualpath"]  # type: ignore[union-attr]
    labels = [v["label"] for v in doc["variants"]]  # type: ignore[union-attr]
    assert labels == ["bf16", "bf16+codec 0.65", "fp8_e4m3", "fp8_e4m3+codec 0.65"]
    rec = doc["recommendation"]
    assert isinstance(rec, dict) and rec["met"] and rec["hit_rate"] >= 0.3


def test_deepseek_fp8_codec_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, ["--model", "deepseek-v3", "--kv-dtype", "fp8_e4m3", "--codec-ratio", "0.65",
                         "--synthetic", "200", "--nvme", "0", "--dram", "100GB", "--json"])
    assert doc["kv_bytes_per_token"] == 61 * 576 and doc["model"]["layout_kind"] == "latent"  # type: ignore[index]
    tiers = {t["tier"]: t for t in doc["tiers"]}  # type: ignore[union-attr]
    assert set(tiers) == {"hbm", "dram", "nvmeof"}
    assert tiers["dram"]["capacity_bytes"] == 2 * 100 * 10**9
    # The store codes pages on its NVMe and NVMe-oF tiers only: DRAM holds them whole.
    assert tiers["dram"]["stored_bytes_per_token"] == 61 * 576
    assert tiers["nvmeof"]["stored_bytes_per_token"] == pytest.approx(61 * 576 * 0.65)
    assert [v["label"] for v in doc["variants"]] == ["fp8_e4m3", "fp8_e4m3+codec 0.65"]  # type: ignore[union-attr]


def test_lossy_pages_are_planned_as_a_variant_on_the_coding_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, ["--model", "llama-3.1-8b", "--lossy-bits", "4", "--synthetic", "200", "--json"])
    assert doc["lossy_bits"] == 4.0
    variants = {v["label"]: v for v in doc["variants"]}  # type: ignore[union-attr]
    lossy, plain = variants["bf16+lossy 4 bits"], variants["bf16"]
    assert lossy["codec_ratio"] == 0.25
    # NVMe holds four times the tokens; DRAM (whole pages) the same.
    assert lossy["capacity_tokens"]["nvme"] == pytest.approx(4 * plain["capacity_tokens"]["nvme"], rel=1e-6)
    assert lossy["capacity_tokens"]["dram"] == plain["capacity_tokens"]["dram"]
    assert lossy["hit_rate"] >= plain["hit_rate"]


def test_params_workload_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "smollm2-135m", "--hardware", "dev-box", "--params", "--requests", "400",
            "--request-rate", "2", "--context-tokens", "2048:8192", "--turns", "4", "--reuse", "0.8",
            "--target-ttft-s", "0.05"]
    assert _plan(argv) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "23,040 bytes/token" in out and "recommendation" in out
    assert "never" in out  # smollm2's KV loads slower from the dev box's NVMe than it recomputes


@pytest.mark.skipif(not TRACE.is_file(), reason="Mooncake trace not present")
def test_mooncake_trace_h200(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, ["--model", "llama-3.1-8b", "--hardware", "h200-node", "--trace", str(TRACE), "--json"])
    wl = doc["workload"]
    assert isinstance(wl, dict) and wl["requests"] == 12031 and wl["full_blocks"] == 276_491
    assert 0.3 < doc["hit_rate"] <= wl["unbounded_hit_rate"] + 1e-12  # type: ignore[operator]


def test_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.png"
    if importlib.util.find_spec("matplotlib") is None:
        assert _plan([*SMALL, "--plot", str(out)]) == 2
        assert "needs matplotlib" in capsys.readouterr().err
        return
    assert _plan([*SMALL, "--json", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.loads(capsys.readouterr().out)


def test_plot_without_matplotlib(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                 tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name))
    assert _plan([*SMALL, "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--plot needs matplotlib" in err


def _bad_profile(tmp_path: Path) -> str:
    text = (PROFILE_DIR / "h200-node.toml").read_text().replace('bandwidth_bytes_s = "200GB"\n', "")
    p = tmp_path / "broken.toml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama-9"], "unknown model 'llama-9'"),
    ([], "one of the arguments --model --model-config is required"),
    ([*SMALL, "--dram=-5GiB"], "--dram must be a size >= 0"),
    ([*SMALL, "--dram", "-5GiB"], "argument --dram: expected one argument"),
    ([*SMALL, "--nvme", "lots"], "cannot parse 'lots'"),
    ([*SMALL, "--kv-dtype", "int3"], "unknown KV dtype 'int3'"),
    ([*SMALL, "--codec-ratio", "1.5"], "--codec-ratio must be a finite number in [0.01, 1], got 1.5"),
    ([*SMALL, "--lossy-bits", "16"], "--lossy-bits must be bits an element, at least 1 and under 16"),
    ([*SMALL, "--lossy-bits", "nan"], "--lossy-bits must be bits an element"),
    ([*SMALL, "--lossy-bits", "1.5"], "below what this model's pages of 16 tokens code at keeping every token (1.879"),
    ([*SMALL, "--tokens-per-page", "1", "--lossy-bits", "4"], "pages of 1 tokens code at keeping every token (13.135"),
    ([*SMALL, "--kv-dtype", "fp8_e4m3", "--lossy-bits", "4"], "lossy pages code bf16, fp16 or fp32 KV"),
    (["--model", "deepseek-v3", "--synthetic", "50", "--lossy-bits", "4"], "lossy pages code K/V layouts"),
    ([*SMALL, "--tokens-per-page", "0"], "--tokens-per-page must be >= 1"),
    ([*SMALL, "--turns", "3"], "--turns describe a --params workload"),
    ([*SMALL, "--hardware", "nope"], "hardware profile 'nope'"),
    (["--model", "llama-3.1-8b", "--trace", "/nonexistent.jsonl"], "does not exist"),
    (["--model", "llama-3.1-8b", "--trace", "/nonexistent.jsonl", "--seed", "1"], "cannot be used with --trace"),
    (["--model-config", "/nonexistent/config.json"], "does not exist"),
    ([*SMALL, "--target-hit-rate", "2"], "--target-hit-rate must be in (0, 1]"),
    ([*SMALL, "--ttft-percentile", "0"], "--ttft-percentile must be in (0, 100], got 0.0"),
    ([*SMALL, "--ttft-percentile", "150"], "--ttft-percentile must be in (0, 100], got 150.0"),
    ([*SMALL, "--target-ttft-s", "1", "--ttft-percentile", "nan"], "--ttft-percentile must be in (0, 100]"),
    ([*SMALL, "--plot", "x.jpg"], "--plot: expected a .png file name, got 'x.jpg'"),
    ([*SMALL, "--hbm", "0", "--dram", "0", "--nvme", "0", "--nvmeof", "0"], "every tier is sized 0"),
    (["--model", "llama-3.1-70b", "--hardware", "dev-box", "--synthetic", "10"], "do not fit in one node"),
])
def test_bad_input_exits_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _plan(argv) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1 and message in cap.err, cap.err


def test_profile_missing_a_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _plan([*SMALL, "--hardware", _bad_profile(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[tiers.dram] is missing bandwidth_bytes_s" in err


# Review fixes: non-finite and extreme numbers are refused up front with one line naming the flag.
@pytest.mark.parametrize("argv, message", [
    ([*SMALL, "--request-rate", "inf"], "--request-rate must be a finite number in [1e-06, 1e+09]"),
    ([*SMALL, "--request-rate", "1e-300"], "--request-rate must be a finite number in [1e-06, 1e+09]"),
    ([*SMALL, "--request-rate", "nan"], "--request-rate must be a finite number"),
    ([*SMALL, "--prefill-tokens-s", "inf", "--json"], "--prefill-tokens-s must be a finite number in [1, 1e+09]"),
    ([*SMALL, "--prefill-tokens-s", "1e-300"], "--prefill-tokens-s must be a finite number in [1, 1e+09]"),
    ([*SMALL, "--codec-ratio", "1e-300"], "--codec-ratio must be a finite number in [0.01, 1]"),
    (["--model", "smollm2-135m", "--params", "--turns", "inf", "--requests", "50"],
     "--turns must be a finite number in [1, 1000]"),
    (["--model", "smollm2-135m", "--params", "--turns", "0.5"], "--turns must be a finite number in [1, 1000]"),
    ([*SMALL, "--target-ttft-s", "inf"], "--target-ttft-s must be a finite number > 0"),
    # The limit, 1 EiB, is named whether the size parser or the planner refuses the size.
    ([*SMALL, "--dram", "100000000000000TB"], "1 EiB"),
    ([*SMALL, "--dram", "1" + "0" * 400], "1 EiB"),
    ([*SMALL, "--seed", "-1"], "--seed must be >= 0, got -1"),
    ([*SMALL, "--plot", "/nonexistent-dir/plan.png"], "--plot: cannot write"),
])
def test_extreme_numbers_exit_2_with_one_line(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert _plan(argv) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1 and message in cap.err, cap.err


@pytest.mark.parametrize("flags", [
    ["--request-rate", "1e-6"], ["--request-rate", "1e9"], ["--prefill-tokens-s", "1"],
    ["--prefill-tokens-s", "1e9"], ["--codec-ratio", "0.01"], ["--dram", str(2**60)],
])
def test_extremes_inside_the_ranges_give_finite_json(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The range edges run through the arithmetic (windows, crossovers, boundaries) to strict JSON."""
    doc = _json(capsys, ["--model", "smollm2-135m", "--hardware", "dev-box", "--synthetic", "200", "--json", *flags])
    assert 0 <= doc["hit_rate"] <= 1  # type: ignore[operator]


def test_tp_not_dividing_the_gpus_leaves_idle_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    """--tp 3 on 8 GPUs: floor(8 / 3) = 2 instances and 2 idle GPUs, as docs/plan.md says."""
    doc = _json(capsys, ["--model", "llama-3.1-8b", "--synthetic", "200", "--tp", "3", "--json"])
    hw = doc["hardware"]
    assert isinstance(hw, dict) and hw["instances_per_node"] == 2 and hw["idle_gpus_per_node"] == 2
    weights = doc["model"]["weight_bytes"]  # type: ignore[index]
    assert hw["hbm_kv_space_bytes_per_node"] == int(2 * (3 * 141e9 * 0.9 - weights))
    assert doc["tiers"][0]["available_bandwidth_bytes_s"] == pytest.approx(4.8e12 * 6)  # type: ignore[index]
    assert _plan(["--model", "llama-3.1-8b", "--synthetic", "200", "--tp", "3"]) == 0
    assert "2 GPU(s) idle" in capsys.readouterr().out.replace("\n", " ")


def test_petabyte_capacities_print_in_pib(capsys: pytest.CaptureFixture[str]) -> None:
    assert _plan(["--model", "llama-3.1-8b", "--synthetic", "200", "--nvmeof", "2000TB"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("nvmeof"))
    assert "1.78 PiB" in row and "e+" not in row, row
