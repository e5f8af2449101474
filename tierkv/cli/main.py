"""The ``tierkv`` command line: one table of subcommands.

Each name in :data:`COMMANDS` is a module ``tierkv.cli.<name>`` exposing
``add_parser(subparsers)``, which adds its subcommand and sets ``handler`` (a function
of the parsed arguments returning the exit status). No subcommand imports this module.
``main(argv)`` is the console-script entry point (and ``python -m tierkv``); it returns
the exit status (:mod:`tierkv.cli.exits`) instead of exiting. Subcommand modules import
only the standard library and tierkv's light modules at import time (the store, torch
and numpy load inside the handlers), so ``--help`` and argument errors stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tierkv import __version__
from tierkv.cli.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, UsageParser
from tierkv.errors import ConfigError, InputError, LayoutError, TierKVError

#: Subcommands in the order ``--help`` lists them: module names under ``tierkv.cli``.
COMMANDS = ("replay", "bench", "sim", "plan", "demo", "serve", "status", "cluster", "rig", "doctor", "format",
            "calibrate")


def build_parser() -> argparse.ArgumentParser:
    """The ``tierkv`` parser with every subcommand of :data:`COMMANDS` registered."""
    parser = UsageParser(prog="tierkv", description="A tiered KV-cache store for LLM serving.")
    parser.add_argument("--version", action="version", version=f"tierkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=UsageParser)
    for name in COMMANDS:
        importlib.import_module(f"tierkv.cli.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status instead of exiting."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        code: int = args.handler(args)
        return code
    except (InputError, ConfigError, LayoutError) as exc:
        _fail(f"error: {exc}")
        return EXIT_USAGE
    except TierKVError as exc:
        _fail(f"{type(exc).__name__}: {exc}")
        return EXIT_FAILED
    except OSError as exc:
        _fail(f"error: {exc}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        _fail("interrupted")
        return EXIT_INTERRUPTED


def _fail(message: str) -> None:
    print(f"tierkv: {' '.join(message.split())}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
