"""The command table: every subcommand registers from its own module, none imports the
main module back, ``--version`` prints the package version, and ``--help`` stays light."""

from __future__ import annotations

import argparse
import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import tierkv
from tierkv.cli import exits
from tierkv.cli.main import COMMANDS, build_parser, main


def test_version_is_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == exits.EXIT_OK
    assert capsys.readouterr().out.strip() == f"tierkv {tierkv.__version__}"


def test_every_command_of_the_table_is_a_subcommand() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == sorted(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_no_subcommand_imports_the_main_module(name: str) -> None:
    module = importlib.import_module(f"tierkv.cli.{name}")
    tree = ast.parse(Path(str(module.__file__)).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "tierkv.cli.main" not in imported


@pytest.mark.parametrize("name", COMMANDS)
def test_usage_errors_are_one_line_and_exit_2(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([name, "--no-such-flag"]) == exits.EXIT_USAGE
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err or "invalid choice" in err or "required" in err, err
    assert err.count("\n") == 1, err


def test_help_imports_neither_torch_nor_numpy() -> None:
    code = ("import sys\nfrom tierkv.cli.main import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'numpy', 'lmdb') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
