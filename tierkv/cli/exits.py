"""Exit statuses of every ``tierkv`` command, and the parser class that keeps usage
errors to one line.

0: success. 1: the run failed (an I/O error, a page that failed verification, a rig
test, a benchmark whose copies came back wrong). 2: bad input (arguments, sizes, config,
trace or model files): one line on stderr, never a traceback. 124: the rig's boot ran
past its limit. 130: interrupted (Ctrl-C). Imported by :mod:`tierkv.cli.main` and every
subcommand module; it imports nothing heavy.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130


class UsageParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")
