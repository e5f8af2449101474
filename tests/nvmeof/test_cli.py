"""``python3 -m nvmeof``: each command, --json output, exit statuses and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nvmeof.cli import main
from nvmeof.model import NvmetConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "nvmeof"
EXAMPLES = Path("/work/shared/data/nvmetcli")


def test_generate_validate_apply_save_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, root = tmp_path / "rig.json", tmp_path / "nvmet"
    root.mkdir()
    assert main(["generate", str(CONFIGS / "rig-rdma.toml"), "-o", str(out)]) == 0
    assert NvmetConfig.load(out).subsystems[0].nqn == "nqn.2026-12.io.tierkv:rig"
    assert main(["validate", str(out), "--strict-nqn", "--json"]) == 0
    capsys.readouterr()
    assert main(["apply", str(out), "--root", str(root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["method"] == "configfs" and len(report["created"]) == 8
    assert main(["save", "--root", str(root)]) == 0
    saved = json.loads(capsys.readouterr().out)
    assert saved["ports"][0]["subsystems"] == ["nqn.2026-12.io.tierkv:rig"]
    assert main(["clear", str(out), "--root", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert sorted(p.name for p in root.iterdir()) == ["hosts", "ports", "subsystems"]


def test_generate_to_stdout_and_insecure_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "open.toml"
    spec.write_text('[subsystem]\nnqn = "nqn.2026-12.io.tierkv:open"\nallow_any_host = true\n'
                    '[[namespace]]\ndevice = "/dev/nvme0n1"\n[[port]]\ntransport = "loop"\n')
    assert main(["generate", str(spec)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["subsystems"][0]["attr"]["allow_any_host"] == "1"
    assert "nvmeof: warning:" in captured.err and "ANY host" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["validate", str(EXAMPLES / "tcp.json"), "--strict-nqn"], "NQN 'nvmet-always'"),
    (["validate", "/nonexistent.json"], "cannot read"),
    (["generate", "/nonexistent.toml"], "cannot read spec"),
])
def test_errors_exit_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("nvmeof: error: ") and message in err and err.count("\n") == 1


def test_unwritable_output_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = str(CONFIGS / "rig-rdma.toml")
    (tmp_path / "nvmet").mkdir()
    for argv, path, reason in (
            (["generate", spec, "-o", "/nonexistent/x.json"], "/nonexistent/x.json", "No such file or directory"),
            (["generate", spec, "-o", str(tmp_path)], str(tmp_path), "Is a directory"),
            (["save", "--root", str(tmp_path / "nvmet"), "-o", "/nonexistent/x.json"], "/nonexistent/x.json",
             "No such file or directory")):
        assert main(argv) == 2
        assert capsys.readouterr().err == "nvmeof: error: cannot write %s: %s\n" % (path, reason)
        assert main([*argv, "--json"]) == 2
        assert json.loads(capsys.readouterr().out) == {"ok": False, "error": "cannot write %s: %s" % (path, reason)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nvmet"]  # no temp file left behind


@pytest.mark.parametrize("command", [["save"], ["clear"], ["apply", str(EXAMPLES / "rdma.json")]])
def test_a_missing_or_file_root_is_an_error(command: list[str], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    for root, reason in ((tmp_path / "absent", "does not exist"), (tmp_path / "file", "is not a directory")):
        assert main([*command, "--root", str(root)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1
        assert captured.err.startswith("nvmeof: error: ") and "root %s %s" % (root, reason) in captured.err


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: command"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["generate"], "the following arguments are required: spec"),
    (["validate", "x.json", "--bad"], "unrecognized arguments: --bad"),
])
def test_usage_errors_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("nvmeof: error: ") and message in err and err.endswith(" (see --help)\n")
    assert err.count("\n") == 1


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "generate" in capsys.readouterr().out


def test_apply_abort_and_collect_statuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "nvmet"
    (root / "ports").mkdir(parents=True)
    (root / "ports" / "2").write_text("")
    cfg = str(EXAMPLES / "rdma.json")
    assert main(["apply", cfg, "--root", str(root), "--json"]) == 2
    payload = json.loads(capsys.readouterr().out)
    assert not payload["ok"] and payload["failures"][0]["path"].endswith("ports/2")
    assert main(["apply", cfg, "--root", str(root), "--collect"]) == 1
    assert "failed:" in capsys.readouterr().out


def test_module_entry_point(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "nvmeof", "validate", str(EXAMPLES / "fc.json")],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0 and "valid (1 hosts, 1 subsystems, 1 ports)" in proc.stdout
